"""Imports flow one way: pure parts know no network; the network layer builds no model."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "neuronode"

PURE = ("diloco", "codec", "training")
FORBIDDEN_IN_PURE = ("grpc", "asyncio", "socket", "neuronode.swarm", "neuronode.daemon", "neuronode.v1")
FORBIDDEN_IN_SWARM = ("torch.nn", "neuronode.training", "neuronode.diloco", "neuronode.trainer",
                      "neuronode.daemon")


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


def test_swarm_builds_no_model() -> None:
    assert offending("swarm", FORBIDDEN_IN_SWARM) == []


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
