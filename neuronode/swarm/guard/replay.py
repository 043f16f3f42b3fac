"""Each signed request is good once: the requests that speak for a node (Leave, FetchState,
FetchContribution, CheckReachable, Session) name the node they are for and a nonce
(neuronode.swarm.guard.proofs.request_fields), and the node they are for remembers the ones it
took (`SpentRequests`), so a replay, by whoever saw one, is refused.
"""

from __future__ import annotations

import collections
from typing import Any

from neuronode.security import auth
from neuronode.swarm.wire import MAX_ID_CHARS, Refusal


class SpentRequests:
    """The signed requests this node accepted within the freshness window, so that each is used
    once: a second use (a replay, by whoever saw it) is refused. Each is remembered for twice the
    window (a timestamp may be that far ahead of our clock and still pass) on the node's clock,
    by the digest of what its signature covers (a fresh nonce makes every honest one unique).
    Memory is bounded: at most PER_CALLER per caller (the id its signature proved) and, once
    MAX are remembered, a caller holding its fair share (MAX over the callers remembered) or
    more is refused until some expire: so at most 2 x MAX, and a caller that floods us
    refuses itself only."""

    PER_CALLER = 4096
    MAX = 1 << 16

    def __init__(self, clock: Any, *, keep_s: float = 2 * auth.DEFAULT_MAX_SKEW_S) -> None:
        self.clock = clock
        self.keep_s = keep_s
        self._order: collections.deque[tuple[float, str, bytes]] = collections.deque()  # (until, caller, key)
        self._keys: set[bytes] = set()
        self._count: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def spend(self, caller: str, key: bytes, method: str) -> None:
        """Remember `key` (a request `caller` signed) as used; raise Refusal when it was used
        already (PERMISSION_DENIED) or `caller` has too many remembered (RESOURCE_EXHAUSTED)."""
        now = self.clock.now()
        while self._order and self._order[0][0] <= now:
            _, old_caller, old = self._order.popleft()
            self._keys.discard(old)
            self._count[old_caller] -= 1
            if not self._count[old_caller]:
                del self._count[old_caller]
        if key in self._keys:
            raise Refusal("PERMISSION_DENIED", f"this {method} request was used here already: a signed request is "
                          "good once (replayed); each call signs a new one")
        mine = self._count.get(caller, 0)
        if mine >= self.PER_CALLER or (len(self._keys) >= self.MAX and mine >= self.MAX // max(1, len(self._count))):
            raise Refusal("RESOURCE_EXHAUSTED", f"{mine} signed requests of {caller[:MAX_ID_CHARS]!r} were accepted "
                          f"here in the last {self.keep_s:.0f} s, the most one caller may have; wait a minute")
        self._keys.add(key)
        self._count[caller] = mine + 1
        self._order.append((now + self.keep_s, caller, key))
