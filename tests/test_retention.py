"""What a node keeps serving to members that missed a contribution (neuronode.swarm.streams.missed):
the latest round of each phase, never a pile of rounds. A real SwarmNode (grpc.aio on
127.0.0.1:0); its transport is what the averaging protocols call."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import Nodes, encode

from neuronode.codec import Phase

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
