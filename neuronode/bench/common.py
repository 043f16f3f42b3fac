"""What the benchmarks share: their error, worker bookkeeping and the `python -m` entry point.
Imports neither torch nor grpc (a benchmark's parent process stays light)."""

from __future__ import annotations

import argparse
import functools
import json
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from neuronode.errors import ConfigError, NeuronodeError

POLL_S = 0.05


class BenchError(NeuronodeError):
    """A benchmark's worker or node failed or overran its deadline; the message quotes its log."""


_HANDED_OUT: set[int] = set()
LOWEST_PORT = 10_000


def free_port() -> int:
    """A loopback port for a node this process starts to listen on. Not one the kernel picks
    (bind to port 0): those come from its ephemeral range, where any outgoing connection on the
    machine may take the port in the moment between our check and the node's bind (a node then
    failed to start in CI: "Failed to bind"). So: a random port below that range, free when
    checked, never handed out twice by this process."""
    rng = random.SystemRandom()
    top = _ephemeral_floor()
    for _ in range(1000):
        port = rng.randrange(LOWEST_PORT, top)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise BenchError(f"no free loopback port between {LOWEST_PORT} and {top}")


def _ephemeral_floor() -> int:
    """The lowest port of the kernel's ephemeral range (Linux; 32768 elsewhere)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
    return low if low > LOWEST_PORT + 1000 else 32768


def log_tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        return "(no log)"
    return " | ".join(text.splitlines()[-lines:]) or "(empty log)"


def wait_all(procs: Sequence[subprocess.Popen[bytes]], names: Sequence[str], logs: Sequence[Path], *,
             deadline: float, hint: str = "") -> None:
    """Return when every process exited 0; raise BenchError, quoting the log, at the first
    failure or at the deadline (`hint` says what to try then)."""
    while True:
        codes = [p.poll() for p in procs]
        for name, log, code in zip(names, logs, codes, strict=True):
            if code not in (None, 0):
                raise BenchError(f"{name} exited with status {code}: {log_tail(log)}")
        if all(code == 0 for code in codes):
            return
        if time.monotonic() >= deadline:
            late = [i for i, code in enumerate(codes) if code is None]
            raise BenchError(f"{', '.join(names[i] for i in late)} still running at the deadline; killed "
                             f"({hint}{names[late[0]]}: {log_tail(logs[late[0]])})")
        time.sleep(POLL_S)


def check(*rules: tuple[bool, str]) -> None:
    """Raise a ConfigError with the message of the first rule that does not hold."""
    for ok, message in rules:
        if not ok:
            raise ConfigError(message)


def entry_points(name: str, help: str, configure: Callable[[argparse.ArgumentParser], None],
                 run: Callable[[argparse.Namespace], dict[str, Any]]) -> tuple[Callable[[Any], None], Callable[..., int]]:
    """A benchmark's `add_parser(subparsers)` (for `neuronode bench NAME`) and `main(argv)` (for
    `python -m neuronode.bench.NAME`, the same flags)."""

    def add_parser(subparsers: Any) -> None:
        configure(subparsers.add_parser(name, help=help))

    return add_parser, functools.partial(module_main, f"python -m neuronode.bench.{name}", configure, run)


def module_main(prog: str, configure: Callable[[argparse.ArgumentParser], None],
                run: Callable[[argparse.Namespace], dict[str, Any]], argv: Sequence[str] | None) -> int:
    """`python -m neuronode.bench.X ...`: the flags of `neuronode bench X`, one JSON object out."""
    parser = argparse.ArgumentParser(prog=prog, allow_abbrev=False)
    configure(parser)
    args = parser.parse_args(argv)
    try:
        print(json.dumps(run(args), sort_keys=True))
    except NeuronodeError as exc:
        print(f"neuronode: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0
