"""Structured log events and throttled repeats.

A log record may carry an event: `logger.info("...", extra=fields("round_done", round_id=r,
contributors=[...]))`. The JSON log format writes `event`, `round_id`, `peer_id` and the event's
data as fields of the line, so a script or a test reads `{"event": "round_done", ...}` instead of
matching text (docs/observability in README lists the events). `Throttled` logs a recurring
condition once, then at most every `every_s`.
"""

from __future__ import annotations

import logging
from typing import Any

from neuronode.clock import Clock

FIELDS = ("event", "round_id", "peer_id")
DATA = "event_data"  # the record attribute that holds the event's other fields


def fields(event: str, *, round_id: int | None = None, peer_id: str | None = None, **data: Any) -> dict[str, Any]:
    """`extra` for a log call: the event name, where they apply the round and the peer, and any
    other JSON-able facts of the event."""
    out: dict[str, Any] = {"event": event, DATA: data}
    if round_id is not None:
        out["round_id"] = round_id
    if peer_id is not None:
        out["peer_id"] = peer_id
    return out


def record_fields(record: Any) -> dict[str, Any]:
    """The event fields a log record carries (none for a plain line)."""
    out = {name: getattr(record, name) for name in FIELDS if getattr(record, name, None) is not None}
    out.update(getattr(record, DATA, None) or {})
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
