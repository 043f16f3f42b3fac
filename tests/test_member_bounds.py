"""Bounds that hold against a member with valid credentials (SECURITY.md, "Resource bounds"):
stalled contribution streams, held FetchState slots, dial-backs to other machines, a flooded
peer table, and lineage work that stays near-linear. Real SwarmNodes on 127.0.0.1:0 and raw
grpc.aio calls; the pure rules under a ManualClock. Each network test here failed on the code
before issue 15 (see the note on the issue)."""

from __future__ import annotations

import asyncio
import logging
import random
import socket
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import torch
from adversary import state
from helpers import Nodes, chunks_of, encode, non_loopback_ipv4, wait_until

from neuronode.averaging.agreement import statement_of
from neuronode.clock import ManualClock
from neuronode.codec import Phase
from neuronode.events import record_fields
from neuronode.quorum import voice
from neuronode.swarm.context import buffered_bytes_bound, sender_bytes_bound
from neuronode.swarm.membership.lineage import Lineages, believable, lineages, same_lineage
from neuronode.swarm.membership.table import Peer, PeerTable, TableFull
from neuronode.swarm.node import SwarmNode
from neuronode.swarm.statesync.serving import Pace, Slots
from neuronode.swarm.wire import Refusal
from neuronode.v1 import node_pb2 as pb
from neuronode.v1 import node_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)

N = 20_000
Code = grpc.StatusCode


async def pair(nodes: Nodes, **overrides: Any) -> tuple[SwarmNode, SwarmNode]:
    """An honest node `a` and a member `liar` that said Hello to it (and heartbeats)."""
    a = await nodes.start("a", n_elements=N, **overrides)
    liar = await nodes.start("liar", peers=[a.advertise], n_elements=N, **overrides)
    await wait_until(lambda: "liar" in {p.node_id for p in a.table.alive()}, what="a to know the liar")
    return a, liar


# ---- stalled contribution streams --------------------------------------------------------------


def stalled_stream(liar: SwarmNode, round_id: int) -> AsyncIterator[bytes]:
    """The liar's contribution to `round_id`, every chunk but the last, then silence."""
    c = encode("liar", torch.randn(N), round_id=round_id, chunk_bytes=4096)
    chunks = chunks_of(c, swarm_id=liar.cfg.swarm_id, sender_id="liar")
    assert len(chunks) > 2

    async def stream() -> AsyncIterator[bytes]:
        for chunk in chunks[:-1]:
            yield chunk.SerializeToString()
        await asyncio.Event().wait()  # never sends the last chunk, never ends the stream

    return stream()


async def test_a_stalled_stream_is_aborted_when_its_round_closes_and_its_buffer_freed(nodes: Nodes) -> None:
    """A stream that sent all chunks but the last and stalled was kept, decompressed, after its
    round closed: memory grew by one contribution a round. Ten rounds of it here."""
    a, liar = await pair(nodes)
    bound = buffered_bytes_bound(a.cfg, len(a.table.alive()))
    assert bound == sender_bytes_bound(N, "fp32", window=2) * 1  # one live member: the liar
    for round_id in range(10):
        call = liar.ctx.channels.push_call(a.advertise)(stalled_stream(liar, round_id), timeout=60)
        await wait_until(lambda r=round_id: a.book.sender_bytes("liar") > 0 and ("liar" not in a.book.contributors(r)),
                         what=f"round {round_id}'s stream to be open on a")
        assert 0 < a.status()["buffered_bytes"] <= a.status()["buffered_bytes_bound"] == bound
        assert a.book.close(round_id) == {}  # a's round closes (its deadline) without the liar
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await asyncio.wait_for(call, timeout=10)
        assert refused.value.code() == Code.ABORTED and "closed before it finished" in (refused.value.details() or "")
        assert a.status()["buffered_bytes"] == 0


async def test_a_stream_that_sends_nothing_for_the_idle_limit_is_aborted(nodes: Nodes) -> None:
    """A stream for a buffered (future) round that stalls is cut by the idle limit, before its
    round ever closes."""
    a, liar = await pair(nodes)
    a.book.idle_s = 0.5
    call = liar.ctx.channels.push_call(a.advertise)(stalled_stream(liar, 1), timeout=60)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await asyncio.wait_for(call, timeout=10)
    assert refused.value.code() == Code.ABORTED and "no chunk for" in (refused.value.details() or "")
    assert a.book.buffered_bytes == 0 and a.book.closed_below() == 0


