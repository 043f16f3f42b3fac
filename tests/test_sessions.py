"""Sessions (issue 16): a node peers cannot dial takes part through sessions it opens to
reachable members, and nobody dials it. Real SwarmNodes on 127.0.0.1:0; `--reachable no` stands
in for a NAT here (tests/test_nat.py puts a node behind a real one)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import grpc
import pytest
import torch
from helpers import Nodes, chunks_of, encode, key_of, wait_until

from neuronode.averaging import AllToAll, AveragingConfig, Prepared
from neuronode.codec import ContributionEncoder, EncoderConfig, Phase
from neuronode.diloco import average
from neuronode.swarm.guard.proofs import Security
from neuronode.swarm.guard.trust import agreed_host
from neuronode.swarm.links.lanes import Carried, SessionClosed
from neuronode.swarm.streams.chunks import maker_chunks
from neuronode.swarm.wire import Refusal
from neuronode.v1 import node_pb2 as pb

pytestmark = pytest.mark.timeout(120)

N = 10_000


def alive_ids(node: object) -> set[str]:
    return {p.node_id for p in node.table.alive()}  # type: ignore[attr-defined]


async def exchange(node: object, seed: int) -> object:
    cfg = node.cfg  # type: ignore[attr-defined]
    encoder = ContributionEncoder(EncoderConfig(codec="fp32", chunk_bytes=4096, zstd_level=1, byte_shuffle=False),
                                  n_elements=N, sender_id=cfg.node_id)
    protocol = AllToAll(AveragingConfig(node_id=cfg.node_id, codec="fp32", n_elements=N, sync_timeout_s=20.0,
                                        min_contributors=3),
                        transport=node.transport, encoder=encoder, encoder_pool=node.ctx.executor,  # type: ignore[attr-defined]
                        aggregate=average, executor=node.ctx.executor)  # type: ignore[attr-defined]
    own = encode(cfg.node_id, torch.randn(N, generator=torch.Generator().manual_seed(seed)))
    return await protocol.exchange(Prepared(round_id=0, parts=[own], compensated=own.data.decode()))


async def test_a_node_nobody_can_dial_averages_over_its_sessions_and_is_never_dialed(nodes: Nodes) -> None:
    a = await nodes.start("a", n_elements=N)
    b = await nodes.start("b", peers=[a.advertise], n_elements=N)
    home = await nodes.start("home", peers=[a.advertise], n_elements=N, reachable="no")
    for node, others in ((a, {"b", "home"}), (b, {"a", "home"}), (home, {"a", "b"})):
        await wait_until(lambda n=node, o=others: alive_ids(n) == o, what=f"{node.cfg.node_id} to know {others}")
    await wait_until(lambda: home.status()["sessions"] == ["a", "b"], what="home's sessions to a and b")
    assert home.peers.node_info().reachable == pb.REACHABILITY_NO
    assert all(not n.table.peers["home"].reachable for n in (a, b))
    results = await asyncio.gather(*(exchange(n, seed) for seed, n in enumerate((a, b, home))))
    assert all(r.contributors == ["a", "b", "home"] for r in results)  # type: ignore[attr-defined]
    assert all(torch.equal(r.vector, results[0].vector) for r in results)  # type: ignore[attr-defined]
    # Nobody dialed home: no channel to its address anywhere, yet it heard everyone.
    assert all(home.advertise not in n.ctx.channels.addresses() for n in (a, b))


async def test_two_nodes_nobody_can_dial_hear_each_other_through_a_relay_that_cannot_alter(nodes: Nodes) -> None:
    """Two nodes behind "NAT" and one reachable member: the member relays their Hellos and
    contributions (issue 17); a contribution a relay altered after its maker signed it is
    refused, and so is a relayed one of a member peers dial themselves."""
    a = await nodes.start("a", n_elements=N)
    h1 = await nodes.start("h1", peers=[a.advertise], n_elements=N, reachable="no")
    h2 = await nodes.start("h2", peers=[a.advertise], n_elements=N, reachable="no")
    for node, others in ((a, {"h1", "h2"}), (h1, {"a", "h2"}), (h2, {"a", "h1"})):
        await wait_until(lambda n=node, o=others: alive_ids(n) == o, what=f"{node.cfg.node_id} to know {others}")
    # Known only through a's relay: each counts under a's host (neuronode.quorum; per id on loopback).
    assert h1.table.peers["h2"].host == h1.table.peers["a"].host and h2.table.peers["h1"].host == h2.table.peers["a"].host
    await wait_until(lambda: h1.table.peers["h2"].carried_by == ("a",), what="h2 to say a carries it")
    results = await asyncio.gather(*(exchange(n, seed) for seed, n in enumerate((a, h1, h2))))
    assert all(r.contributors == ["a", "h1", "h2"] for r in results)  # type: ignore[attr-defined]
    assert all(torch.equal(r.vector, results[0].vector) for r in results)  # type: ignore[attr-defined]
    assert a.relay.bytes_relayed > 0 and a.status()["bytes_relayed"] == a.relay.bytes_relayed
    assert h1.relay.bytes_relayed == 0  # nobody sends a node behind NAT anything to relay

    async def relayed(c: object, to: object, *, carrier: str = "a") -> object:
        async def chunks() -> object:
            async for data in maker_chunks(c, swarm_id=to.cfg.swarm_id, executor=to.ctx.executor,  # type: ignore[attr-defined]
                                           zstd_level=1):
                yield data
        return await to.inbound.receive(chunks(), carrier=carrier)  # type: ignore[attr-defined]

    honest = encode("h1", torch.ones(N), round_id=1)
    h1.transport.sign(honest)
    forged = dataclasses.replace(honest, weight=honest.weight * 3)  # the relay's change; h1's signature
    with pytest.raises(Refusal) as refused:
        await relayed(forged, h2)
    assert refused.value.code == "PERMISSION_DENIED" and "not signed by 'h1'" in str(refused.value)
    theirs = encode("a", torch.ones(N), round_id=1)  # a member peers dial, relayed (by h1): refused
    a.transport.sign(theirs)
    with pytest.raises(Refusal) as refused:
        await relayed(theirs, h2, carrier="h1")
    assert refused.value.code == "INVALID_ARGUMENT" and "relays carry" in str(refused.value)
    got = await relayed(honest, h2)  # the honest one, relayed, is taken
    assert got.sender_id == "h1" and got.weight == honest.weight  # type: ignore[attr-defined]


def test_the_host_peers_agree_on_needs_two_of_them_and_never_loopback_for_remote_peers() -> None:
    assert agreed_host({}) is None
    assert agreed_host({"a": "203.0.113.5"}) == "203.0.113.5"  # the only peer: its word is all there is
    assert agreed_host({"a": "203.0.113.5", "b": "198.51.100.7"}) is None  # they disagree
    assert agreed_host({"a": "203.0.113.5", "b": "203.0.113.5", "c": "198.51.100.7"}) == "203.0.113.5"
    assert agreed_host({"a": "127.0.0.1", "b": "203.0.113.5"}) == "203.0.113.5"  # remote peers win
    assert agreed_host({"a": "127.0.0.1", "b": "127.0.0.1"}) == "127.0.0.1"  # all on this machine


async def test_a_session_is_for_a_live_member_speaking_for_itself(nodes: Nodes) -> None:
    """Session requests answer like the other signed requests: a stranger FAILED_PRECONDITION,
    a member's request not signed by its key PERMISSION_DENIED."""
    a = await nodes.start("a", n_elements=N)
    await nodes.start("b", peers=[a.advertise], n_elements=N)
    await wait_until(lambda: alive_ids(a) == {"b"}, what="a to know b")
    cases = [(pb.SessionRequest(node_id="stranger", swarm_id=a.cfg.swarm_id), grpc.StatusCode.FAILED_PRECONDITION),
             (pb.SessionRequest(node_id="b", swarm_id=a.cfg.swarm_id), grpc.StatusCode.PERMISSION_DENIED),
             (Security(node_id="b", swarm_id=a.cfg.swarm_id, key=key_of("not-b")).sign_request(
                 "Session", pb.SessionRequest(node_id="b", swarm_id=a.cfg.swarm_id), "a"), grpc.StatusCode.PERMISSION_DENIED)]
    async with grpc.aio.insecure_channel(a.advertise) as channel:
        call = channel.unary_stream("/neuronode.v1.Node/Session", request_serializer=pb.SessionRequest.SerializeToString,
                                    response_deserializer=pb.SessionMessage.FromString)
        for request, code in cases:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in call(request, timeout=10):
                    pass
            assert refused.value.code() == code, (request.node_id, refused.value.details())
    assert not a.sessions.carried


