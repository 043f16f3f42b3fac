"""Temporary bans for callers that keep sending bad input."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass
class Record:
    strikes: list[float]
    banned_until: float = 0.0
    ban_s: float = 0.0


class Bans:
    """`strike(key)` on each refused request; `strikes_to_ban` strikes within `window_s` ban the
    key for `first_ban_s`, doubling on every new ban up to `max_ban_s`."""

    def __init__(self, *, strikes_to_ban: int = 5, window_s: float = 60.0,
                 first_ban_s: float = 30.0, max_ban_s: float = 3600.0) -> None:
        self.strikes_to_ban = strikes_to_ban
        self.window_s = window_s
        self.first_ban_s = first_ban_s
        self.max_ban_s = max_ban_s
        self._records: dict[str, Record] = {}

    def banned_for(self, key: str) -> float:
        """Seconds left on `key`'s ban (0: not banned)."""
        rec = self._records.get(key)
        return max(0.0, rec.banned_until - time.monotonic()) if rec else 0.0

    def strike(self, key: str) -> None:
        now = time.monotonic()
        rec = self._records.setdefault(key, Record(strikes=[]))
        rec.strikes = [t for t in rec.strikes if now - t < self.window_s] + [now]
        if len(rec.strikes) >= self.strikes_to_ban and now >= rec.banned_until:
            rec.ban_s = min(self.max_ban_s, rec.ban_s * 2 if rec.ban_s else self.first_ban_s)
            rec.banned_until = now + rec.ban_s
            rec.strikes = []
            logger.warning("banning %s for %.0f s after repeated invalid input", key, rec.ban_s)
        if len(self._records) > 10_000:  # bounded: forget the quietest keys
            for old in sorted(self._records, key=lambda k: self._records[k].banned_until)[:1000]:
                del self._records[old]
