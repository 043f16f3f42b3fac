"""Helpers for tests that start real `neuronode` processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Several nodes share 2 cores: one torch thread each, quick heartbeats, small rounds.
NODE_DEFAULTS = ["--threads", "1", "--heartbeat-s", "0.5", "--log-level", "info"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def neuronode_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "neuronode.cli", *args]


class Node:
    """One `neuronode start` process with its own data dir, port and log file."""

    def __init__(self, tmp: Path, name: str, *extra: str, port: int | None = None) -> None:
        self.name = name
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.data_dir = tmp / name
        self.log_path = tmp / f"{name}.log"
        self.extra = list(extra)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, *more: str) -> Node:
        args = ["start", "--data-dir", str(self.data_dir), "--listen", self.address,
                *NODE_DEFAULTS, *self.extra, *more]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        log = open(self.log_path, "ab")  # noqa: SIM115 - the process owns it until exit
        self.proc = subprocess.Popen(neuronode_cmd(*args), stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        return self

    def wait(self, timeout_s: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout_s)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def status(self, *, live: bool = False) -> dict[str, Any]:
        where = ["--peer", self.address] if live else ["--data-dir", str(self.data_dir)]
        out = subprocess.run(neuronode_cmd("status", *where, "--json"), capture_output=True,
                             text=True, timeout=30, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"status of {self.name} failed: {out.stderr.strip()}")
        return dict(json.loads(out.stdout))


def finish(nodes: Sequence[Node], timeout_s: float = 400) -> None:
    """Every node exits 0 within `timeout_s` (each); a failure shows that node's log tail."""
    for node in nodes:
        assert node.wait(timeout_s) == 0, f"{node.name}:\n{node.log()[-4000:]}"


def poll(what: str, predicate: Callable[[], Any], *, timeout_s: float, every_s: float = 0.2,
         context: Callable[[], str] | None = None) -> Any:
    """Wait for `predicate()` to return something truthy; fail with `what` (and `context()`,
    e.g. a log tail) at the deadline."""
    deadline = time.monotonic() + timeout_s
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - keep polling until the deadline
            last_exc = exc
        time.sleep(every_s)
    where = f"\n{context()}" if context is not None else ""
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what} (last error: {last_exc}){where}")


# grpcio's asyncio client may report a client stream the server refused before reading all of
# it as INTERNAL "Internal error from Core" instead of the server's status (grpc/grpc#36066; a
# fix is pending upstream in grpc/grpc#43486). A refusal is deterministic, so tests that check a
# refused push's status send it again when they meet this.
GRPC_EARLY_STATUS_BUG = "Internal error from Core"


def hides_refusal(code: Any, details: str) -> bool:
    """True if (code, details) is that grpcio client bug rather than the node's answer."""
    return getattr(code, "name", "") == "INTERNAL" and details == GRPC_EARLY_STATUS_BUG