async def test_a_stream_that_never_sends_a_chunk_is_closed_after_the_idle_limit(nodes: Nodes) -> None:
    a, liar = await pair(nodes)
    a.book.idle_s = 0.5

    async def silence() -> AsyncIterator[bytes]:
        await asyncio.Event().wait()
        yield b""  # pragma: no cover - never reached

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await asyncio.wait_for(liar.ctx.channels.push_call(a.advertise)(silence(), timeout=60), timeout=10)
    assert refused.value.code() == Code.DEADLINE_EXCEEDED and "no chunk for" in (refused.value.details() or "")


async def test_a_member_cannot_buffer_more_than_its_bound(nodes: Nodes) -> None:
    """Per-member bytes are bounded: with room for one contribution, a member's second open
    stream is refused RESOURCE_EXHAUSTED."""
    a, liar = await pair(nodes)
    a.book.max_sender_bytes = sender_bytes_bound(N, "fp32", window=1)  # room for one contribution
    first = liar.ctx.channels.push_call(a.advertise)(stalled_stream(liar, 0), timeout=60)
    await wait_until(lambda: a.book.sender_bytes("liar") > 0, what="the first stream to be open")
    held = a.book.sender_bytes("liar")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await liar.ctx.channels.push_call(a.advertise)(stalled_stream(liar, 1), timeout=10)
    # The refusal ends the call while the client may still be writing: grpc then reports the failed
    # write (INTERNAL, "execute_batch") instead of the server's status. What a holds says it refused.
    if refused.value.code() == Code.INTERNAL:
        assert "execute_batch" in (refused.value.debug_error_string() or ""), refused.value
    else:
        assert refused.value.code() == Code.RESOURCE_EXHAUSTED and "bytes buffered here" in (refused.value.details() or "")
    assert a.book.sender_bytes("liar") == held  # the second stream reserved nothing
    first.cancel()


# ---- FetchState slots ------------------------------------------------------------------------


async def test_a_member_that_never_reads_its_state_download_holds_no_slot(nodes: Nodes) -> None:
    """Two FetchState streams that never read held the donor's only two slots, for good."""
    big = 2_000_000  # 16 MB of state: far more than HTTP/2 lets a donor write ahead of its reader
    donor = await nodes.start("donor", n_elements=big)
    liar = await nodes.start("liar", peers=[donor.advertise], n_elements=big)
    joiner = await nodes.start("joiner", peers=[donor.advertise], n_elements=big)
    donor.donor.provider = lambda: state(torch.randn(big), round_id=3, momentum=torch.randn(big))
    donor.donor.stall_s = 1.0
    donor.state.adopted(3, donor.donor.provider().param_digest, listen=False)
    await wait_until(lambda: {"liar", "joiner"} <= {p.node_id for p in donor.table.alive()},
                     what="the donor to know both")
    # Without BDP probing the liar's receive window stays at 64 KiB: the donor's writes block at once.
    channel = grpc.aio.insecure_channel(donor.advertise, options=[("grpc.http2.bdp_probe", 0)])
    stub = pb_grpc.NodeStub(channel)
    def request() -> pb.StateRequest:  # a new one for each call: a signed request is good once
        return liar.ctx.security.sign_request("FetchState", pb.StateRequest(node_id="liar", swarm_id=liar.cfg.swarm_id),
                                              "donor")

    held = [stub.FetchState(request(), timeout=60)]
    first = await held[0].read()  # the header: the transfer runs, and the liar reads no further
    assert first.HasField("header")
    held.append(stub.FetchState(request(), timeout=60))
    with pytest.raises(grpc.aio.AioRpcError) as second:
        await held[1].read()
    assert second.value.code() == Code.RESOURCE_EXHAUSTED and "already in flight" in (second.value.details() or "")
    # The other slot is free, and the liar's is freed once it has read nothing for stall_s.
    joiner.fetcher.vouched = lambda *args: None  # no other member publishes a digest here
    got = await joiner.fetch_state(["donor"])
    assert got is not None and got.round == 3
    await wait_until(lambda: voice("liar", "127.0.0.1") not in donor.donor.active, what="the liar's slot to be freed")
    with pytest.raises(grpc.aio.AioRpcError) as ended:
        while await held[0].read() != grpc.aio.EOF:
            pass
    assert ended.value.code() == Code.DEADLINE_EXCEEDED and "nothing was read" in (ended.value.details() or "")
    await wait_until(lambda: donor.donor.active == {}, what="every slot to be free")
    await channel.close()


