"""What a node prints: log lines (text, or JSON records with `event`, `round_id` and `peer_id`
where they apply) and, on a terminal, one live progress line rewritten in place."""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import Sequence
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


def format_tokens(n: float) -> str:
    """1234 -> 1.2k, 3_400_000 -> 3.4M."""
    for bound, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= bound:
            return f"{n / bound:.1f}{unit}"
    return f"{n:.0f}"


def round_seconds(end_times: Sequence[float], *, last: int = 5) -> float:
    """Mean wall time of the last `last` rounds (training and averaging), from the times they
    ended; 0.0 before two rounds ended."""
    times = list(end_times)[-(last + 1):]
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) >= 2 else 0.0


def eta_s(*, round_id: int, rounds: int, step: int, inner_steps: int, step_s: float, round_s: float) -> float | None:
    """Seconds until --rounds ends (None without --rounds): the rest of this round at the
    measured step time, then each round left at the measured time of a whole round, or, before
    two rounds ended, at inner steps x step time (averaging not counted yet)."""
    if not rounds:
        return None
    left = max(rounds - round_id - 1, 0)
    return max(inner_steps - step, 0) * step_s + left * (round_s or inner_steps * step_s)


def progress_line(*, round_id: int, rounds: int, step: int, inner_steps: int, loss: float, lr: float,
                  tokens_per_s: float, tokens_per_batch: int, peers: int, tokens_per_round: int = 0,
                  round_s: float = 0.0) -> str:
    """round 3/10 [#####...] step 12/50 loss 2.713 lr 2.9e-03 1,234 tok/s 51.2k tok/round peers 2 ETA 4m10s

    ETA is the time to the end of --rounds (without: of this round); tokens_per_round is what a
    round trains on (inner steps x micro-batches x processes), round_s a whole round's measured
    wall time (0: not known yet)."""
    filled = round(20 * step / inner_steps)
    per_step = tokens_per_round / inner_steps if tokens_per_round else tokens_per_batch
    step_s = per_step / tokens_per_s if tokens_per_s else 0.0
    eta = eta_s(round_id=round_id, rounds=rounds, step=step, inner_steps=inner_steps, step_s=step_s, round_s=round_s)
    total = f"/{rounds}" if rounds else ""
    per_round = f" {format_tokens(tokens_per_round)} tok/round" if tokens_per_round else ""
    return (f"round {round_id + 1}{total} [{'#' * filled}{'.' * (20 - filled)}] step {step}/{inner_steps} "
            f"loss {loss:.3f} lr {lr:.2e} {tokens_per_s:,.0f} tok/s{per_round} peers {peers} "
            f"ETA {format_eta((inner_steps - step) * step_s if eta is None else eta)}")


def download_line(*, donor: str, done_bytes: int, total_bytes: int, bytes_per_s: float, eta_s: float) -> str:
    """state from p1 [#######.............] 70.2/200.0 MB 2.45 MB/s ETA 0m53s"""
    filled = round(20 * done_bytes / max(total_bytes, 1))
    return (f"state from {donor} [{'#' * filled}{'.' * (20 - filled)}] {done_bytes / 1e6:.1f}/{total_bytes / 1e6:.1f} MB "
            f"{bytes_per_s / 1e6:.2f} MB/s ETA {format_eta(eta_s)}")
