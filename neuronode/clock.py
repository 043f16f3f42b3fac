"""Time as a parameter: every deadline rule reads and waits through a Clock.

`Clock` is the real one (time.monotonic, asyncio timers). `ManualClock` moves only when a
test calls `advance`, so the round book, shard agreement, liveness and backoff are tested in
milliseconds without sleeping: a test waits until the code under test is blocked on the clock
(`waiting`), advances it past a deadline and checks what happened.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Any


class Clock:
    """Monotonic seconds and waits with a timeout."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))

    async def wait(self, event: asyncio.Event, timeout_s: float) -> bool:
        """Wait until `event` is set (True) or `timeout_s` passed (False)."""
        if event.is_set():
            return True
        try:
            await asyncio.wait_for(event.wait(), timeout=max(0.0, timeout_s))
        except TimeoutError:
            return False
        return True


class ManualClock(Clock):
    """A clock that stands still until `advance`; timers whose time has come then fire."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        # (due, seq, timer, the event its waiter also waits for: None for a sleep)
        self._timers: list[tuple[float, int, asyncio.Future[None], asyncio.Event | None]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._now

    @property
    def waiting(self) -> int:
        """Coroutines blocked on this clock now (sleeping, or waiting with a timeout). One whose
        event is set is not: it resumes at the loop's next turn, with news it has not taken in."""
        return sum(not fut.done() and not (event is not None and event.is_set()) for _, _, fut, event in self._timers)

    def _timer(self, seconds: float, event: asyncio.Event | None = None) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._timers, (self._now + max(0.0, seconds), next(self._seq), fut, event))
        if seconds <= 0:
            self._fire()
        return fut

    def _fire(self) -> None:
        while self._timers and self._timers[0][0] <= self._now:
            _, _, fut, _ = heapq.heappop(self._timers)
            if not fut.done():
                fut.set_result(None)

    async def sleep(self, seconds: float) -> None:
        await self._timer(seconds)

    async def wait(self, event: asyncio.Event, timeout_s: float) -> bool:
        if event.is_set():
            return True
        timer: asyncio.Future[Any] = self._timer(timeout_s, event)
        waiter: asyncio.Future[Any] = asyncio.ensure_future(event.wait())
        try:
            await asyncio.wait({waiter, timer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            timer.cancel()
        return event.is_set()

    def advance(self, seconds: float) -> None:
        """Move time forward; every timer due by then fires (its waiter runs at the next await)."""
        self._now += seconds
        self._fire()
