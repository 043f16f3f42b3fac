"""Fixtures shared by the test files; plain helpers live in helpers.py."""

from __future__ import annotations

import socket
import sys
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

# Test helpers (helpers, plugin_task_example) live beside the tests.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import Nodes  # noqa: E402


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(2)
    yield pool
    pool.shutdown(wait=True)


@pytest.fixture
async def nodes(executor: ThreadPoolExecutor) -> AsyncIterator[Nodes]:
    started = Nodes(executor)
    try:
        yield started
    finally:
        await started.stop_all()


@pytest.fixture
def refused_address() -> Iterator[str]:
    """An address nobody listens on: the socket is bound (so the port stays ours) but never
    listens, so a node's heartbeats to a raw test client are refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"
