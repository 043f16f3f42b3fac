"""Structured log events and throttled repeats.

Log records may carry `event`, `round_id` and `peer_id` (pass them as `extra`); the JSON log
format writes them as fields, so a script or a test reads `{"event": "round_done", ...}` instead
of matching text. `Throttled` logs a recurring condition once, then at most every `every_s`.
"""

from __future__ import annotations

import logging
from typing import Any

from neuronode.clock import Clock

FIELDS = ("event", "round_id", "peer_id")


def fields(event: str, *, round_id: int | None = None, peer_id: str | None = None) -> dict[str, Any]:
    """`extra` for a log call: the event name and, where they apply, the round and the peer."""
    out: dict[str, Any] = {"event": event}
    if round_id is not None:
        out["round_id"] = round_id
    if peer_id is not None:
        out["peer_id"] = peer_id
    return out


class Throttled:
    """Log a recurring condition once per key, then at most every `every_s` seconds."""

    def __init__(self, logger: logging.Logger, clock: Clock | None = None) -> None:
        self.logger = logger
        self.clock = clock or Clock()
        self._said: dict[str, float] = {}

    def __call__(self, key: str, level: int, msg: str, *args: Any, every_s: float = 300.0,
                 extra: dict[str, Any] | None = None) -> bool:
        now = self.clock.now()
        if now - self._said.get(key, -every_s - 1.0) < every_s:
            return False
        self._said[key] = now
        self.logger.log(level, msg, *args, extra=extra)
        return True
