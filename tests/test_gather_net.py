"""Gather averaging over real SwarmNodes (grpc.aio on 127.0.0.1:0): makers push to their children,
members forward down each maker's tree (neuronode.swarm.streams.forward), and every node ends the round
on one vector. A forwarder that alters what it forwards is refused by the receivers (the maker's
signature and digest), who fetch the contribution from a member whose receipt lists it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from helpers import Nodes, wait_until

from neuronode.averaging import Average, AveragingConfig, Gather
from neuronode.averaging.sortition import draw
from neuronode.codec import ContributionEncoder, EncoderConfig
from neuronode.diloco import average
from neuronode.swarm.context import Settings
from neuronode.swarm.node import SwarmNode
from neuronode.swarm.streams.forward import Copy

pytestmark = pytest.mark.timeout(90)

IDS = ["a", "b", "c", "d", "e", "f", "g"]
K = 2
BASE = "b0"
GATHER = Settings(averaging="gather", gather_makers=K)


def vector(name: str) -> torch.Tensor:
    return torch.randn(10_000, generator=torch.Generator().manual_seed(ord(name))) * 1e-2


def gather(node: SwarmNode) -> Gather:
    cfg = node.cfg
    encoder = ContributionEncoder(EncoderConfig(codec="fp32", chunk_bytes=4096, zstd_level=1, byte_shuffle=False),
                                  n_elements=cfg.n_elements, sender_id=cfg.node_id)
    return Gather(AveragingConfig(node_id=cfg.node_id, codec="fp32", n_elements=cfg.n_elements,
                                  sync_timeout_s=cfg.sync_timeout_s, makers=K),
                  transport=node.transport, encoder=encoder, encoder_pool=node.ctx.executor, aggregate=average,
                  executor=node.ctx.executor)


async def swarm(nodes: Nodes, **overrides: Any) -> dict[str, SwarmNode]:
    started: dict[str, SwarmNode] = {}
    for name in IDS:
        peers = [started[IDS[0]].advertise] if started else []
        started[name] = await nodes.start(name, peers=peers, settings=GATHER, **overrides)
    for name, node in started.items():
        await wait_until(lambda n=node, o=set(IDS) - {name}: {p.node_id for p in n.table.alive()} == o,
                         what=f"{name} to know every member")
    return started


async def one_round(started: dict[str, SwarmNode]) -> dict[str, Average]:
    protocols = {name: gather(node) for name, node in started.items()}
    prepared = await asyncio.gather(*(p.prepare(0, vector(n), base_digest=BASE, weight=1.0)
                                      for n, p in protocols.items()))
    results = await asyncio.gather(*(p.exchange(prep) for p, prep in zip(protocols.values(), prepared, strict=True)))
    return dict(zip(protocols, results, strict=True))


def check(results: dict[str, Average]) -> None:
    makers = sorted(draw(0, BASE, IDS, K).makers)
    expected = average({m: (vector(m), 1.0) for m in makers})
    for name, result in results.items():
        assert result.contributors == makers, name
        assert torch.equal(result.vector, expected), name


def fetchings(caplog: pytest.LogCaptureFixture) -> int:
    return sum(getattr(r, "event", "") == "fetching" for r in caplog.records)


async def test_members_forward_down_the_makers_trees_and_end_on_one_vector(nodes: Nodes,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    started = await swarm(nodes)
    caplog.set_level("INFO")
    check(await one_round(started))
    assert not fetchings(caplog)  # the trees reached everyone
    d = draw(0, BASE, IDS, K)
    forwarders = {n for mk in d.makers for n in IDS if n != mk and d.children(mk, n, K)}
    assert forwarders and all(started[n].forward.bytes_forwarded > 0 for n in forwarders)
    assert all(started[n].transport.missed.kept for n in IDS)  # every member serves what it averaged


async def test_a_forwarder_that_alters_what_it_forwards_changes_nothing(nodes: Nodes, caplog: pytest.LogCaptureFixture) -> None:
    """The forwarder flips a byte of every payload it passes on: its children refuse each
    stream (DATA_LOSS: not the maker's digest), fetch the contribution from a maker whose
    receipt lists it, and end on the same vector as everyone."""
    started = await swarm(nodes, sync_timeout_s=4.0)
    d = draw(0, BASE, IDS, K)
    liar = next(n for n in d.order if n not in d.makers and any(d.children(mk, n, K) for mk in d.makers))
    honest = started[liar].forward.chunks

    async def altered(child: str, copy: Copy) -> AsyncIterator[bytes]:
        async for data in honest(child, copy):
            yield data[:-1] + bytes([data[-1] ^ 0xFF])

    started[liar].forward.chunks = altered  # type: ignore[method-assign]
    caplog.set_level("INFO")
    check(await one_round(started))
    assert started[liar].forward.bytes_forwarded > 0  # it did forward, altered
    assert fetchings(caplog), "nobody fetched what the liar altered"
