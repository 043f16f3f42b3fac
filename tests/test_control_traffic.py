"""Membership traffic that grows gently with N (issue 18): a Hello to a live peer carries only
what it lacks (our receipts until it echoes them back, each echo once), peer exchange lists a
sample except to a newcomer, and heartbeats greet a sample (tests/test_liveness.py drives that
rule under a ManualClock). Real SwarmNodes on 127.0.0.1:0."""

from __future__ import annotations

import argparse

import pytest
from helpers import Nodes, wait_until

from neuronode.averaging.agreement import receipt_of
from neuronode.bench import membership
from neuronode.codec import Phase
from neuronode.errors import ConfigError
from neuronode.swarm.peers import PEX_SAMPLE

pytestmark = pytest.mark.timeout(120)

N = 10_000


def holds_receipt(node: object, maker: str) -> bool:
    return maker in node.receipts.makers(1, Phase.WHOLE)  # type: ignore[attr-defined]


async def test_a_receipt_rides_hellos_to_a_peer_until_it_echoes_it_back(nodes: Nodes) -> None:
    """a publishes a receipt: its Hellos to b and c carry it until each echoes it back, then no
    more (a Hello to everyone, as a relay forwards, still does); b tells c its echo of a's
    receipt once. c restarts: its next Hello echoes nothing of a's, so a sends the receipt again."""
    a = await nodes.start("a", n_elements=N)
    b = await nodes.start("b", peers=[a.advertise], n_elements=N)
    c = await nodes.start("c", peers=[a.advertise], n_elements=N)
    for node in (a, b, c):
        await wait_until(lambda n=node: len(n.table.alive()) == 2, what="the swarm to form")
    a.transport.publish_receipt(receipt_of(1, Phase.WHOLE, "a", []))
    await wait_until(lambda: holds_receipt(b, "a") and holds_receipt(c, "a"), what="b and c to hold a's receipt")
    await wait_until(lambda: not a.peers.node_info("b").receipts and not a.peers.node_info("c").receipts,
                     what="b and c to echo a's receipt back")
    assert len(a.peers.node_info().receipts) == 1
    assert any(e.maker_id == "a" for e in b.peers.node_info("a").echoes)  # its acknowledgement, every time
    await wait_until(lambda: not any(e.maker_id == "a" for e in b.peers.node_info("c").echoes),
                     what="b's echo of a's receipt to reach c")
    await wait_until(lambda: not any(e.maker_id == "a" for e in c.peers.node_info("b").echoes),
                     what="c's echo of a's receipt to reach b")
    # c restarts with the same id and key: it holds nothing of a's until a sends it again.
    address = c.advertise
    await nodes.stop(c)
    c = await nodes.start("c", peers=[a.advertise], n_elements=N, listen=address, advertise=address)
    await wait_until(lambda: holds_receipt(c, "a"), what="the restarted c to get a's receipt again")


async def test_peer_exchange_lists_every_peer_to_a_newcomer_and_a_sample_to_the_others(nodes: Nodes) -> None:
    """A newcomer learns every member from the first answer; a Hello to a member that knows the
    swarm lists a sample of PEX_SAMPLE."""
    many = dict(n_elements=N, heartbeat_s=1.0, max_ids_per_host=64)  # all on 127.0.0.1
    hub = await nodes.start("hub", **many)
    members = [await nodes.start(f"m{n:02d}", peers=[hub.advertise], **many) for n in range(PEX_SAMPLE + 4)]
    await wait_until(lambda: len(hub.table.alive()) == len(members), what="the hub to know every member", timeout_s=60)
    newcomer = await nodes.start("newcomer", **many)  # no bootstrap peer: it greets only whom we tell it to
    assert await newcomer.peers.hello(hub.advertise)
    assert {m.advertise for m in members} <= newcomer.table.addresses  # all from the hub's first answer
    assert len(hub.peers.known_peers(full=False)) == PEX_SAMPLE
    assert len(hub.peers.known_peers()) == len(hub.table.alive())


def test_bench_membership_measures_less_heartbeat_traffic_than_the_greet_everyone_reference() -> None:
    """`neuronode bench membership` at a small size: every member greets at most every peer a
    heartbeat, and once each peer holds the round's receipts, heartbeats no longer carry them
    (bytes are counted, never seconds)."""
    parser = argparse.ArgumentParser()
    membership.configure(parser)
    result = membership.run(parser.parse_args(["--members", "6", "--rounds", "1", "--heartbeats", "3",
                                               "--heartbeat-s", "0.5"]))
    assert {"members", "fanout", "control_bytes_per_member_per_heartbeat", "hellos_per_member_per_heartbeat",
            "control_bytes_per_member_per_round", "reference_control_bytes_per_member_per_heartbeat",
            "reference_hellos_per_member_per_heartbeat", "reference_control_bytes_per_member_per_round",
            "heartbeat_bytes_ratio"} <= set(result)
    assert result["fanout"] == 5 and result["members_that_lost_a_peer"] == 0
    assert 0 < result["heartbeat_bytes_ratio"] < 0.8, result
    with pytest.raises(ConfigError, match="--members 1"):
        membership.run(parser.parse_args(["--members", "1"]))