async def test_two_ids_on_one_host_hold_one_state_transfer_slot(nodes: Nodes) -> None:
    """Issue 37, finding 6: state-transfer slots were per id (one each, two per donor), so two
    ids on one host held both. A slot is now its caller host's (neuronode.quorum.voice: here
    this machine's non-loopback address): the second id is refused while the first holds it,
    and a member calling from elsewhere (loopback: a voice of its own) still downloads."""
    host = non_loopback_ipv4()
    if host is None:
        pytest.skip("this machine has no non-loopback IPv4 address to call from")
    big = 2_000_000  # 16 MB of state: far more than HTTP/2 lets a donor write ahead of its reader
    donor = await nodes.start("donor", n_elements=big, listen="0.0.0.0:0", advertise="127.0.0.1:0")
    ids = [await nodes.start(name, peers=[donor.advertise], n_elements=big) for name in ("x1", "x2", "joiner")]
    donor.donor.provider = lambda: state(torch.randn(big), round_id=3, momentum=torch.randn(big))
    await wait_until(lambda: {"x1", "x2", "joiner"} <= {p.node_id for p in donor.table.alive()},
                     what="the donor to know every caller")
    channel = grpc.aio.insecure_channel(f"{host}:{donor.ctx.bound_port}", options=[("grpc.http2.bdp_probe", 0)])
    stub = pb_grpc.NodeStub(channel)
    def fetch(node: SwarmNode) -> Any:
        return stub.FetchState(node.ctx.security.sign_request("FetchState", pb.StateRequest(
            node_id=node.cfg.node_id, swarm_id=node.cfg.swarm_id), "donor"), timeout=60)

    calls = [fetch(ids[0])]
    first = await calls[0].read()  # x1's transfer runs, and it reads no further
    calls.append(fetch(ids[1]))
    assert first.HasField("header") and donor.donor.active == {voice("x1", host): 1}
    with pytest.raises(grpc.aio.AioRpcError) as second:
        await calls[1].read()
    assert second.value.code() == Code.RESOURCE_EXHAUSTED and "from your host" in (second.value.details() or "")
    joiner = ids[2]
    joiner.fetcher.vouched = lambda *args: None  # no other member publishes a digest here
    got = await joiner.fetch_state(["donor"])
    assert got is not None and got.round == 3
    for call in calls:
        call.cancel()
    await channel.close()


def test_a_reader_slower_than_the_size_scaled_rate_is_ended() -> None:
    """Issue 37, finding 6: a reader taking a chunk every ~29 s (under the 30 s stall) held a
    donor's slot until max(120 s, size at 128 KiB/s): hours for a big state. The pace ends it
    once it falls the grace behind that rate; time our own upload cap held us back never counts
    against it. (A clock moved by the reader: 0.15 s per 1000 bytes where the rate allows 0.1 s.)"""
    clock = ManualClock()

    async def read(seconds: float) -> None:
        clock.advance(seconds)

    async def transfer(per_write_s: float, capped_s: float = 0.0) -> int:
        pace = Pace(clock.now, what="state transfer", stall_s=10.0, grace_s=0.3, min_rate=10_000)
        for written in range(100):  # noqa: B007 - how many went through
            await pace.limited(read(capped_s))
            await pace.write(read(per_write_s), 1000)
        return written

    with pytest.raises(Refusal) as slow:
        asyncio.run(transfer(0.15))
    assert slow.value.code == "DEADLINE_EXCEEDED" and "read slower than" in str(slow.value)
    assert asyncio.run(transfer(0.09)) == 99  # at the rate: never ended
    assert asyncio.run(transfer(0.09, capped_s=5.0)) == 99  # our own cap's waits do not count


def test_slots_are_per_host_with_a_total() -> None:
    slots = Slots(per_host=1, total=2, what="state transfers")
    with slots.take("host:203.0.113.5"):
        with pytest.raises(Refusal, match="from your host"):
            slots.check("host:203.0.113.5")
        with slots.take("host:198.51.100.7"):
            with pytest.raises(Refusal, match="already serving 2"):
                slots.check("id:a")
    assert slots.held == {}


