"""What a node serves others, and how long a reader may hold it: the transfers it runs for
other members (state transfers, `neuronode.swarm.statesync.donor`; missed contributions,
`neuronode.swarm.streams.missed`) take a slot each, at most a few per caller host and a bounded number
in all, and each keeps its slot only while its reader keeps a pace.

Slots are keyed by the caller's voice (`neuronode.quorum.voice`: the host its connection comes
from, an IPv6 /64, per id on our own loopback), never by its id: ids are free, so two ids on one
host share that host's slots, and no number of them can take the rest.

The pace: every write completes within `stall_s` of the one before, and by `grace_s` plus the
bytes written so far at `min_rate` after the transfer began, not counting the time our own
upload cap (`--max-upload-mbps`) held it back. A reader that takes one chunk every half minute
(under the stall) is ended once it falls `grace_s` behind the size-scaled rate, instead of
holding its slot for the whole transfer's deadline (hours, for a big state).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

from neuronode.swarm.wire import MIN_RATE_BYTES_PER_S, STALL_S, Refusal


class Slots:
    """Transfers in flight per caller voice: at most `per_host` each, `total` in all. `what`
    names a transfer in refusals ("state transfers")."""

    def __init__(self, *, per_host: int, total: int, what: str) -> None:
        assert 0 < per_host <= total
        self.per_host, self.total, self.what = per_host, total, what
        self.held: dict[str, int] = {}  # voice -> transfers in flight

    @property
    def in_flight(self) -> int:
        return sum(self.held.values())

    def check(self, voice: str) -> None:
        """Raise RESOURCE_EXHAUSTED unless `voice` may start one more transfer now."""
        if self.held.get(voice, 0) >= self.per_host:
            mine = "one" if self.per_host == 1 else f"{self.per_host}"
            raise Refusal("RESOURCE_EXHAUSTED", f"{mine} of the {self.what} from your host "
                          f"{'is' if self.per_host == 1 else 'are'} already in flight here; "
                          "finish or cancel it first, or ask another member")
        if self.in_flight >= self.total:
            raise Refusal("RESOURCE_EXHAUSTED", f"already serving {self.in_flight} {self.what} (the most this "
                          "node serves at once); ask another member, or again shortly")

    @contextmanager
    def take(self, voice: str) -> Iterator[None]:
        """Hold a slot for `voice` while the block runs (raises Refusal when none is free)."""
        self.check(voice)
        self.held[voice] = self.held.get(voice, 0) + 1
        try:
            yield
        finally:
            self.held[voice] -= 1
            if not self.held[voice]:
                del self.held[voice]


class Pace:
    """The pace one transfer's reader must keep (module docstring). `now` reads the clock the
    deadlines are on; `what` names the transfer in the refusal that ends it."""

    def __init__(self, now: Callable[[], float], *, what: str, stall_s: float = STALL_S,
                 grace_s: float = STALL_S, min_rate: float = MIN_RATE_BYTES_PER_S) -> None:
        self.now, self.what = now, what
        self.stall_s, self.grace_s, self.min_rate = stall_s, grace_s, min_rate
        self.started = now()
        self.written = 0  # bytes
        self.held_s = 0.0  # what our own upload cap held us back

    async def limited(self, acquire: Awaitable[None]) -> None:
        """Wait for our own upload cap (`acquire`); that wait never counts against the reader."""
        before = self.now()
        await acquire
        self.held_s += self.now() - before

    def deadline(self, nbytes: int) -> float:
        """When `nbytes` more must have been read, at the latest (the clock of `now`)."""
        return self.started + self.held_s + self.grace_s + (self.written + nbytes) / self.min_rate

    async def write(self, send: Awaitable[None], nbytes: int) -> None:
        """Await `send` (one write of `nbytes`) under the pace; raises Refusal DEADLINE_EXCEEDED
        when the reader is too slow (the caller then answers it and frees the slot)."""
        left = self.deadline(nbytes) - self.now()
        try:
            await asyncio.wait_for(send, timeout=max(0.0, min(self.stall_s, left)))
        except TimeoutError:
            why = (f"nothing was read for {self.stall_s:.0f} s" if left > self.stall_s else
                   f"it was read slower than {self.min_rate / 1024:.0f} KiB/s")
            raise Refusal("DEADLINE_EXCEEDED", f"{self.what} ended: {why}; the slot is freed, ask again when "
                          "you can read it") from None
        self.written += nbytes
