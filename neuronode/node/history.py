"""The node's own per-round history, kept in its data dir: the curves of the status page
(`/api/history`, neuronode.node.web).

One record per round this node completed: loss, val_loss, tokens/s, sync seconds, the bytes it
sent and received during the round, and its contributors. The file is rewritten whole after
every round (a temporary file, fsync, rename), so a crash leaves the previous version, and a
restart keeps the curves. Bounded: at most `max_records` records (when full, every other record
of the older half goes, so the curves still start at the first round, more coarsely), and only
the newest `recent_ids` records keep their contributors' ids (the members table reads those;
older ones keep the count).
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from neuronode.events import fields

logger = logging.getLogger(__name__)

HISTORY_FILE = "history.json"
FORMAT_VERSION = 1
MAX_RECORDS = 2048  # about 400 kB of JSON
RECENT_IDS = 8  # newest records that keep their contributors' ids


@dataclass(frozen=True)
class RoundRecord:
    """What one completed round looked like from this node."""

    round: int  # completed rounds after it (status `round`)
    time_s: float  # unix time it closed
    loss: float | None  # None: not a number (JSON has no NaN)
    val_loss: float | None
    tokens_per_s: float
    sync_s: float
    bytes_sent: int  # during this round (every peer, contributions and control messages)
    bytes_received: int
    contributors: int
    contributor_ids: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, raw: Any) -> RoundRecord:
        """Parse one stored record; ValueError when it is not one."""
        if not isinstance(raw, dict):
            raise ValueError("not an object")
        try:
            record = cls(
                round=whole(raw["round"]), time_s=number(raw["time_s"]), loss=maybe_number(raw.get("loss")),
                val_loss=maybe_number(raw.get("val_loss")), tokens_per_s=number(raw["tokens_per_s"]),
                sync_s=number(raw["sync_s"]), bytes_sent=whole(raw["bytes_sent"]),
                bytes_received=whole(raw["bytes_received"]), contributors=whole(raw["contributors"]),
                contributor_ids=tuple(text(i) for i in raw.get("contributor_ids", ())))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"bad record: {exc}") from None
        return record

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["contributor_ids"] = list(self.contributor_ids)
        return out


def whole(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a count")
    return value


def number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{value!r} is not a finite number")
    return float(value)


def maybe_number(value: Any) -> float | None:
    return None if value is None else number(value)


def text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a string")
    return value


class History:
    """The records of one data dir in memory (changed on the event loop) and their file (written
    by `save`, which the daemon runs on its checkpoint writer thread)."""

    def __init__(self, data_dir: Path, *, max_records: int = MAX_RECORDS, recent_ids: int = RECENT_IDS) -> None:
        self.path = data_dir / HISTORY_FILE
        self.max_records = max_records
        self.recent_ids = recent_ids
        self._records: list[RoundRecord] = []

    @classmethod
    def load(cls, data_dir: Path, *, up_to_round: int | None = None, **bounds: int) -> History:
        """The history in `data_dir` (empty when there is none). A file that does not parse is
        set aside as `history.json.bad` and the history starts over; records that do not parse
        are skipped; records past `up_to_round` (a checkpoint older than the history was
        resumed) are dropped."""
        history = cls(data_dir, **bounds)
        try:
            raw = json.loads(history.path.read_text())
            if not isinstance(raw, dict) or not isinstance(raw.get("records"), list):
                raise ValueError("no list of records")
        except FileNotFoundError:
            return history
        except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            bad = history.path.with_name(HISTORY_FILE + ".bad")
            os.replace(history.path, bad)
            logger.warning("round history %s unreadable (%s); set aside as %s, starting a new one",
                           history.path, exc, bad.name, extra=fields("history_unreadable", file=str(bad)))
            return history
        records, skipped = [], 0
        for item in raw["records"]:
            try:
                records.append(RoundRecord.from_json(item))
            except ValueError:
                skipped += 1
        if skipped:
            logger.warning("round history %s: skipped %d unreadable records", history.path, skipped,
                           extra=fields("history_unreadable", file=str(history.path), skipped=skipped))
        for record in sorted(records, key=lambda r: r.round):
            if up_to_round is None or record.round <= up_to_round:
                history.add(record)
        return history

    def add(self, record: RoundRecord) -> None:
        """Append the record of a completed round (replacing records of that round or later:
        the node went back to an older checkpoint and trained them again)."""
        records = [r for r in self._records if r.round < record.round]
        records.append(record)
        for n in range(len(records) - self.recent_ids):
            if records[n].contributor_ids:
                records[n] = RoundRecord(**{**asdict(records[n]), "contributor_ids": ()})
        if len(records) > self.max_records:
            keep_new = self.max_records // 2
            records = records[:-keep_new][::2] + records[-keep_new:]
        self._records = records

    def records(self) -> list[RoundRecord]:
        return list(self._records)

    def save(self, records: list[RoundRecord]) -> None:
        """Write `records` (a copy of `records()` taken where they change; they are immutable)
        in place of the file: temporary file, fsync, rename."""
        content = json.dumps({"version": FORMAT_VERSION, "records": [r.to_json() for r in records]},
                             separators=(",", ":")).encode()
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