async def test_a_refusal_on_a_call_its_caller_left_logs_no_traceback(nodes: Nodes, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 39: the relay's log held grpc tracebacks from refusing a stalled contribution
    fetch. Its writes had waited for a reader that stopped reading; the refusal's status could
    not go out once the caller left (an ExecuteBatchError, which grpc logs with its traceback).
    A refusal on a call that ended is now the cancelled call it is (grpc notes it at debug)."""
    caplog.set_level(logging.DEBUG, logger="grpc._cython.cygrpc")
    big = 2_000_000  # 8 MB: far more than HTTP/2 lets a holder write ahead of a reader that reads nothing
    holder = await nodes.start("holder", n_elements=big)
    caller = await nodes.start("caller", peers=[holder.advertise], n_elements=big)
    await wait_until(lambda: "caller" in {p.node_id for p in holder.table.alive()}, what="the holder to know the caller")
    c = encode("holder", torch.randn(big, generator=torch.Generator().manual_seed(1)), round_id=2)
    holder.transport.sign(c)
    holder.transport.missed.retain(2, Phase.WHOLE, [c], for_s=600)
    holder.transport.missed.stall_s = 1.0
    request = caller.ctx.security.sign_request("FetchContribution", pb.ContributionRequest(
        node_id="caller", swarm_id=caller.cfg.swarm_id, round_id=2, sender_id="holder", phase=int(Phase.WHOLE),
        body=statement_of(c).body), "holder")
    channel = grpc.aio.insecure_channel(holder.advertise, options=[("grpc.http2.bdp_probe", 0)])
    call = pb_grpc.NodeStub(channel).FetchContribution(request, timeout=60)
    await call.read()  # the first chunk: the stream runs, and the caller reads no further

    def refused() -> bool:
        return any(getattr(r, "event", "") == "refused" and record_fields(r)["code"] == "DEADLINE_EXCEEDED"
                   for r in caplog.records)

    await wait_until(refused, what="the holder to refuse the stalled fetch")
    call.cancel()  # the caller leaves: the refusal has nobody to answer

    def ended() -> bool:
        return any("servicer method [/neuronode.v1.Node/FetchContribution]" in r.getMessage() for r in caplog.records)

    await wait_until(ended, what="grpc to end the refused call")
    await channel.close()
    failures = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not failures, [r.getMessage() for r in failures]
    assert holder.transport.missed.serving == {}


# ---- CheckReachable ----------------------------------------------------------------------------


async def test_check_reachable_dials_only_the_host_the_caller_calls_from(nodes: Nodes) -> None:
    """CheckReachable dialed whatever address a member advertised and returned the error's
    text: a scanning oracle for any host and port the node can reach."""
    elsewhere = socket.socket()
    elsewhere.bind(("127.0.0.2", 0))  # "another machine" on loopback, never listening
    target_address = f"127.0.0.2:{elsewhere.getsockname()[1]}"
    a = await nodes.start("a", n_elements=N)
    liar = await nodes.start("liar", peers=[a.advertise], n_elements=N, advertise=target_address)
    try:
        await wait_until(lambda: "liar" in {p.node_id for p in a.table.alive()}, what="a to know the liar")
        stub = liar.ctx.channels.stub(a.advertise)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.CheckReachable(liar.ctx.security.sign_request(
                "CheckReachable", pb.ReachRequest(node_id="liar", swarm_id=liar.cfg.swarm_id), "a"), timeout=10)
        assert refused.value.code() == Code.PERMISSION_DENIED and "calls from" in (refused.value.details() or "")
        # An honest member, dialed back at the host it calls from, hears yes or no and nothing more.
        honest = await nodes.start("honest", peers=[a.advertise], n_elements=N)
        await wait_until(lambda: "honest" in {p.node_id for p in a.table.alive()}, what="a to know it")
        answer = await honest.ctx.channels.stub(a.advertise).CheckReachable(honest.ctx.security.sign_request(
            "CheckReachable", pb.ReachRequest(node_id="honest", swarm_id=honest.cfg.swarm_id), "a"), timeout=10)
        assert answer.reachable and answer.detail == ""
    finally:
        elsewhere.close()


# ---- the peer table ----------------------------------------------------------------------------


def test_one_host_holds_at_most_max_ids_per_host_live_ids() -> None:
    clock = ManualClock()
    table = PeerTable(self_id="me", dead_after_s=5.0, clock=clock, max_ids_per_host=3)
    for n in range(3):
        table.heard_from(f"ghost-{n}", f"10.0.0.9:{n}", round=0, param_digest="", digests={}, leaving=False,
                         host="10.0.0.9")
    with pytest.raises(TableFull, match="3 live members already call from 10.0.0.9"):
        table.heard_from("ghost-3", "10.0.0.9:3", round=0, param_digest="", digests={}, leaving=False, host="10.0.0.9")
    table.heard_from("other", "10.0.0.8:1", round=0, param_digest="", digests={}, leaving=False, host="10.0.0.8")
    clock.advance(5.0)  # the ghosts die: their host may bring others
    table.heard_from("ghost-3", "10.0.0.9:3", round=0, param_digest="", digests={}, leaving=False, host="10.0.0.9")


def test_the_table_is_capped_and_forgets_peers_long_dead() -> None:
    clock = ManualClock()
    table = PeerTable(self_id="me", dead_after_s=5.0, clock=clock, max_members=10, max_ids_per_host=100)
    for n in range(10):
        table.heard_from(f"p{n}", f"10.0.0.{n}:1", round=0, param_digest="", digests={}, leaving=False, host=f"10.0.0.{n}")
    with pytest.raises(TableFull, match="knows 10 members"):
        table.heard_from("late", "10.0.1.1:1", round=0, param_digest="", digests={}, leaving=False)
    clock.advance(601.0)  # all ten long dead: the table makes room
    table.heard_from("late", "10.0.1.1:1", round=0, param_digest="", digests={}, leaving=False)
    assert set(table.peers) == {"late"}


def test_a_member_changing_its_address_leaves_one_address_behind() -> None:
    """The sender's own address bypassed the known-address cap: one member re-advertising a new
    port in every Hello filled the dial list without bound."""
    table = PeerTable(self_id="me", dead_after_s=5.0)
    table.add_address("10.0.0.1:7000", bootstrap=True)
    table.heard_from("p", "10.0.0.1:7000", round=0, param_digest="", digests={}, leaving=False)
    for port in range(7001, 8001):
        table.heard_from("p", f"10.0.0.1:{port}", round=0, param_digest="", digests={}, leaving=False)
    assert table.addresses == {"10.0.0.1:7000", "10.0.0.1:8000"}  # the bootstrap address stays


# ---- lineage and agreement work ----------------------------------------------------------------


def quadratic_lineages(self_id: str, own: dict[int, str], peers: list[Peer]) -> list[set[str]]:
    """The rule as it reads: nodes agreeing at their newest common round, closed transitively."""
    histories = {self_id: own} | {p.node_id: p.digests for p in believable(peers) if p.digests}
    ids = sorted(histories)
    parent = {i: i for i in ids}

    def find(i: str) -> str:
        while parent[i] != i:
            i = parent[i]
        return i

    for n, i in enumerate(ids):
        for j in ids[n + 1:]:
            if same_lineage(histories[i], histories[j]):
                parent[find(j)] = find(i)
    groups: dict[str, set[str]] = {}
    for i in ids:
        groups.setdefault(find(i), set()).add(i)
    return sorted(groups.values(), key=min)


def window(lineage: list[str], newest: int, length: int) -> dict[int, str]:
    """A node's published digests: the last `length` rounds up to `newest` of `lineage`."""
    return {r: lineage[r] for r in range(max(0, newest - length + 1), newest + 1)}


def test_lineages_match_the_pairwise_rule_on_published_histories() -> None:
    rng = random.Random(15)
    for _ in range(200):
        trunk = [f"t{r}" for r in range(40)]
        branches = [trunk[:rng.randrange(1, 40)] + [f"b{b}-{r}" for r in range(40)] for b in range(3)]
        branches = [b[:40] for b in branches] + [trunk]
        peers = []
        for n in range(rng.randrange(1, 12)):
            lineage = rng.choice(branches)
            newest = rng.randrange(0, 40)
            peers.append(Peer(node_id=f"p{n}", address="", round=newest, digests=window(lineage, newest, rng.randrange(1, 17)),
                              last_seen=1.0))
        own_lineage, own_newest = rng.choice(branches), rng.randrange(0, 40)
        own = window(own_lineage, own_newest, 16)
        got = lineages("me", own_newest, own, peers)
        assert sorted(map(set, got.groups), key=min) == quadratic_lineages("me", own, peers)


def test_lineage_work_over_2000_peers_is_near_linear() -> None:
    """lineages compared every pair of peers: ~2M history comparisons at 2000 peers, on the event
    loop at every heartbeat. Now each published digest is looked at a bounded number of times."""

    def work(n_peers: int, lineages_count: int) -> Lineages:
        chains = [[f"l{k}-{r}" if r > 10 else f"t{r}" for r in range(60)] for k in range(lineages_count)]
        peers = [Peer(node_id=f"p{n:04d}", address="", round=50 + n % 5,
                      digests=window(chains[n % lineages_count], 50 + n % 5, 16), last_seen=1.0)
                 for n in range(n_peers)]
        return lineages("me", 50, window(chains[0], 50, 16), peers)

    for groups in (1, 7, 2000):  # one lineage, a few, and every fake peer a lineage of its own
        big, small = work(2000, groups), work(200, min(groups, 200))
        assert len(big.groups) == groups
        entries = 2001 * 16
        assert big.work <= 3 * entries, (groups, big.work)
        assert big.work / small.work <= 12, (groups, big.work, small.work)  # 10x the peers, ~10x the work
