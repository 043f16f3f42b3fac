"""What a node prints: log lines (text, or JSON records with `event`, `round_id` and `peer_id`
where they apply) and, on a terminal, one live progress line rewritten in place."""

from __future__ import annotations

import json
import logging
import sys
import threading
from typing import Any

from neuronode.events import record_fields


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {"ts": round(record.created, 3), "level": record.levelname.lower(),
                                 "logger": record.name, "msg": record.getMessage()}
        entry.update(record_fields(record))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class Progress:
    """A single status line rewritten in place on a terminal; silent otherwise."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self._lock = threading.Lock()

    def show(self, line: str) -> None:
        if self.enabled:
            with self._lock:
                sys.stderr.write("\r\x1b[2K" + line)
                sys.stderr.flush()

    def clear(self) -> None:
        if self.enabled:
            with self._lock:
                sys.stderr.write("\r\x1b[2K")
                sys.stderr.flush()


class LogHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Clears the live progress line before a log line, so the two never share a line."""

    progress: Progress | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.progress is not None:
            self.progress.clear()
        super().emit(record)


def setup_logging(fmt: str, level: str) -> None:
    handler = LogHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("grpc").setLevel(logging.WARNING)


def attach_progress(progress: Progress) -> None:
    """Make the log handler clear `progress` before every line."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, LogHandler):
            handler.progress = progress


def format_eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def progress_line(*, round_id: int, rounds: int, step: int, inner_steps: int, loss: float, lr: float,
                  tokens_per_s: float, tokens_per_batch: int, peers: int) -> str:
    """round 3/10 [#####...] step 12/50 loss 2.713 lr 2.9e-03 1,234 tok/s peers 2 ETA 4m10s"""
    filled = round(20 * step / inner_steps)
    step_s = tokens_per_batch / tokens_per_s if tokens_per_s else 0.0
    left_steps = inner_steps - step + ((rounds - round_id - 1) * inner_steps if rounds else 0)
    total = f"/{rounds}" if rounds else ""
    return (f"round {round_id + 1}{total} [{'#' * filled}{'.' * (20 - filled)}] step {step}/{inner_steps} "
            f"loss {loss:.3f} lr {lr:.2e} {tokens_per_s:,.0f} tok/s peers {peers} ETA {format_eta(left_steps * step_s)}")


def download_line(*, donor: str, done_bytes: int, total_bytes: int, bytes_per_s: float, eta_s: float) -> str:
    """state from p1 [#######.............] 70.2/200.0 MB 2.45 MB/s ETA 0m53s"""
    filled = round(20 * done_bytes / max(total_bytes, 1))
    return (f"state from {donor} [{'#' * filled}{'.' * (20 - filled)}] {done_bytes / 1e6:.1f}/{total_bytes / 1e6:.1f} MB "
            f"{bytes_per_s / 1e6:.2f} MB/s ETA {format_eta(eta_s)}")
