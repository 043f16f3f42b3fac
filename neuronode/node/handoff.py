"""The node's training thread when training runs in a loop of its own (a person's loop through
neuronode.library, or `neuronode start`'s): the node never steps the model itself.

`Handoff` is the executor the node's parts use for training-thread work (`Pools.train`: the
pseudo-gradient, the outer step, adopting a state, checkpoints of the model). That work runs on
the training thread itself, at the moments it hands control over:

- between two inner steps (`serve`, called by every step: nothing to do, mostly);
- at a round's end (`back`): the thread tells the node its steps are done, then runs the
  node's work until the node lets it train again (`train`), which is the only place the loop
  waits on the network, and only as long as the round requires;
- while it starts (`wait_turn`) and when it leaves (`leave`): until the node is ready, or gone.

So the model, its optimizer and the engine are only ever touched by one thread, in the order
the node asks, and the loop's own steps go on untouched between rounds.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

from neuronode.errors import NeuronodeError


class TrainingThreadGone(NeuronodeError):
    """The training thread left (or the node ended): work for it will never run."""


class Handoff(Executor):
    """Work for the training thread, and the hand-over of the thread between its loop and the node."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._work: deque[tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = deque()
        self._released = False  # the loop may train now
        self._waiting: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None = None  # the node's `train`
        self._leaving = False  # the loop is done: it trains no more
        self._ended = False  # the node is gone

    # ---- the node's side ------------------------------------------------------------------

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        """Run `fn` on the training thread, when it next hands control over."""
        future: Future[Any] = Future()
        with self._cond:
            if self._ended:
                future.set_exception(TrainingThreadGone("the node has stopped"))
                return future
            self._work.append((future, fn, args, kwargs))
            self._cond.notify_all()
        return future

    async def train(self) -> None:
        """Let the loop train, and return once it is back: at a round's end, or gone."""
        loop = asyncio.get_running_loop()
        back: asyncio.Future[None] = loop.create_future()
        with self._cond:
            if self._leaving:
                return
            self._waiting, self._released = (loop, back), True
            self._cond.notify_all()
        try:
            await back
        finally:
            with self._cond:
                if self._waiting is not None and self._waiting[1] is back:
                    self._waiting = None

    def end(self) -> None:
        """The node is gone: whoever waits for it returns; work nobody will run fails."""
        with self._cond:
            self._ended = True
            dropped, self._work = list(self._work), deque()
            self._cond.notify_all()
        for future, *_ in dropped:
            if future.set_running_or_notify_cancel():
                future.set_exception(TrainingThreadGone("the node stopped before this ran"))

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Nothing to shut down: the thread is the loop's own (Pools.shutdown calls this)."""

    # ---- the training thread's side -------------------------------------------------------

    @property
    def ended(self) -> bool:
        return self._ended

    def serve(self) -> None:
        """Between steps: run what the node asked for meanwhile (mostly nothing; a read of a
        deque's length, so a step costs nothing more)."""
        if self._work:
            self._run_queued()

    def back(self) -> None:
        """The round's steps are done: tell the node and run its work until it lets us train
        again, or is gone."""
        self._hand_back(leaving=False)
        self.wait_turn()

    def leave(self) -> None:
        """The loop trains no more: tell the node, and run its work until it is gone."""
        self._hand_back(leaving=True)
        self.wait_turn()

    def wait_turn(self) -> None:
        """Run the node's work until it lets us train (or, once leaving, until it is gone)."""
        while True:
            with self._cond:
                while not self._work and not self._ended and (self._leaving or not self._released):
                    self._cond.wait()
                if not self._work:
                    return
                future, fn, args, kwargs = self._work.popleft()
            run(future, fn, args, kwargs)

    def _hand_back(self, *, leaving: bool) -> None:
        with self._cond:
            self._released = False
            self._leaving = self._leaving or leaving
            waiting, self._waiting = self._waiting, None
        if waiting is not None:
            loop, back = waiting
            try:
                loop.call_soon_threadsafe(settle, back)
            except RuntimeError:  # that loop is closed: the node is gone
                pass

    def _run_queued(self) -> None:
        while True:
            with self._cond:
                if not self._work:
                    return
                future, fn, args, kwargs = self._work.popleft()
            run(future, fn, args, kwargs)


def run(future: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:  # handed to the node, which awaits it
        future.set_exception(exc)
    else:
        future.set_result(result)


def settle(back: asyncio.Future[None]) -> None:
    if not back.done():
        back.set_result(None)
