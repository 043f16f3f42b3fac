"""Imports flow one way (docs/architecture.md has the table this enforces): pure parts know no
network, the averaging protocols know no gRPC, the network layer builds no model, and the
benchmarks drive the averaging objects themselves instead of the daemon."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "neuronode"

PURE = ("diloco", "codec", "training")
FORBIDDEN_IN_PURE = ("grpc", "asyncio", "socket", "neuronode.averaging", "neuronode.swarm", "neuronode.node",
                     "neuronode.v1")
FORBIDDEN_IN_AVERAGING = ("grpc", "neuronode.swarm", "neuronode.node", "neuronode.v1", "neuronode.training",
                          "torch.nn")
FORBIDDEN_IN_SWARM = ("torch.nn", "neuronode.training", "neuronode.diloco", "neuronode.node")
FORBIDDEN_IN_BENCH = ("neuronode.node.daemon", "neuronode.node.rounds")
ARCHITECTURE = PKG.parent / "docs" / "architecture.md"


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def offending(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    files = sorted((PKG / folder).rglob("*.py"))
    assert files, f"no python files under {folder}"
    for path in files:
        for name in imports_of(path):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                bad.append(f"{path.relative_to(PKG.parent)} imports {name}")
    return bad


def test_pure_packages_import_no_network() -> None:
    for folder in PURE:
        assert offending(folder, FORBIDDEN_IN_PURE) == []


def test_averaging_knows_no_grpc() -> None:
    assert offending("averaging", FORBIDDEN_IN_AVERAGING) == []


def test_swarm_builds_no_model() -> None:
    assert offending("swarm", FORBIDDEN_IN_SWARM) == []


def test_bench_drives_the_protocols_not_the_daemon() -> None:
    assert offending("bench", FORBIDDEN_IN_BENCH) == []


def test_architecture_page_states_this_table() -> None:
    """docs/architecture.md's table says exactly what these tests enforce."""
    text = ARCHITECTURE.read_text()
    rows = {
        "`diloco`, `codec`, `training`": FORBIDDEN_IN_PURE, "`averaging`": FORBIDDEN_IN_AVERAGING,
        "`swarm`": FORBIDDEN_IN_SWARM, "`bench`": FORBIDDEN_IN_BENCH,
    }
    for package, forbidden in rows.items():
        line = next(ln for ln in text.splitlines() if ln.startswith(f"| {package} |"))
        assert line == f"| {package} | {', '.join(f'`{name}`' for name in forbidden)} |"


def test_scan_catches_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import grpc\nfrom neuronode.swarm.node import SwarmNode\n")
    assert {"grpc", "neuronode.swarm.node", "neuronode.swarm.node.SwarmNode"} <= imports_of(bad)


def test_keep_freed_buffers_is_accepted_by_this_machines_malloc() -> None:
    """On Linux with glibc (this machine, the image) the allocator setting takes."""
    import sys

    from neuronode.memory import keep_freed_buffers

    if not sys.platform.startswith("linux"):
        pytest.skip("glibc only")
    assert keep_freed_buffers() is True


ARENAS_SCRIPT = """
import ctypes, sys, threading
from neuronode.memory import keep_freed_buffers
if sys.argv[1] == "tuned":
    assert keep_freed_buffers()
together = threading.Barrier(4)

def work():  # four threads holding big buffers at once, as the codec, work and gRPC threads do
    together.wait()
    bufs = [bytearray(1 << 20) for _ in range(4)]
    together.wait()

threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
ctypes.CDLL(None).malloc_stats()  # one "Arena k:" paragraph per arena, on stderr
"""


def test_keep_freed_buffers_gives_threads_one_arena() -> None:
    """Thread arenas unmap their empty heaps, so buffers freed in worker threads come back as
    fresh pages every round (neuronode/memory.py has the figures); one arena keeps them."""
    import os
    import subprocess
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("glibc only")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}

    def arenas(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", ARENAS_SCRIPT, mode], capture_output=True, text=True,
                             timeout=60, check=True, env=env)
        return sum(line.startswith("Arena ") for line in out.stderr.splitlines())

    assert arenas("default") > 1  # what glibc does unasked: the test can tell the difference
    assert arenas("tuned") == 1
