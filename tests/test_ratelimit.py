"""The upload cap really paces what a node sends (lower bounds only: load can only slow us)."""

from __future__ import annotations

import asyncio
import time

import pytest

from neuronode.swarm.guard.ratelimit import UploadLimiter


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


def test_upload_meter_measures_concurrent_pushes_as_one_link() -> None:
    """Three pushes of 100 bytes overlapping within 1 s are 300 B/s of link, not 100 each."""
    from neuronode.swarm.guard.ratelimit import UploadMeter

    meter = UploadMeter()
    assert meter.rate == 0.0
    for _ in range(3):
        meter.begin(10.0)
    meter.end(10.5, 100)
    meter.end(10.8, 100)
    assert meter.rate == 0.0  # still busy: no sample yet
    meter.end(11.0, 100)
    assert meter.rate == pytest.approx(300.0)
    meter.begin(20.0)  # the idle gap does not count
    meter.end(21.0, 0)  # a failed push: no bytes, no sample
    assert meter.rate == pytest.approx(300.0)
    meter.begin(30.0)
    meter.end(30.5, 100)  # 200 B/s, smoothed in
    assert meter.rate == pytest.approx(0.7 * 300 + 0.3 * 200)