async def test_a_push_over_a_session_that_ends_before_it_went_out_fails_so_it_goes_again(nodes: Nodes) -> None:
    """A push over a session returns once its last message went out on the session. If the
    session ends first (the member's router dropped it, or it opened another), the push raises
    SessionClosed, which the transport and the relays retry over the next session. Before, it
    returned as soon as its messages were queued, and a session that ended dropped them unseen:
    the contribution was lost though its push had succeeded."""
    a = await nodes.start("a", n_elements=N)
    session = a.sessions.carried["home"] = Carried("home")  # a session nothing writes out yet

    async def chunks() -> AsyncIterator[bytes]:
        yield b"chunk"

    push = asyncio.ensure_future(a.sessions.push("home", chunks()))
    await wait_until(lambda: len(session.data) >= 2, what="the push to queue its chunk and its end")
    await asyncio.sleep(0)  # the push had its turn after queueing its end: it waits for it to go out
    assert not push.done()
    session.end()
    with pytest.raises(SessionClosed, match="ended before this went out"):
        await push
    assert not session.data


BIG = 24_000  # fp32 in 4 KiB chunks: 24 chunks a contribution, more than a stream's queue holds


async def home_and_carrier(nodes: Nodes) -> tuple[object, object]:
    a = await nodes.start("a", n_elements=BIG)
    home = await nodes.start("home", peers=[a.advertise], n_elements=BIG, reachable="no")
    await wait_until(lambda: home.sessions.open == {"a"} and "home" in a.sessions.carried,
                     what="home's session to a")
    return a, home


