"""The benches' node processes: `neuronode start` runs with their own log, stopped cleanly (and
killed after a grace) when a bench ends, SIGTERMed when the bench process dies; what a finished
node left behind (`NodeRun`: its data dir, its JSON log, its status)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STOP_GRACE_S = 10.0
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class NodeRun:
    """What one finished node left behind: its data dir and its JSON log."""

    node_id: str
    data_dir: Path
    log_path: Path

    def records(self) -> list[dict[str, Any]]:
        """Every JSON log line, in order; other lines are skipped."""
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict):
                out.append(entry)
        return out

    def events(self) -> list[tuple[float, str]]:
        """(timestamp, message) of every JSON log line, in order."""
        out = []
        for entry in self.records():
            try:
                out.append((float(entry["ts"]), str(entry["msg"])))
            except (ValueError, KeyError, TypeError):
                continue
        return out

    def status(self) -> dict[str, Any]:
        """`neuronode status --data-dir` of the stopped node."""
        from neuronode.node.status import (
            from_data_dir,  # imports torch: only once the nodes are done
        )

        return from_data_dir(str(self.data_dir))


def die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the bench process dies (Linux only)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def start_process(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with open(log_path, "wb") as log:  # the child keeps its own descriptor
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=env, preexec_fn=die_with_parent if sys.platform == "linux" else None)


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every process still running (a clean stop), SIGKILL it after a grace period."""
    running = [p for p in procs if p.poll() is None]
    for proc in running:
        proc.terminate()
    grace_end = time.monotonic() + STOP_GRACE_S
    for proc in running:
        try:
            proc.wait(timeout=max(0.0, grace_end - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
