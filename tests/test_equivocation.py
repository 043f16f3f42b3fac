"""Equivocation caught (issue 15): a member that tells members different signed things is
found out by the members themselves and banned. Real SwarmNodes on 127.0.0.1:0; the liar is a
raw grpc.aio client that signs with its own key. (The round rules, which keep replicas
identical whatever a liar's receipt says, run under a ManualClock in tests/test_averaging.py;
the process-level lies in tests/test_adversary_swarm.py.)"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from helpers import Nodes, encode, key_of, wait_until

from neuronode.averaging import AllToAll, AveragingConfig
from neuronode.averaging.agreement import Receipt, decide, lineage_hash, receipt_of, statement_of
from neuronode.codec import Contribution, ContributionEncoder, EncoderConfig, Phase
from neuronode.diloco import average
from neuronode.swarm.context import Settings
from neuronode.swarm.guard.proofs import Security
from neuronode.swarm.receipts.wire import receipt_to_pb
from neuronode.swarm.wire import PROTOCOL_VERSION, settings_to_pb
from neuronode.v1 import node_pb2 as pb
from neuronode.v1 import node_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)

N = 10_000
LIAR = key_of("liar").derived_id  # an id its key proves: a member that never met it can check its word


def liar_hello(target: object, receipts: list[Receipt], advertise: str) -> pb.HelloRequest:
    """A Hello from member LIAR (signed with its key) carrying `receipts`, signed by it too."""
    security = Security(node_id=LIAR, swarm_id=target.cfg.swarm_id, key=key_of("liar"))  # type: ignore[attr-defined]
    info = pb.NodeInfo(node_id=LIAR, swarm_id=target.cfg.swarm_id, protocol_version=PROTOCOL_VERSION,  # type: ignore[attr-defined]
                       manifest_hash=target.cfg.manifest_hash, advertise=advertise,  # type: ignore[attr-defined]
                       settings=settings_to_pb(Settings()), public_key=key_of("liar").public)
    for r in receipts:
        signed = Receipt(r.round_id, r.phase, r.maker, r.statements, public_key=key_of("liar").public)
        info.receipts.append(receipt_to_pb(Receipt(r.round_id, r.phase, r.maker, r.statements,
                                                   signature=security.sign_receipt(signed),
                                                   public_key=key_of("liar").public)))
    request = pb.HelloRequest(info=info)
    security.sign_hello(request)
    return request


async def say(node: object, request: pb.HelloRequest) -> grpc.aio.AioRpcError | None:
    async with grpc.aio.insecure_channel(node.advertise) as channel:  # type: ignore[attr-defined]
        try:
            await pb_grpc.NodeStub(channel).Hello(request, timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc
    return None


async def test_a_member_that_tells_two_members_different_receipts_is_banned_by_everyone(
        nodes: Nodes, refused_address: str) -> None:
    """The liar tells a it holds nothing of round 1 and b that it holds c's contribution. a and
    b each hold one version; each tells everyone a hash of what it holds (echo), sees the
    other's hash differ and publishes its version (dispute). Then a, b and c, who never heard
    from the liar, all hold two receipts the liar signed for one round: they ban it, and refuse
    its next Hello."""
    a = await nodes.start("a", n_elements=N)
    b = await nodes.start("b", peers=[a.advertise], n_elements=N)
    c = await nodes.start("c", peers=[a.advertise], n_elements=N)
    for node in (a, b, c):
        await wait_until(lambda n=node: len(n.table.alive()) == 2, what="the swarm to form")
    held = encode("c", torch.ones(N), round_id=1)
    held.signature = Security(node_id="c", swarm_id=a.cfg.swarm_id, key=key_of("c")).sign_statement(statement_of(held))
    held.public_key = key_of("c").public
    nothing = Receipt(1, Phase.WHOLE, LIAR, ())
    something = Receipt(1, Phase.WHOLE, LIAR, (statement_of(held),))
    assert await say(a, liar_hello(a, [nothing], refused_address)) is None
    assert await say(b, liar_hello(b, [something], refused_address)) is None
    for node in (a, b, c):
        await wait_until(lambda n=node: n.table.banned_for(LIAR) > 0, what=f"{node.cfg.node_id} to ban the liar")
    refused = await say(a, liar_hello(a, [nothing], refused_address))
    assert refused is not None and refused.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "banned" in (refused.details() or "")
    assert LIAR not in {p.node_id for p in a.table.alive()}


async def test_one_receipt_told_to_everyone_bans_nobody(nodes: Nodes, refused_address: str) -> None:
    """The same receipt, twice, to two members: one version, no ban (the echo agrees)."""
    a = await nodes.start("a", n_elements=N)
    b = await nodes.start("b", peers=[a.advertise], n_elements=N)
    await wait_until(lambda: len(a.table.alive()) == 1 and len(b.table.alive()) == 1, what="a and b to meet")
    receipt = Receipt(1, Phase.WHOLE, LIAR, ())
    for node in (a, b, a):
        assert await say(node, liar_hello(node, [receipt], refused_address)) is None
    await wait_until(lambda: all(any(e.maker_id == LIAR for e in n.peers.node_info().echoes) for n in (a, b)),
                     what="both to echo it")
    since = a.ctx.clock.now()  # each hears the other once more: the echoes crossed
    await wait_until(lambda: a.table.peers["b"].last_seen > since and b.table.peers["a"].last_seen > since,
                     what="a and b to hear each other's echo")
    assert a.table.banned_for(LIAR) == 0 and b.table.banned_for(LIAR) == 0
    assert not a.receipts.disputes and not b.receipts.disputes


async def test_a_contribution_of_a_member_we_never_met_counts_when_a_quorum_lists_it(nodes: Nodes) -> None:
    """x (a named id) contributed to round 1 and a and b hold it; c never met x (x stopped
    greeting before c joined: in the adversary run, a member that impersonates another once it
    caught up). c checks x's statement against the key it names, agrees with a and b that it
    counts, and fetches it from a: the three average the same contributions. (Before, c dropped
    the statement as unverifiable and closed the round without x, apart from a and b.)"""
    a = await nodes.start("a", n_elements=N)
    b = await nodes.start("b", peers=[a.advertise], n_elements=N)
    c = await nodes.start("c", peers=[a.advertise], n_elements=N)
    for node in (a, b, c):
        await wait_until(lambda n=node: len(n.table.alive()) == 2, what="the swarm to form")
    held = encode("x", torch.arange(N, dtype=torch.float32), round_id=1)
    held.signature = Security(node_id="x", swarm_id=a.cfg.swarm_id, key=key_of("x")).sign_statement(statement_of(held))
    held.public_key = key_of("x").public
    statement = statement_of(held)
    # One maker's word is not enough: a's receipt also lists a statement of b (whom c met) under
    # another key, and two versions of absent y under a key of its choosing (which would frame y
    # as an equivocator). c counts none of them, and bans nobody.
    forged = [forge("b", 1.0), forge("y", 1.0), forge("y", 2.0)]
    for node, listed in ((a, [held, *forged]), (b, [held])):
        node.transport.retain(1, Phase.WHOLE, [held], for_s=60)
        node.transport.publish_receipt(receipt_of(1, Phase.WHOLE, node.cfg.node_id, listed))
    await wait_until(lambda: c.transport.member_views(1, Phase.WHOLE, ["a", "b"])[0].has_receipt
                     and c.transport.member_views(1, Phase.WHOLE, ["a", "b"])[1].has_receipt,
                     what="c to hold a's and b's receipts")
    decision = decide(c.transport.receipts(1, Phase.WHOLE), [], lineage=statement.lineage)
    assert decision.agreed == {("x", 0): statement}, decision
    assert not decision.equivocators
    got = await c.transport.fetch(statement, decision.holders[("x", 0)], timeout_s=10)
    assert got is not None and got.digest == held.digest and got.public_key == key_of("x").public
    listed = {s.sender for r in c.transport.receipts(1, Phase.WHOLE) for s in r.statements}
    assert listed == {"x"}, listed
    assert c.table.banned_for("a") == 0 and c.table.banned_for("y") == 0


def forge(sender: str, value: float) -> Contribution:
    """A round-1 contribution of `sender` signed with a key that is not its own."""
    c = encode(sender, torch.full((N,), value), round_id=1)
    c.signature = Security(node_id=sender, swarm_id="net-test", key=key_of("liar")).sign_statement(statement_of(c))
    c.public_key = key_of("liar").public
    return c


async def test_a_compact_receipt_is_checked_against_its_makers_signature_before_it_waits_for_its_list(
        nodes: Nodes, refused_address: str) -> None:
    """A receipt may come as its list's digest alone, which the receiver cannot rebuild when it
    lacks the list: it keeps it until the list comes, but only once the maker's signature over
    that digest verifies. A forged one is refused at once, as a whole forged receipt is. While
    the list is on its way, a round waiting for receipts waits for this one too, even though its
    maker moved on to round 2: deciding without it could miss a second version of a
    contribution it lists (a member that was late to round 0 did, in CI)."""
    a = await nodes.start("a", n_elements=N)
    listed = Receipt(1, Phase.WHOLE, LIAR, (statement_of(encode("c", torch.ones(N), round_id=1)),))
    request = liar_hello(a, [listed], refused_address)
    request.info.round = 2
    compact = request.info.receipts[0]
    del compact.statements[:]  # the digest alone: a has no such list
    Security(node_id=LIAR, swarm_id=a.cfg.swarm_id, key=key_of("liar")).sign_hello(request)
    assert await say(a, request) is None
    assert LIAR not in a.receipts.makers(1, Phase.WHOLE) and a.receipts.coming(1, Phase.WHOLE) == {LIAR}  # waiting for its list
    (view,) = a.transport.member_views(1, Phase.WHOLE, [LIAR])
    assert view.present and not view.has_receipt and not view.past_round, view  # its receipt is coming: wait
    forged = liar_hello(a, [listed], refused_address)
    forged.info.receipts[0].signature = bytes(64)
    del forged.info.receipts[0].statements[:]
    Security(node_id=LIAR, swarm_id=a.cfg.swarm_id, key=key_of("liar")).sign_hello(forged)
    refused = await say(a, forged)
    assert refused is not None and refused.code() == grpc.StatusCode.PERMISSION_DENIED, refused


async def test_a_member_that_runs_a_round_again_decides_on_the_receipt_it_published_first(nodes: Nodes) -> None:
    """a published its receipt of round 1 in the lineage it then repaired away from, and runs
    round 1 again in the swarm's. Its word on round 1 stays the first receipt (a second would be
    equivocation), and it decides on that word as b and c do: all three average the same. Before,
    a decided on the receipt it did not publish, and parted from b and c."""
    a = await nodes.start("a", n_elements=N)
    b = await nodes.start("b", peers=[a.advertise], n_elements=N)
    c = await nodes.start("c", peers=[a.advertise], n_elements=N)
    for node in (a, b, c):
        await wait_until(lambda n=node: len(n.table.alive()) == 2, what="the swarm to form")
    first = signed("a", 0.5, base_digest="repaired-away")
    a.transport.publish_receipt(receipt_of(1, Phase.WHOLE, "a", [first]))
    held = {name: signed(name, float(i), base_digest="swarm") for i, name in enumerate("abc")}
    for node in (b, c):
        await wait_until(lambda n=node: n.transport.member_views(1, Phase.WHOLE, ["a"])[0].has_receipt,
                         what="a's first receipt to spread")
    lineage = lineage_hash("swarm", ())
    decided = await asyncio.gather(*(protocol(node).agree(1, Phase.WHOLE, dict(held), lambda: {"a", "b", "c"},
                                                          lineage=lineage, publish=True) for node in (a, b, c)))
    assert len({tuple(sorted(d)) for d in decided}) == 1, [sorted(d) for d in decided]
    assert all(n.table.banned_for("a") == 0 for n in (a, b, c))


def signed(sender: str, value: float, *, base_digest: str) -> Contribution:
    c = encode(sender, torch.full((N,), value), round_id=1, base_digest=base_digest)
    c.signature = Security(node_id=sender, swarm_id="net-test", key=key_of(sender)).sign_statement(statement_of(c))
    c.public_key = key_of(sender).public
    return c


def protocol(node: object) -> AllToAll:
    cfg = node.cfg  # type: ignore[attr-defined]
    encoder = ContributionEncoder(EncoderConfig(codec="fp32", chunk_bytes=4096, zstd_level=1, byte_shuffle=False),
                                  n_elements=N, sender_id=cfg.node_id)
    return AllToAll(AveragingConfig(node_id=cfg.node_id, codec="fp32", n_elements=N, sync_timeout_s=10.0),
                    transport=node.transport, encoder=encoder, encoder_pool=node.ctx.executor,  # type: ignore[attr-defined]
                    aggregate=average, executor=node.ctx.executor)  # type: ignore[attr-defined]
