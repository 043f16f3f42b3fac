"""State transfer between two real SwarmNodes: verified, and served with the daemon's default
(auto) zstd level."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import swarm_config

from neuronode.events import record_fields
from neuronode.state import GlobalState
from neuronode.swarm.node import SwarmConfig, SwarmNode


@pytest.mark.timeout(60)
@pytest.mark.parametrize("zstd_level", [-1, 0, 3])
async def test_fetch_state_verified(zstd_level: int) -> None:
    n = 300_000
    params = torch.randn(n, generator=torch.Generator().manual_seed(1))
    momentum = torch.randn(n, generator=torch.Generator().manual_seed(2))
    import hashlib

    digest = hashlib.sha256(params.numpy().astype("<f4").tobytes()).hexdigest()
    state = GlobalState(round=7, param_digest=digest, params=params, momentum=momentum, inner_steps_total=350)

    def cfg(node_id: str, peers: tuple[str, ...] = ()) -> SwarmConfig:
        return swarm_config(node_id, n_elements=n, peers=peers, zstd_level=zstd_level)

    with ThreadPoolExecutor(2) as pool:
        donor = SwarmNode(cfg("donor"), executor=pool, state_provider=lambda: state)
        address = await donor.start()
        joiner = SwarmNode(cfg("joiner", (address,)), executor=pool)
        await joiner.start()
        try:
            for _ in range(100):
                if joiner.table.alive() and donor.table.alive():
                    break
                await asyncio.sleep(0.1)
            got = await joiner.fetch_state(["donor"])
        finally:
            await joiner.stop()
            await donor.stop()
    assert got is not None
    assert got.round == 7 and got.inner_steps_total == 350 and got.param_digest == digest
    assert torch.equal(got.params, params) and got.momentum is not None and torch.equal(got.momentum, momentum)


@pytest.mark.timeout(60)
async def test_a_donor_that_lies_about_its_state_is_skipped(caplog: pytest.LogCaptureFixture) -> None:
    """A donor publishes the swarm's round-7 param_digest but serves other parameters (with a
    header that vouches for them). The joiner compares with what the rest of the lineage
    published for round 7, refuses that state and downloads the honest donor's."""
    import hashlib

    n = 50_000
    honest = torch.randn(n, generator=torch.Generator().manual_seed(1))
    forged = honest + 0.5

    def state_of(params: torch.Tensor) -> GlobalState:
        digest = hashlib.sha256(params.numpy().astype("<f4").tobytes()).hexdigest()
        return GlobalState(round=7, param_digest=digest, params=params, momentum=None, inner_steps_total=70)

    good, bad = state_of(honest), state_of(forged)

    def cfg(node_id: str, peers: tuple[str, ...] = ()) -> SwarmConfig:
        return swarm_config(node_id, n_elements=n, peers=peers)

    with ThreadPoolExecutor(2) as pool:
        liar = SwarmNode(cfg("a-liar"), executor=pool, state_provider=lambda: bad)
        address = await liar.start()
        donor = SwarmNode(cfg("b-honest", (address,)), executor=pool, state_provider=lambda: good)
        joiner = SwarmNode(cfg("joiner", (address,)), executor=pool)
        await donor.start()
        await joiner.start()
        for node in (liar, donor):
            node.state.adopted(7, good.param_digest, listen=False)  # both publish the swarm's digest for round 7
        try:
            for _ in range(100):
                if all(7 in p.digests for p in joiner.table.alive()) and len(joiner.table.alive()) == 2:
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail("the joiner never saw both donors publish round 7")
            got = await joiner.fetch_state(["a-liar", "b-honest"])
        finally:
            for node in (joiner, donor, liar):
                await node.stop()
    assert got is not None and got.param_digest == good.param_digest
    assert torch.equal(got.params, honest)
    rejected = [record_fields(r) for r in caplog.records if getattr(r, "event", "") == "donor_rejected"]
    assert [r["peer_id"] for r in rejected] == ["a-liar"]
    assert rejected[0]["reason"].startswith("its round-7 parameters hash to"), rejected
