"""The two lanes of a session we carry for a member nobody can dial (neuronode.swarm.links.sessions):
control first (Hellos, the latest of each maker, at most one per member), then data (chunks, in
order, at most DATA_MESSAGES waiting: a contribution waits for room). A writer takes control
before the next chunk, so a contribution streaming over a capped home link never delays the
news that keeps its receiver's view of the swarm live.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass, field

from neuronode.swarm.membership.table import MAX_MEMBERS
from neuronode.v1 import node_pb2 as pb

DATA_MESSAGES = 8  # chunks waiting to be written to one session


class SessionClosed(Exception):
    """The session a contribution was streaming over ended; the push is retried."""


Queued = tuple[pb.SessionMessage, "asyncio.Future[None] | None"]  # a message, and who waits for it to go out


@dataclass(eq=False)
class Carried:
    """A session we carry for a member peers cannot dial: a control lane (Hellos, the latest
    per maker) written before the data lane (chunks, in order, at most DATA_MESSAGES waiting)."""

    peer_id: str
    control: dict[str, pb.SessionMessage] = field(default_factory=dict)
    data: deque[Queued] = field(default_factory=deque)
    streams: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    closed: bool = False
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # something waits to be written
    room: asyncio.Event = field(default_factory=asyncio.Event)  # the data lane took one out

    def offer(self, key: str, msg: pb.SessionMessage) -> None:
        """A control message, replacing any older one under `key` (the same maker's news)."""
        if self.closed:
            return
        self.control.pop(key, None)
        if len(self.control) < MAX_MEMBERS:  # Hellos waiting: the latest per maker, one per member
            self.control[key] = msg
            self.ready.set()

    async def put(self, msg: pb.SessionMessage, *, written: bool = False) -> None:
        """Queue a data message (waiting for room); with `written`, return only once it went
        out on the session, and raise SessionClosed if the session ended first."""
        while not self.closed and len(self.data) >= DATA_MESSAGES:
            self.room.clear()
            await self.room.wait()
        if self.closed:
            raise SessionClosed(f"the session of {self.peer_id} ended")
        done = asyncio.get_running_loop().create_future() if written else None
        self.data.append((msg, done))
        self.ready.set()
        if done is not None:
            await done

    async def take(self, timeout_s: float) -> Queued | None:
        """The next message to write (control first), or None after `timeout_s` of nothing."""
        if not self.control and not self.data:
            self.ready.clear()
            try:
                await asyncio.wait_for(self.ready.wait(), timeout=timeout_s)
            except TimeoutError:
                return None
        if self.control:
            return self.control.pop(next(iter(self.control))), None
        if self.data:
            item = self.data.popleft()
            self.room.set()
            return item
        return None  # ended meanwhile

    def end(self) -> None:
        """The session ended: what still waited is dropped, and whoever waits for it to go out
        learns so (a push then goes again, over the next session)."""
        self.closed = True
        while self.data:
            fail(self.data.popleft()[1], self.peer_id)
        self.control.clear()
        self.room.set()
        self.ready.set()


def fail(done: asyncio.Future[None] | None, peer_id: str) -> None:
    if done is not None and not done.done():
        done.set_exception(SessionClosed(f"the session of {peer_id} ended before this went out"))
