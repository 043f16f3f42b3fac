"""The upload cap really paces what a node sends (lower bounds only: load can only slow us)."""

from __future__ import annotations

import asyncio
import time

import pytest

from neuronode.swarm.ratelimit import UploadLimiter


@pytest.mark.timeout(30)
async def test_limiter_paces_shared_streams() -> None:
    limiter = UploadLimiter(8.0, burst_s=0.1)  # 1 MB/s
    started = time.monotonic()

    async def stream(n_chunks: int) -> None:
        for _ in range(n_chunks):
            await limiter.acquire(100_000)

    await asyncio.gather(stream(10), stream(10))  # 2 MB over two concurrent streams
    assert time.monotonic() - started >= 2.0 - 0.1 - 0.05


async def test_no_cap_never_schedules() -> None:
    limiter = UploadLimiter(0.0)
    assert not limiter.enabled
    for _ in range(1000):
        await limiter.acquire(10**9)
    assert limiter._next == 0.0
