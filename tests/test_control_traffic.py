"""Membership traffic that grows gently with N (issue 18): a Hello to a live peer carries only
what it lacks (our receipts until it echoes them back, each echo once), peer exchange lists a
sample except to a newcomer, and heartbeats greet a sample (tests/test_liveness.py drives that
rule under a ManualClock). Real SwarmNodes on 127.0.0.1:0."""

from __future__ import annotations

import argparse

import pytest
import torch
from helpers import Nodes, encode, key_of, wait_until

from neuronode.averaging.agreement import decide, receipt_of, statement_of
from neuronode.bench import membership
from neuronode.codec import Contribution, Phase
from neuronode.errors import ConfigError
from neuronode.swarm.guard.proofs import Security
from neuronode.swarm.membership.peers import PEX_SAMPLE
from neuronode.swarm.receipts.wire import receipt_to_pb
from neuronode.v1 import node_pb2 as pb

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
    # A live member that lists fewer peers than a sample (it restarted before anyone declared
    # it dead) gets every peer too; one that lists a sample gets a sample.
    m = members[0]
    await wait_until(lambda: len(m.table.alive()) > PEX_SAMPLE, what="a member to know a sample's worth of peers")

    async def listed_to(known: list[pb.PeerRecord]) -> int:
        """Peers the hub's answer lists to m's Hello that lists `known`."""
        info, _ = m.peers.info_for("hub")
        request = pb.HelloRequest(info=info, known_peers=known)
        m.ctx.security.sign_hello(request)
        answer = await m.ctx.channels.stub(hub.advertise).Hello(request, timeout=10,
                                                                metadata=m.ctx.security.metadata("Hello"))
        return len(answer.known_peers)

    assert await listed_to(m.peers.known_peers(full=False)) == PEX_SAMPLE
    assert await listed_to([]) == len(hub.table.alive())  # as after a restart: it knows nobody yet


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


def signed(sender_key: str, value: float) -> Contribution:
    """A round-1 contribution of the derived id of key `sender_key`, signed by it."""
    key = key_of(sender_key)
    c = encode(key.derived_id, torch.full((N,), value), round_id=1)
    c.signature = Security(node_id=key.derived_id, swarm_id="net-test", key=key).sign_statement(statement_of(c))
    c.public_key = key.public
    return c


async def test_receipts_travel_compact_and_a_member_that_missed_a_contribution_gets_the_list_whole(
        nodes: Nodes) -> None:
    """a, b and c hold contributions p and q, d only p. A receipt to a live peer travels as its
    digest alone, which a peer holding the same list rebuilds it from; as 8-byte ids to one
    whose list differs, which a, b and c rebuild d's receipt from. d cannot rebuild theirs (it
    lacks q): it asks a maker, gets the statements whole, agrees that q counts and fetches it.
    (Before, every receipt carried every statement whole, about 210 bytes each, to every member.)"""
    names = "abcd"
    first = await nodes.start("a", n_elements=N)
    members = [first] + [await nodes.start(n, peers=[first.advertise], n_elements=N) for n in names[1:]]
    a, b, c, d = members
    for node in members:
        await wait_until(lambda n=node: len(n.table.alive()) == 3, what="the swarm to form")
    asked: dict[str, list[str]] = {n: [] for n in names}  # whom each member asked for a list whole
    for node in members:
        node.receipts.on_want = lambda maker, n=node, want=node.receipts.on_want: (
            asked[n.cfg.node_id].append(maker), want(maker))
    used: dict[str, set[str]] = {n: set() for n in "bcd"}  # the forms a's receipt took to each peer
    form = a.receipts.form
    a.receipts.form = lambda key, to: (f := form(key, to), used[to].add(f) if to in used else None)[0]  # type: ignore[method-assign]
    p, q = signed("p", 1.0), signed("q", 2.0)
    for node in (a, b, c):
        node.transport.retain(1, Phase.WHOLE, [p, q], for_s=60)
        node.transport.publish_receipt(receipt_of(1, Phase.WHOLE, node.cfg.node_id, [p, q]))
    d.transport.publish_receipt(receipt_of(1, Phase.WHOLE, "d", [p]))
    await wait_until(lambda: all(holds_receipt(x, y.cfg.node_id) for x in members for y in members if x is not y),
                     what="every member to hold every other member's receipt")
    # A member may hold a's receipt by another's echo before a sent it its own: wait for a's.
    await wait_until(lambda: all(used.values()), what="a to send its receipt to b, c and d itself")
    (to_b,) = a.peers.node_info("b").receipts or [None]
    if to_b is not None:  # b may have echoed it back already; the form a uses is what counts
        assert not to_b.statements and not to_b.statement_ids
    # To b and c (same list) the digest only; to d never the list whole unless d asked a for it
    # (else ids once d's receipt showed its list differs; once d holds a's, it asks no more).
    # Whom d asks depends on which answer comes first (a, b and c list the same digest).
    assert used["b"] == used["c"] == {"digest"}, used
    # a, b and c list one digest: d's want of that list (named to one maker) may reach a too, so a
    # sends it whole to d only once d asked some maker for a list (failed once under load when
    # this said "asked a": d had asked c, and a answered).
    assert "full" not in used["d"] or asked["d"], (used, asked)
    whole = a.peers.node_info().receipts[0]
    assert len(whole.statements) == 2
    compact = receipt_to_pb(a.receipts.own[(1, Phase.WHOLE)], "ids")
    assert compact.ByteSize() + 2 * 150 < whole.ByteSize()  # each statement whole is about 210 bytes, an id 8
    # d could not rebuild a's, b's or c's list from the digest (its own differs), nor from the
    # ids (it lacks q's statement): it asked a maker for the ids, then one for the list whole (the
    # others' name the same digest).
    assert len(asked["d"]) == 2 and set(asked["d"]) <= set("abc"), asked
    assert asked["a"] == asked["b"] == asked["c"] == ["d"], asked  # d's ids, once: they rebuilt its list from them
    decision = decide(d.transport.receipts(1, Phase.WHOLE), [statement_of(p)], lineage=statement_of(q).lineage)
    assert set(decision.agreed) == {(p.sender_id, 0), (q.sender_id, 0)}
    got = await d.transport.fetch(statement_of(q), decision.holders[(q.sender_id, 0)], timeout_s=10)
    assert got is not None and got.digest == q.digest
    for node in (a, b, c):  # they rebuilt d's list from its ids: they hold p
        (r,) = [r for r in node.transport.receipts(1, Phase.WHOLE) if r.maker == "d"]
        assert [s.sender for s in r.statements] == [p.sender_id]
