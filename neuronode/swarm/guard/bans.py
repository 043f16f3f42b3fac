"""The node's one ban list, on its clock: who is refused, for how long, and why.

A ban falls on what the node can prove, never on an id a caller merely writes in its metadata
(anyone holding the swarm's secret can write any id there):
- `node_key(id)` for an id whose own signatures proved it lied (two signed versions of one
  contribution or receipt), or that a TLS certificate names;
- `host_key(host)` for the host a refused request came from (the TCP connection proves it;
  neuronode.quorum.host: an IPv4 address, an IPv6 address's /64, so that a banned caller does
  not escape by taking another address of its network).
Callers on this machine's loopback are the owner's own processes (neuronode.quorum): there the
id a caller proves with the secret is used, and an open node never bans them.

Refused requests `strike`; `strikes_to_ban` strikes within `window_s` ban the key for
`first_ban_s`, doubling with every new ban up to `max_ban_s`. A proven liar is `ban`ned outright.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from neuronode.clock import Clock

logger = logging.getLogger(__name__)

MAX_RECORDS = 10_000  # keys remembered at most (those whose bans end first are forgotten first)


def node_key(node_id: str) -> str:
    return f"node:{node_id}"


def host_key(host: str) -> str:
    return f"host:{host}"


@dataclass
class Record:
    strikes: list[float] = field(default_factory=list)
    banned_until: float = 0.0
    ban_s: float = 0.0
    reason: str = ""


class Bans:
    """Strikes and bans by key (module docstring), read through `clock`."""

    def __init__(self, *, clock: Clock | None = None, strikes_to_ban: int = 5, window_s: float = 60.0,
                 first_ban_s: float = 30.0, max_ban_s: float = 3600.0) -> None:
        self.clock = clock or Clock()
        self.strikes_to_ban = strikes_to_ban
        self.window_s = window_s
        self.first_ban_s = first_ban_s
        self.max_ban_s = max_ban_s
        self._records: dict[str, Record] = {}

    def banned_for(self, key: str) -> float:
        """Seconds left on `key`'s ban (0: not banned)."""
        rec = self._records.get(key)
        return max(0.0, rec.banned_until - self.clock.now()) if rec else 0.0

    def banned_nodes(self) -> list[str]:
        """The node ids banned now (by `node_key`), for the status page."""
        prefix = node_key("")
        return sorted(k[len(prefix):] for k in self._records if k.startswith(prefix) and self.banned_for(k))

    def refusal(self, key: str) -> str:
        """Why `key` is refused now, for a message a person can act on; "" when it is not."""
        left = self.banned_for(key)
        return f"{key} is banned here for {left:.0f} more seconds: {self._records[key].reason}" if left else ""

    def strike(self, key: str) -> bool:
        """A request of `key` was refused as malformed, corrupt or forged; True when it is now banned."""
        now = self.clock.now()
        rec = self._record(key)
        rec.strikes = [t for t in rec.strikes if now - t < self.window_s] + [now]
        if len(rec.strikes) < self.strikes_to_ban or now < rec.banned_until:
            return False
        rec.ban_s = min(self.max_ban_s, rec.ban_s * 2 if rec.ban_s else self.first_ban_s)
        rec.banned_until, rec.strikes = now + rec.ban_s, []
        rec.reason = "repeated invalid input"
        logger.warning("banning %s for %.0f s after repeated invalid input", key, rec.ban_s)
        return True

    def ban(self, key: str, for_s: float, reason: str) -> bool:
        """Ban `key` for `for_s` (it proved itself a liar); True when the ban is new."""
        rec = self._record(key)
        new = rec.banned_until <= self.clock.now()
        if self.clock.now() + for_s > rec.banned_until:
            rec.banned_until, rec.reason = self.clock.now() + for_s, reason
        return new

    def _record(self, key: str) -> Record:
        if key not in self._records and len(self._records) >= MAX_RECORDS:
            for old in sorted(self._records, key=lambda k: self._records[k].banned_until)[:MAX_RECORDS // 10]:
                del self._records[old]
        return self._records.setdefault(key, Record())
