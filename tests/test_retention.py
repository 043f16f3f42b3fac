"""What a node keeps serving to members that missed a contribution (neuronode.swarm.streams.missed):
the latest round of each phase, never a pile of rounds (a real SwarmNode, grpc.aio on
127.0.0.1:0; its transport is what the averaging protocols call); and what an averaging holds of
the rounds it averaged (in process, neuronode.averaging.local)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch
from helpers import Nodes, encode

from neuronode.averaging import AllToAll, AveragingConfig, RoundState
from neuronode.averaging.local import LocalSwarm
from neuronode.codec import ContributionEncoder, EncoderConfig, Phase
from neuronode.diloco import average

pytestmark = pytest.mark.timeout(60)


async def test_a_node_serves_the_latest_round_of_a_phase_and_lets_older_ones_go(nodes: Nodes) -> None:
    """Short rounds under a long --sync-timeout: every round retains every member's contribution
    (for replays one round behind). Before, each round's stayed until the 2 x --sync-timeout ran
    out, so a node held a contribution per member and round (bench sync, all-to-all 25M fp32:
    3.2 GB peak RSS per node and 340,000 page faults a round, against 1.3 GB and 600 before)."""
    node = await nodes.start("a", sync_timeout_s=600.0)
    transport, missed = node.transport, node.transport.missed
    for round_id in range(4):
        held = [encode(sender, torch.full((1000,), float(round_id)), round_id=round_id) for sender in ("b", "c")]
        transport.retain(round_id, Phase.WHOLE, held, for_s=1200.0)
        transport.retain(round_id, Phase.WHOLE, held[:1], for_s=1200.0)  # what the round agreed on
        assert {(s.round_id, s.sender) for s in missed.kept} == {(round_id, "b")}, round_id
    # Another phase keeps its own latest round.
    shard = replace(encode("b", torch.zeros(1000), round_id=3), phase=Phase.AVERAGED)
    transport.retain(3, Phase.AVERAGED, [shard], for_s=1200.0)
    assert {(s.round_id, s.phase) for s in missed.kept} == {(3, Phase.WHOLE), (3, Phase.AVERAGED)}
    assert missed.retained_bytes == 2 * 4000


async def test_an_averaging_that_nobody_asks_to_keep_a_round_lets_its_contributions_go() -> None:
    """What a round averaged is held for catching up by rounds (`keep`) only when it is fewer
    bytes than the round's fp32 update; else it is let go when the round ends. Before, every
    averaging held the whole contributions of its last three rounds until `keep` took them, and
    the bench and a library's own loop never call it (bench sync, all-to-all 25M fp32: 2.4 GB
    peak RSS per node, 300,000 page faults and 7 CPU s a round, against 1.4 GB, 8,000 and 2.8 s
    at 3fbe2b1). Three members, fp32: each round's three contributions are 3x its update."""
    n = 3000
    swarm, pools = LocalSwarm(), (ThreadPoolExecutor(1), ThreadPoolExecutor(2))
    averaged: dict[int, list[tuple[str, weakref.ref]]] = {}  # round -> what a averaged of it (weakly), by maker
    protocols = {}
    for name in "abc":
        transport = swarm.join(name, state=RoundState())
        protocols[name] = AllToAll(
            AveragingConfig(node_id=name, codec="fp32", n_elements=n, sync_timeout_s=60.0, min_contributors=3),
            transport=transport, aggregate=average, encoder_pool=pools[0], executor=pools[1],
            encoder=ContributionEncoder(EncoderConfig(codec="fp32", chunk_bytes=4096, zstd_level=0, byte_shuffle=False),
                                        n_elements=n, sender_id=name))
    retain = protocols["a"].transport.retain

    def spy(round_id, phase, contributions, *, for_s):  # noqa: ANN001, ANN202
        contributions = list(contributions)
        averaged[round_id] = [(c.sender_id, weakref.ref(c)) for c in contributions]
        retain(round_id, phase, contributions, for_s=for_s)

    protocols["a"].transport.retain = spy  # type: ignore[method-assign]

    async def one_round(name: str, round_id: int) -> None:
        protocol = protocols[name]
        prepared = await protocol.prepare(round_id, torch.full((n,), float(round_id + ord(name))), base_digest="d0",
                                          weight=1.0)
        await protocol.exchange(prepared)

    try:
        for round_id in range(4):
            await asyncio.gather(*(one_round(name, round_id) for name in "abc"))
            for member in swarm.members.values():
                member.state.round = round_id + 1
    finally:
        for pool in pools:
            pool.shutdown()
    gc.collect()
    assert len(averaged[3]) == 3 and all(ref() is not None for _, ref in averaged[3])  # the latest, still served
    # Older rounds are gone, but for our own contribution of round 2: its push window is open
    # until we send for round 4 (as the gRPC outbox keeps it).
    alive = [(r, maker) for r in range(3) for maker, ref in averaged[r] if ref() is not None]
    assert alive == [(2, "a")]