def session_stream(c: object, *, swarm_id: str, key: object = None) -> AsyncIterator[bytes]:
    async def chunks() -> AsyncIterator[bytes]:
        for chunk in chunks_of(c, swarm_id=swarm_id, key=key):
            yield chunk.SerializeToString()
    return chunks()


async def test_a_refused_20_chunk_stream_over_a_session_is_drained_and_the_next_one_arrives(nodes: Nodes) -> None:
    """The receiver refuses a stream at its first chunk (signed by another key); the other 23
    chunks still come over the session and are drained, so the session carries on and the honest
    stream after it arrives whole."""
    a, home = await home_and_carrier(nodes)
    forged = encode("a", torch.ones(BIG))
    assert forged.data.count >= 20
    await asyncio.wait_for(a.sessions.push("home", session_stream(forged, swarm_id=a.cfg.swarm_id,
                                                                    key=key_of("not-a"))), timeout=20)
    honest = encode("a", torch.full((BIG,), 2.0))
    await asyncio.wait_for(a.sessions.push("home", session_stream(honest, swarm_id=a.cfg.swarm_id)), timeout=20)
    await wait_until(lambda: home.book.contributors(0) == {"a"}, what="the honest contribution at home")
    assert home.sessions.open == {"a"}  # the same session carried both


async def test_a_session_whose_stream_reader_is_stuck_ends_and_is_opened_again(
        nodes: Nodes, monkeypatch: pytest.MonkeyPatch) -> None:
    """A receiver that stops taking chunks ends its session after the stall time instead of
    holding it (and the carrier's place in carried_by) for good; a new session carries on."""
    monkeypatch.setattr("neuronode.swarm.links.sessions.STALL_S", 1.0)
    a, home = await home_and_carrier(nodes)
    honest_inbox = home.contribution

    async def stuck(chunks: AsyncIterator[bytes], *, carrier: str) -> None:
        await chunks.__anext__()
        await asyncio.Event().wait()  # takes one chunk, then never another

    monkeypatch.setattr(home, "contribution", stuck)
    pushed = asyncio.ensure_future(a.sessions.push("home", session_stream(encode("a", torch.ones(BIG)),
                                                                          swarm_id=a.cfg.swarm_id)))
    await wait_until(lambda: "a" not in home.sessions.open, what="the stuck session to end", timeout_s=15)
    await wait_until(lambda: "a" not in home.peers.node_info().carried_by, what="a out of carried_by")
    await asyncio.wait_for(asyncio.gather(pushed, return_exceptions=True), timeout=10)  # out, or SessionClosed
    monkeypatch.setattr(home, "contribution", honest_inbox)
    await wait_until(lambda: home.sessions.open == {"a"}, what="a new session to a", timeout_s=15)
    await a.sessions.push("home", session_stream(encode("a", torch.full((BIG,), 2.0)), swarm_id=a.cfg.swarm_id))
    await wait_until(lambda: home.book.contributors(0) == {"a"}, what="the next contribution at home")


async def test_a_carrier_whose_session_ended_leaves_carried_by_within_a_heartbeat(nodes: Nodes) -> None:
    a, home = await home_and_carrier(nodes)
    assert list(home.peers.node_info().carried_by) == ["a"]
    await a.server.stop(0)  # gone without a Leave: its session breaks
    started = asyncio.get_running_loop().time()
    await wait_until(lambda: not home.peers.node_info().carried_by, what="a out of carried_by")
    assert asyncio.get_running_loop().time() - started < 2 * home.cfg.heartbeat_s + 1.0


async def test_a_push_whose_session_ended_waits_for_the_next_one_and_never_dials_an_empty_address(
        nodes: Nodes) -> None:
    """a's push to home is under way over home's session when the session ends: the retries wait
    for home's next session instead of dialing home, whose address is "" behind NAT (grpc: "the
    target uri is not valid: dns:///") or one it says nobody can dial; it arrives over the next
    session."""
    a = await nodes.start("a", n_elements=BIG)
    home = await nodes.start("home", peers=[a.advertise], n_elements=BIG, reachable="no")
    for task in home.ctx.tasks.named("sessions"):
        task.cancel()  # home holds no session for now
    await wait_until(lambda: "home" in alive_ids(a), what="a to know home")
    session = a.sessions.carried["home"] = Carried("home")  # a session nothing writes out: the push waits on it
    a.transport.send(0, Phase.WHOLE, encode("a", torch.ones(BIG)))
    await asyncio.sleep(0.5)
    del a.sessions.carried["home"]
    session.end()  # the session ended before the push went out
    await asyncio.sleep(1.5)  # the push retries meanwhile
    assert not {"", home.peers.node_info().advertise, home.advertise} & set(a.ctx.channels.addresses())  # nor its own address
    home.ctx.tasks.supervise(home.sessions.hold_all, "sessions")
    await wait_until(lambda: home.book.contributors(0) == {"a"}, what="a's contribution over the next session",
                     timeout_s=30)
