"""State transfer between real SwarmNodes: verified, served with the daemon's default (auto)
zstd level, resumed from the chunks verified when a download is cut or stalls."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import pytest
import torch
from helpers import Nodes, swarm_config, wait_until

from neuronode.events import record_fields
from neuronode.state import GlobalState, state_digest
from neuronode.swarm import statesync
from neuronode.swarm.node import SwarmConfig, SwarmNode
from neuronode.swarm.wire import Refusal


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
    assert rejected[0]["reason"].startswith("its round-7 state (parameters "), rejected


def big_state(n: int = 4 << 20) -> GlobalState:
    """16 MiB of parameters and 16 of momentum: 32 chunks of 1 MiB (random: zstd keeps their size)."""
    import hashlib

    params = torch.randn(n, generator=torch.Generator().manual_seed(5))
    momentum = torch.randn(n, generator=torch.Generator().manual_seed(6))
    return GlobalState(round=7, param_digest=hashlib.sha256(params.numpy().tobytes()).hexdigest(), params=params,
                       momentum=momentum, inner_steps_total=70)


async def donors_and_joiner(nodes: Nodes, executor: ThreadPoolExecutor, state: GlobalState,
                            names: list[str]) -> tuple[object, list[SwarmNode]]:
    n = state.params.numel()
    joiner = await nodes.start("joiner", n_elements=n)
    donors = [SwarmNode(replace(joiner.cfg, node_id=name, peers=(joiner.advertise,)), executor=executor,
                        state_provider=lambda: state) for name in names]
    for donor in donors:
        await donor.start()
        nodes.running.append(donor)
        donor.state.adopted(7, state.param_digest, state_digest(state)[1], listen=False)  # what witnesses vouch for
    await wait_until(lambda: {p.node_id for p in joiner.table.alive() if 7 in p.digests} == set(names),
                     what="the joiner to hear every donor publish round 7", timeout_s=20)
    return joiner, donors


def serving(donor: SwarmNode, *, cut_after: int | None = None, stall_after: int | None = None) -> list[dict[str, object]]:
    """Wrap a donor's FetchState: its first stream is cut (or stalls) after that many chunks;
    returns, per stream served, the resume point asked for and the payload bytes written."""
    served: list[dict[str, object]] = []
    honest = donor.donor.serve

    async def serve(caller: str, write: Callable[[Any], Awaitable[None]], **resume: Any) -> None:
        first, record = not served, {**resume, "bytes": 0}
        served.append(record)

        async def counted(msg: Any) -> None:
            chunk = not msg.HasField("header")
            if first and chunk and record.get("chunks", 0) == (cut_after if stall_after is None else stall_after):
                if stall_after is not None:
                    await asyncio.Event().wait()
                raise Refusal("UNAVAILABLE", "cut")
            record["chunks"] = record.get("chunks", 0) + chunk
            record["bytes"] += len(msg.payload)  # type: ignore[operator]
            await write(msg)

        await honest(caller, counted, **resume)

    donor.donor.serve = serve  # type: ignore[method-assign]
    return served


@pytest.mark.timeout(120)
async def test_a_download_cut_at_half_resumes_without_fetching_the_first_half_again(
        nodes: Nodes, executor: ThreadPoolExecutor) -> None:
    state = big_state()
    joiner, (donor,) = await donors_and_joiner(nodes, executor, state, ["donor"])
    served = serving(donor, cut_after=16)
    got = await joiner.fetch_state(["donor"])
    assert got is not None and torch.equal(got.params, state.params) and torch.equal(got.momentum, state.momentum)
    total = 2 * state.params.numel() * 4
    assert [s.get("resume_from", 0) for s in served] == [0, 16], served
    assert served[0]["chunks"] == 16 and served[1]["chunks"] == 16, served
    assert joiner.counters.bytes_received < 1.05 * total  # the first half came once


@pytest.mark.timeout(120)
async def test_a_stalled_download_goes_on_from_the_next_donor(nodes: Nodes, executor: ThreadPoolExecutor,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(statesync, "STALL_S", 2.0)
    state = big_state()
    joiner, (a, b) = await donors_and_joiner(nodes, executor, state, ["a", "b"])
    from_a, from_b = serving(a, stall_after=10), serving(b)
    got = await asyncio.wait_for(joiner.fetch_state(["a", "b"]), timeout=60)
    assert got is not None and torch.equal(got.params, state.params)
    assert from_a[0]["chunks"] == 10 and [s["resume_from"] for s in from_b] == [10], (from_a, from_b)
    assert from_b[0]["chunks"] == 22
