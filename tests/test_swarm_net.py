"""The swarm layer over real grpc.aio servers on 127.0.0.1, port 0 (neuronode.swarm.node).

Discovery through peer exchange and one round's exchange between real SwarmNodes; a raw
client that speaks the wire protocol (proto/neuronode/v1/node.proto) and pushes crafted
contribution streams, each answered with its exact status code; peers that stay silent, leave
mid-round, or train another model. Waits poll for a state with a deadline, never sleep on hope.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import grpc
import helpers
import pytest
import torch
import zstandard as zstd
from helpers import Nodes, chunks_of, encode, hides_refusal, key_of, swarm_config, wait_until

from neuronode.averaging import AllToAll, Average, AveragingConfig, Prepared, ReduceScatter
from neuronode.averaging.agreement import lineage_hash, statement_of
from neuronode.codec import (
    Contribution,
    ContributionEncoder,
    EncoderConfig,
    Phase,
    VectorEncoder,
    shard_ranges,
)
from neuronode.diloco import average
from neuronode.swarm.context import Settings
from neuronode.swarm.guard.proofs import Security
from neuronode.swarm.node import SwarmNode
from neuronode.swarm.wire import PROTOCOL_VERSION, settings_to_pb
from neuronode.v1 import node_pb2 as pb
from neuronode.v1 import node_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)

SWARM = "net-test"
MANIFEST = "a1" * 32
N_ELEMENTS = 10_000
CHUNK_BYTES = 4096  # 1024 fp32 elements per chunk: 10 chunks, the last one short
N_CHUNKS = 10
HEARTBEAT_S = 0.2
RPC_TIMEOUT_S = 10.0
ROGUE = "rogue"

Chunks = list[pb.ContributionChunk]
Code = grpc.StatusCode


# ---- helpers ---------------------------------------------------------------------------------


def make_vector(seed: int) -> torch.Tensor:
    """Random float32 bits (exponent bit 30 cleared: finite, |x| < 2) that zstd cannot shrink,
    then zeros that it can: the stream mixes raw and compressed frames."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31, (N_ELEMENTS,), generator=g, dtype=torch.int64)
    x = (bits.to(torch.int32) & ~(1 << 30)).view(torch.float32).clone()
    x[N_ELEMENTS // 2 :] = 0.0
    return x


def averager(node: SwarmNode, kind: type[AllToAll] | type[ReduceScatter] = AllToAll) -> AllToAll | ReduceScatter:
    """The averaging protocol a node runs, over this SwarmNode's transport."""
    cfg = node.cfg
    encoder = ContributionEncoder(EncoderConfig(codec="fp32", chunk_bytes=CHUNK_BYTES, zstd_level=1, byte_shuffle=False),
                                  n_elements=cfg.n_elements, sender_id=cfg.node_id)
    return kind(AveragingConfig(node_id=cfg.node_id, codec="fp32", n_elements=cfg.n_elements,
                                sync_timeout_s=cfg.sync_timeout_s, min_contributors=cfg.min_contributors),
                transport=node.transport, encoder=encoder, encoder_pool=node.ctx.executor, aggregate=average,
                executor=node.ctx.executor)


async def exchange(node: SwarmNode, own: Contribution) -> Average:
    """One all-to-all round of `node` with `own` as its contribution."""
    prepared = Prepared(round_id=own.round_id, parts=[own], compensated=own.data.decode())
    return await averager(node).exchange(prepared)


def averaged_shard(members: tuple[str, ...], index: int, round_id: int) -> Contribution:
    """Reducer members[index]'s averaged shard of `round_id`, signed by it (its test key)."""
    start, stop = shard_ranges(N_ELEMENTS, len(members), "fp32")[index]
    c = VectorEncoder(codec="fp32", chunk_bytes=CHUNK_BYTES, zstd_level=1, byte_shuffle=False).encode(
        make_vector(index)[start:stop], 0.0, round_id=round_id, sender_id=members[index], phase=Phase.AVERAGED,
        shard_index=index, members=members, contributors=members, n_elements=N_ELEMENTS)
    key = key_of(members[index])
    c.signature, c.public_key = Security(node_id=members[index], swarm_id=SWARM, key=key).sign_statement(
        statement_of(c)), key.public
    return c


async def agree_shards(node: SwarmNode, round_id: int, members: tuple[str, ...], held: dict[int, Contribution], *,
                       publish: bool = True) -> dict[int, Contribution]:
    """The averaged shards of `round_id` the reduce-scatter rule keeps on `node`, by index, when
    it holds `held` (fetching what it lacks)."""
    rs = averager(node, ReduceScatter)
    got = await rs.agree(round_id, Phase.AVERAGED, {c.sender_id: c for c in held.values()}, lambda: members,
                         lineage=lineage_hash("", members), publish=publish)
    return {c.shard_index: c for c in got.values()}


def to_chunks(out: Contribution, *, sender_id: str = ROGUE) -> Chunks:
    """The ContributionChunk stream that carries `out`, as the wire protocol defines it."""
    return chunks_of(out, swarm_id=SWARM, sender_id=sender_id)


def honest_chunks(*, round_id: int = 0, seed: int = 7, weight: float = 3.0) -> Chunks:
    return to_chunks(encode(ROGUE, make_vector(seed), round_id=round_id, weight=weight))


async def holds_for(predicate: Callable[[], bool], *, what: str, duration_s: float) -> None:
    """Poll `predicate` for `duration_s`; fail naming `what` the moment it does not hold."""
    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline:
        assert predicate(), f"expected {what}"
        await asyncio.sleep(0.02)


def alive_ids(node: SwarmNode) -> set[str]:
    return {p.node_id for p in node.table.alive()}


class Client:
    """A raw peer: a channel and a stub, no SwarmNode behind it."""

    def __init__(self, node: SwarmNode, channel: grpc.aio.Channel, advertise: str) -> None:
        self.node = node
        self.stub = pb_grpc.NodeStub(channel)
        self.advertise = advertise

    def info(self, **overrides: Any) -> pb.NodeInfo:
        fields: dict[str, Any] = dict(
            node_id=ROGUE, swarm_id=SWARM, protocol_version=PROTOCOL_VERSION,
            manifest_hash=MANIFEST, advertise=self.advertise, settings=settings_to_pb(Settings()),
        )
        fields.update(overrides)
        return pb.NodeInfo(**fields)

    async def hello(self, **overrides: Any) -> pb.HelloResponse:
        request = pb.HelloRequest(info=self.info(**overrides))
        node_id = request.info.node_id
        Security(node_id=node_id, swarm_id=SWARM, key=key_of(node_id)).sign_hello(request)
        return await self.stub.Hello(request, timeout=RPC_TIMEOUT_S)

    async def push(self, chunks: Iterable[pb.ContributionChunk]) -> tuple[Code, str, int]:
        """Stream `chunks`; returns (status code, details, chunks the node acknowledged)."""

        chunks = list(chunks)

        async def stream() -> AsyncIterator[pb.ContributionChunk]:
            for chunk in chunks:
                yield chunk

        for _ in range(5):
            try:
                ack = await self.stub.PushContribution(stream(), timeout=RPC_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                if hides_refusal(exc.code(), exc.details() or ""):
                    continue  # see helpers.GRPC_EARLY_STATUS_BUG
                return exc.code(), exc.details() or "", 0
            return Code.OK, "", ack.chunks_received
        raise AssertionError("every push met grpc/grpc#36066")

    async def assert_serving(self) -> None:
        status = await self.stub.Status(pb.StatusRequest(), timeout=RPC_TIMEOUT_S)
        assert status.node_id == self.node.cfg.node_id


# ---- fixtures --------------------------------------------------------------------------------


@pytest.fixture
async def client(nodes: Nodes, refused_address: str) -> AsyncIterator[Client]:
    node = await nodes.start("target")
    channel = grpc.aio.insecure_channel(node.advertise)
    try:
        yield Client(node, channel, refused_address)
    finally:
        await channel.close()


@pytest.fixture
async def greeted(client: Client) -> Client:
    """A raw client the node accepted as a peer."""
    resp = await client.hello()
    assert resp.info.node_id == "target"
    assert ROGUE in client.node.table.peers
    return client


# ---- discovery and one round -----------------------------------------------------------------


async def test_three_nodes_discover_each_other_and_average_bit_identically(nodes: Nodes) -> None:
    a = await nodes.start("a")
    b = await nodes.start("b", peers=[a.advertise])
    c = await nodes.start("c", peers=[b.advertise])
    trio = {"a": a, "b": b, "c": c}
    for name, node in trio.items():
        others = set(trio) - {name}
        await wait_until(lambda n=node, o=others: alive_ids(n) == o,
                         what=f"{name} to learn {sorted(others)} by peer exchange")

    vectors = {name: make_vector(seed) for seed, name in enumerate(trio)}
    weights = {"a": 1.0, "b": 2.0, "c": 5.0}
    encoded = {name: encode(name, vectors[name], weight=weights[name]) for name in trio}
    results = await asyncio.gather(*(exchange(trio[n], encoded[n]) for n in trio))

    expected = average({n: (vectors[n], weights[n]) for n in trio})
    for name, got in zip(trio, results, strict=True):
        assert got.contributors == sorted(trio), f"{name} closed round 0 without everyone"
        # The weights travelled (a different weight gives another weighted average), so did
        # every value, in sorted sender order.
        assert torch.equal(got.vector, expected), f"{name}'s average differs"
        assert trio[name].book.closed_below() == 1


async def test_a_node_done_with_its_last_round_stays_until_its_peers_finished_it(nodes: Nodes) -> None:
    """A member that finished the last round waits (serving fetches) until every live peer
    finished it too, at most its drain time. Before, it left at once: a member slower to close
    that round could no longer fetch a contribution it missed from it (the adversary test's
    `ghosts` run ended with one member apart)."""
    a = await nodes.start("a")
    b = await nodes.start("b", peers=[a.advertise])
    await wait_until(lambda: alive_ids(a) == {"b"} and alive_ids(b) == {"a"}, what="a and b to know each other")
    a.state.adopted(6, "d6", listen=False)  # a finished round 5 of 6; b is still in it
    b.state.adopted(5, "d5", listen=False)
    await wait_until(lambda: a.table.peers["b"].round == 5, what="a to hear b at round 5")
    draining = asyncio.ensure_future(a.drain(timeout_s=30))
    await holds_for(lambda: not draining.done(), what="a to stay while b is in the last round", duration_s=0.5)
    b.state.adopted(6, "d6", listen=False)  # b finished it and says so
    await asyncio.wait_for(draining, timeout=10)


async def start_trio(nodes: Nodes, **overrides: Any) -> tuple[SwarmNode, SwarmNode, SwarmNode]:
    a = await nodes.start("a", **overrides)
    b = await nodes.start("b", peers=[a.advertise], **overrides)
    c = await nodes.start("c", peers=[a.advertise], **overrides)
    for node, others in ((a, {"b", "c"}), (b, {"a", "c"}), (c, {"a", "b"})):
        await wait_until(lambda n=node, o=others: alive_ids(n) == o, what=f"{node.cfg.node_id} to know {others}")
    return a, b, c


async def test_members_apply_the_shards_two_others_received_and_fetch_what_they_missed(nodes: Nodes) -> None:
    """Four members exchange signed receipts over Hello. Reducer d's shard (3) reached a and c
    but not b: two listings besides its maker's, so it counts everywhere and b fetches it from
    a holder. Reducer c's shard (2) reached a only: one listing, so nobody applies it, c
    included. A listener reads the same receipts."""
    rs = Settings(averaging="reduce-scatter")  # a swarm takes the phases its --averaging uses only
    a = await nodes.start("a", settings=rs)
    peers = {n: await nodes.start(n, peers=[a.advertise], settings=rs) for n in "bcd"}
    members = ("a", "b", "c", "d")
    for node in (a, *peers.values()):
        await wait_until(lambda n=node: alive_ids(n) == set(members) - {n.cfg.node_id}, what="the swarm to form")
    shards = {i: averaged_shard(members, i, 2) for i in range(4)}
    have = {"a": {0, 1, 2, 3}, "b": {0, 1}, "c": {0, 1, 2, 3}, "d": {0, 1, 3}}
    nodes_by_id = {"a": a, **peers}
    kept = await asyncio.gather(*(agree_shards(nodes_by_id[n], 2, members, {i: shards[i] for i in have[n]})
                                  for n in members))
    assert [set(k) for k in kept] == [{0, 1, 3}] * 4
    fetched = kept[1][3]
    assert fetched is not shards[3] and fetched.data.decode().equal(shards[3].data.decode())
    listener = await nodes.start("e", peers=[a.advertise], settings=rs)
    await wait_until(lambda: alive_ids(listener) >= set(members), what="e to know the members")
    await wait_until(lambda: listener.receipts.makers(2, Phase.AVERAGED) >= set(members),
                     what="e to hear the members' receipts")
    assert set(await agree_shards(listener, 2, members, shards, publish=False)) == {0, 1, 3}
    assert not listener.receipts.own  # a listener publishes nothing


# The deadline rules of shard agreement (a member that left, a silent one, a late receipt, one
# past the round) run under a ManualClock in tests/test_averaging.py.


async def test_a_node_late_for_a_round_listens_and_averages_what_the_others_did(nodes: Nodes) -> None:
    """The join race: e adopted round 0 just as a and b closed it without e. e sees them at
    round 1 from its own round-0 parameters, stands aside, listens, and averages exactly their
    two contributions, as they did (docs/fault-tolerance.md)."""
    a = await nodes.start("a")
    b = await nodes.start("b", peers=[a.advertise])
    for node in (a, b):
        node.state.adopted(0, "d0", listen=False)
    await wait_until(lambda: alive_ids(a) == {"b"} and alive_ids(b) == {"a"}, what="a and b to meet")
    got = await asyncio.gather(exchange(a, encode("a", make_vector(1), base_digest="d0")),
                               exchange(b, encode("b", make_vector(2), base_digest="d0")))
    assert got[0].contributors == ["a", "b"]
    expected = got[0].vector
    for node in (a, b):
        node.state.completed(0, "d1")

    e = await nodes.start("e", peers=[a.advertise])
    e.state.adopted(0, "d0", listen=False)
    await wait_until(lambda: {p.node_id: p.round for p in e.table.alive()} == {"a": 1, "b": 1},
                     what="e to see a and b at round 1")
    assert e.closed_without_us(1) == []  # they have not closed round 1
    assert e.closed_without_us(0) == ["a", "b"]
    e.state.stand_aside(0)
    heard = await asyncio.wait_for(averager(e).listen(0, base_digest="d0"), timeout=20)
    assert heard.contributors == ["a", "b"]
    assert torch.equal(heard.vector, expected)
    await wait_until(lambda: any(p.node_id == "e" and p.contributes_from == 1 for p in a.table.alive()),
                     what="a to learn that e contributes from round 1 on")

    # Peers of another lineage at round 0 never count as having closed our round.
    other = await nodes.start("o", peers=[a.advertise])
    other.state.adopted(0, "elsewhere", listen=False)
    await wait_until(lambda: {"a", "b"} <= alive_ids(other), what="o to meet a and b")
    assert other.closed_without_us(0) == []


# ---- crafted contribution streams from a raw client ------------------------------------------


def every(**fields: Any) -> Callable[[Chunks], Chunks]:
    """Set header `fields` on every chunk (the stream is consistent, just wrong), signed by the
    sender as it is: a member signs whatever it says."""

    def tamper(chunks: Chunks) -> Chunks:
        for chunk in chunks:
            for name, value in fields.items():
                setattr(chunk, name, value)
        signature = fields.get("signature", sign_header(chunks[0]))
        for chunk in chunks:
            chunk.signature = signature
        return chunks

    return tamper


def sign_header(chunk: pb.ContributionChunk, *, key: Any = None) -> bytes:
    """The sender's signature over a chunk's header (its old one where the header makes no
    statement: an unknown phase is refused before any signature is read)."""
    return helpers.sign_header(chunk, key=key, default=chunk.signature)


def signed_by(key: Any) -> Callable[[Chunks], Chunks]:
    """The honest stream, signed by another key than the sender's."""

    def tamper(chunks: Chunks) -> Chunks:
        signature = sign_header(chunks[0], key=key)
        for chunk in chunks:
            chunk.signature = signature
        return chunks

    return tamper


def recast(phase: int, contributors: tuple[str, ...] = ()) -> Callable[[Chunks], Chunks]:
    """The stream as one of `phase` (whole: UNSPECIFIED; a slice for the target: SHARD) that
    names `contributors` (only an averaged shard does); signed as it is (a member signs
    whatever it says)."""

    def tamper(chunks: Chunks) -> Chunks:
        for chunk in chunks:
            chunk.phase = phase
            if phase == pb.PHASE_SHARD:
                chunk.members[:] = ["target"]
                chunk.shard_count = 1
            chunk.contributors[:] = contributors
        return every()(chunks)

    return tamper


def from_chunk(k: int, **fields: Any) -> Callable[[Chunks], Chunks]:
    """Change header `fields` from chunk `k` on: the header changes mid-stream."""

    def tamper(chunks: Chunks) -> Chunks:
        every(**fields)(chunks[k:])
        return chunks

    return tamper


def duplicated(chunks: Chunks) -> Chunks:
    return [*chunks[:2], chunks[1], *chunks[2:]]


def out_of_order(chunks: Chunks) -> Chunks:
    return [chunks[0], chunks[2], chunks[1], *chunks[3:]]


def truncated(chunks: Chunks) -> Chunks:
    return chunks[:4]


def index_out_of_range(chunks: Chunks) -> Chunks:
    chunks[-1].chunk_index = N_CHUNKS
    return chunks


def short_raw_payload(chunks: Chunks) -> Chunks:
    assert not chunks[0].compressed
    chunks[0].payload = chunks[0].payload[:-4]
    return chunks


def bomb(*, content_size: bool) -> Callable[[Chunks], Chunks]:
    """Chunk 0 becomes 50 MB of zeros, zstd-compressed to about 1.6 kB and flagged compressed."""

    def tamper(chunks: Chunks) -> Chunks:
        packed = zstd.ZstdCompressor(level=1, write_content_size=content_size).compress(
            bytes(50 << 20))
        assert len(packed) < CHUNK_BYTES
        chunks[0].payload, chunks[0].compressed = packed, True
        return chunks

    return tamper


REFUSED_STREAMS = [
    pytest.param(duplicated, Code.INVALID_ARGUMENT, id="duplicated-chunk"),
    pytest.param(out_of_order, Code.INVALID_ARGUMENT, id="out-of-order"),
    pytest.param(index_out_of_range, Code.INVALID_ARGUMENT, id="index-out-of-range"),
    pytest.param(truncated, Code.DATA_LOSS, id="truncated"),
    pytest.param(lambda chunks: [], Code.INVALID_ARGUMENT, id="empty"),
    pytest.param(every(contribution_digest="0" * 64), Code.DATA_LOSS, id="wrong-digest"),
    pytest.param(every(total_elements=N_ELEMENTS - 1), Code.INVALID_ARGUMENT, id="total-elements"),
    pytest.param(every(codec=pb.CODEC_UNSPECIFIED), Code.INVALID_ARGUMENT, id="codec-unspecified"),
    pytest.param(every(codec=99), Code.INVALID_ARGUMENT, id="codec-unknown"),
    pytest.param(every(codec=pb.CODEC_BF16), Code.INVALID_ARGUMENT, id="codec-not-the-swarms"),
    pytest.param(every(chunk_count=N_CHUNKS + 1), Code.INVALID_ARGUMENT, id="chunk-count"),
    pytest.param(every(chunk_elements=2048), Code.INVALID_ARGUMENT, id="chunk-elements"),
    pytest.param(every(chunk_elements=1000), Code.INVALID_ARGUMENT, id="chunk-elements-lengths"),
    pytest.param(every(weight=0.0), Code.INVALID_ARGUMENT, id="zero-weight"),
    pytest.param(every(weight=float("nan")), Code.INVALID_ARGUMENT, id="nan-weight"),
    pytest.param(short_raw_payload, Code.INVALID_ARGUMENT, id="short-payload"),
    pytest.param(bomb(content_size=True), Code.INVALID_ARGUMENT, id="bomb"),
    pytest.param(bomb(content_size=False), Code.INVALID_ARGUMENT, id="bomb-no-size"),
    pytest.param(every(swarm_id="other"), Code.PERMISSION_DENIED, id="other-swarm"),
    pytest.param(signed_by(key_of("someone-else")), Code.PERMISSION_DENIED, id="signed-by-another-key"),
    pytest.param(every(signature=b""), Code.PERMISSION_DENIED, id="unsigned"),
    pytest.param(recast(pb.PHASE_UNSPECIFIED, ("a", "b")), Code.INVALID_ARGUMENT, id="whole-names-contributors"),
    # The target averages all-to-all: a well-formed slice would stay buffered (nothing closes that phase here).
    pytest.param(recast(pb.PHASE_SHARD), Code.INVALID_ARGUMENT, id="slice-to-an-all-to-all-swarm"),
] + [
    pytest.param(from_chunk(3, **{name: value}), Code.INVALID_ARGUMENT, id=f"changes-{name}")
    for name, value in [
        ("round_id", 1), ("sender_id", "target"), ("chunk_count", N_CHUNKS + 1),
        ("codec", pb.CODEC_FP16), ("contribution_digest", "0" * 64), ("weight", 4.0),
        ("total_elements", N_ELEMENTS + 1), ("chunk_elements", 2048), ("swarm_id", "other"),
    ]
]


@pytest.mark.parametrize(("tamper", "code"), REFUSED_STREAMS)
async def test_malformed_stream_is_refused_and_not_stored(
    greeted: Client, tamper: Callable[[Chunks], Chunks], code: Code,
) -> None:
    status, details, _ = await greeted.push(tamper(honest_chunks()))
    assert status == code, details
    assert ROGUE not in greeted.node.book.contributors(0)
    await greeted.assert_serving()
    # The refusal freed the sender's slot: the honest stream right after is taken.
    status, details, _ = await greeted.push(honest_chunks())
    assert status == Code.OK, details
    assert ROGUE in greeted.node.book.contributors(0)


async def test_a_reduce_scatter_swarm_takes_slices_only_and_none_naming_contributors(
        nodes: Nodes, refused_address: str) -> None:
    """The other side of slice-to-an-all-to-all-swarm: a reduce-scatter node refuses a whole
    contribution, and a slice naming contributors (before, both were filed); a well-formed
    slice of its shard is taken."""
    rs = Settings(averaging="reduce-scatter")
    node = await nodes.start("target", settings=rs)
    async with grpc.aio.insecure_channel(node.advertise) as channel:
        client = Client(node, channel, refused_address)
        await client.hello(settings=settings_to_pb(rs))
        for tamper in (recast(pb.PHASE_UNSPECIFIED), recast(pb.PHASE_SHARD, ("a", "b"))):
            status, details, _ = await client.push(tamper(honest_chunks()))
            assert status == Code.INVALID_ARGUMENT, details
        status, details, _ = await client.push(recast(pb.PHASE_SHARD)(honest_chunks()))
        assert status == Code.OK, details
        assert node.book.contributors(0, Phase.SHARD) == {ROGUE}


async def test_honest_contribution_is_stored_once(greeted: Client) -> None:
    chunks = honest_chunks(weight=3.0)
    assert {c.compressed for c in chunks} == {True, False}  # both frame kinds travel
    status, details, acked = await greeted.push(chunks)
    assert (status, acked) == (Code.OK, N_CHUNKS), details
    assert greeted.node.book.contributors(0) == {ROGUE}

    status, details, _ = await greeted.push(honest_chunks(seed=8))
    assert status == Code.ALREADY_EXISTS, details
    stored = greeted.node.book.close(0)[ROGUE]
    assert (stored.round_id, stored.codec, stored.weight) == (0, "fp32", 3.0)
    assert torch.equal(stored.data.decode(), make_vector(7))  # the first one, untouched


async def test_a_contribution_made_from_other_parameters_replaces_the_one_sent_before(greeted: Client) -> None:
    """A sender that repaired runs the round again from the swarm's parameters: its second
    contribution (another base_digest) replaces the first while the round is open, through the
    real inbound path; a third of that lineage is a duplicate again. Before, the slot held the
    first one and the repaired member's round went on without its contribution."""
    status, details, _ = await greeted.push(to_chunks(encode(ROGUE, make_vector(7), weight=3.0, base_digest="before")))
    assert status == Code.OK, details
    again = to_chunks(encode(ROGUE, make_vector(8), weight=3.0, base_digest="after"))
    status, details, _ = await greeted.push(again)
    assert status == Code.OK, details
    status, details, _ = await greeted.push(again)
    assert status == Code.ALREADY_EXISTS, details
    stored = greeted.node.book.close(0)[ROGUE]
    assert stored.base_digest == "after" and torch.equal(stored.data.decode(), make_vector(8))


async def test_a_weight_above_the_swarms_bound_is_refused(nodes: Nodes, refused_address: str) -> None:
    """The swarm's --max-weight bounds what one contribution may claim: a claim above it is
    refused (INVALID_ARGUMENT, naming the flag) and never stored; one at the bound is taken.
    Before, any weight below 1e15 was taken, and under the mean it decided the average."""
    settings = Settings(max_weight=100.0)
    node = await nodes.start("target", settings=settings)
    async with grpc.aio.insecure_channel(node.advertise) as channel:
        client = Client(node, channel, refused_address)
        await client.hello(settings=settings_to_pb(settings))
        status, details, _ = await client.push(honest_chunks(weight=101.0))
        assert status == Code.INVALID_ARGUMENT and "--max-weight 100" in details, details
        assert ROGUE not in node.book.contributors(0)
        status, details, _ = await client.push(honest_chunks(weight=100.0))
        assert status == Code.OK, details
        assert node.book.close(0)[ROGUE].weight == 100.0


async def test_second_stream_while_the_first_is_open_is_refused(greeted: Client) -> None:
    chunks = honest_chunks()
    release = asyncio.Event()

    async def held() -> AsyncIterator[pb.ContributionChunk]:
        yield chunks[0]
        await release.wait()
        for chunk in chunks[1:]:
            yield chunk

    first = greeted.stub.PushContribution(held(), timeout=RPC_TIMEOUT_S)  # starts streaming
    try:
        await wait_until(lambda: greeted.node.counters.bytes_received > 0,
                         what="the first chunk of the held stream")
        status, details, _ = await greeted.push(honest_chunks(seed=8))
        assert status == Code.ALREADY_EXISTS, details
        release.set()
        assert (await first).chunks_received == N_CHUNKS
    finally:
        first.cancel()  # no-op once it finished; ends the stream if an assert failed
    assert torch.equal(greeted.node.book.close(0)[ROGUE].data.decode(), make_vector(7))


async def test_next_round_is_buffered_and_further_ahead_refused(greeted: Client) -> None:
    status, details, _ = await greeted.push(honest_chunks(round_id=1))
    assert status == Code.OK, details
    assert ROGUE in greeted.node.book.contributors(1)

    status, details, _ = await greeted.push(honest_chunks(round_id=2))
    assert status == Code.FAILED_PRECONDITION, details
    assert "too far ahead" in details
    assert ROGUE not in greeted.node.book.contributors(2)


async def test_contribution_for_a_closed_round_is_refused(greeted: Client) -> None:
    greeted.node.book.close(0)
    status, details, _ = await greeted.push(honest_chunks(round_id=0))
    assert status == Code.FAILED_PRECONDITION, details
    assert "closed" in details
    assert ROGUE not in greeted.node.book.contributors(0)
    await greeted.assert_serving()


async def test_a_push_that_arrives_before_its_senders_hello_is_retried_not_lost(client: Client) -> None:
    """The join race (issue 18): a sender that learned us by peer exchange pushed before its
    Hello reached us, and got FAILED_PRECONDITION, which senders never retry: the contribution
    was lost for good and the round waited for it forever. Now it is UNAVAILABLE ("say Hello
    first"), the sender retries, and once its Hello arrives the same stream is taken."""
    status, details, _ = await client.push(honest_chunks())
    assert status == Code.UNAVAILABLE and "Hello" in details, (status, details)
    assert ROGUE not in client.node.book.contributors(0)
    await client.hello()  # the sender's Hello arrives
    status, details, _ = await client.push(honest_chunks())
    assert status == Code.OK, details
    assert ROGUE in client.node.book.contributors(0)
    await client.assert_serving()


async def test_a_push_refused_as_too_far_ahead_goes_again_once_the_peer_moved_to_its_round(
        nodes: Nodes, caplog: pytest.LogCaptureFixture) -> None:
    """A joiner still at round 0 refuses a's round 2 as too far ahead (FAILED_PRECONDITION); once
    it adopted the swarm's state at round 2 and listens there, a pushes again. (Before, the
    refusal ended the push for good: under --overlap the joiner listened to round 2 until its
    deadline, and a's round 3 waited that deadline out for it.)"""
    caplog.set_level(logging.INFO, logger="neuronode.swarm")
    a = await nodes.start("a", round_lag=2)
    b = await nodes.start("b", peers=[a.advertise], round_lag=2)
    await wait_until(lambda: alive_ids(a) == {"b"} and alive_ids(b) == {"a"}, what="a and b to meet")
    a.state.adopted(2, "d2", listen=False)
    a.book.reset(2)
    a.transport.send(2, Phase.WHOLE, encode("a", make_vector(1), round_id=2))
    await wait_until(lambda: any("refused our contribution" in r.getMessage() and "too far ahead" in r.getMessage()
                                 for r in caplog.records) and not a.ctx.tasks.named("push-"),
                     what="b to refuse round 2 while at round 0")
    assert "a" not in b.book.contributors(2)
    b.book.reset(2)
    b.state.adopted(2, "d2", listen=True)  # b's next Hello tells a it is at round 2
    await wait_until(lambda: "a" in b.book.contributors(2), what="a's round-2 contribution to reach b")


async def test_a_member_that_refused_our_contribution_as_closed_is_not_waited_for_in_that_round(
        nodes: Nodes) -> None:
    """b closed round 0 without a (the join race under --overlap: a joined while b fixed round 0)
    and refuses a's contribution to it (FAILED_PRECONDITION, "closed here"). a's round 0 then
    waits for b no more: it closes at once, not at its --sync-timeout (before, a waited one
    deadline per phase while b waited for a in round 1: 120 s under reduce-scatter, seen in CI)."""
    a = await nodes.start("a", sync_timeout_s=60.0)
    b = await nodes.start("b", peers=[a.advertise], sync_timeout_s=60.0)
    await wait_until(lambda: alive_ids(a) == {"b"} and alive_ids(b) == {"a"}, what="a and b to meet")
    b.book.close(0)
    own = encode("a", make_vector(1), round_id=0)
    a.book.add_own(own)
    a.transport.send(0, Phase.WHOLE, own)
    collected = asyncio.ensure_future(a.book.collect(0, expected=lambda: {"a", "b"}, timeout_s=60.0))
    try:
        got = await asyncio.wait_for(asyncio.shield(collected), timeout=20)
    finally:
        collected.cancel()
    assert set(got) == {"a"}
    assert a.book.lateness.gone(Phase.WHOLE, 0) == {"b"} and "b" not in a.book.lateness.excused(Phase.WHOLE)


@pytest.mark.parametrize(("method", "shape"), [
    ("Hello", "unary_unary"), ("Status", "unary_unary"), ("FetchState", "unary_stream"),
    ("PushContribution", "stream_unary"),
])
async def test_undecodable_request_is_invalid_argument(client: Client, method: str, shape: str) -> None:
    """Bytes that are not the method's protobuf message: INVALID_ARGUMENT naming the method,
    not grpc's UNKNOWN; the node keeps serving."""
    garbage = b"\xff\xff\xff\xff\x0f"  # a truncated varint under field 31: never valid
    channel = grpc.aio.insecure_channel(client.node.advertise)
    try:
        call = getattr(channel, shape)(f"/neuronode.v1.Node/{method}")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            if shape == "unary_stream":
                async for _ in call(garbage, timeout=RPC_TIMEOUT_S):
                    pass
            elif shape == "stream_unary":
                async def stream() -> AsyncIterator[bytes]:
                    yield garbage
                await call(stream(), timeout=RPC_TIMEOUT_S)
            else:
                await call(garbage, timeout=RPC_TIMEOUT_S)
    finally:
        await channel.close()
    assert refused.value.code() == Code.INVALID_ARGUMENT, refused.value.details()
    assert "not a valid" in (refused.value.details() or "") and method in (refused.value.details() or "")
    await client.assert_serving()


@pytest.mark.parametrize(("override", "code", "keyword"), [
    pytest.param({"swarm_id": "other-swarm"}, Code.FAILED_PRECONDITION, "swarm id", id="swarm"),
    pytest.param({"manifest_hash": "b2" * 32}, Code.FAILED_PRECONDITION, "manifest", id="manifest"),
    pytest.param({"protocol_version": PROTOCOL_VERSION + 1}, Code.FAILED_PRECONDITION,
                 "protocol version", id="protocol"),
    pytest.param({"node_id": "target"}, Code.ALREADY_EXISTS, "already used", id="node-id-taken"),
    pytest.param({"node_id": ""}, Code.INVALID_ARGUMENT, "node id", id="no-node-id"),
    pytest.param({"receipts": [pb.Receipt(round=r, phase=pb.PHASE_AVERAGED) for r in range(7)]},
                 Code.INVALID_ARGUMENT, "receipts", id="too-many-receipts"),
    pytest.param({"receipts": [pb.Receipt(round=1, phase=pb.PHASE_AVERAGED, statements=[pb.Statement(
        phase=pb.PHASE_AVERAGED, shard_index=256, lineage=bytes(32), body=bytes(32))])]},
                 Code.INVALID_ARGUMENT, "receipts", id="shard-index-too-big"),
    pytest.param({"echoes": [pb.ReceiptEcho(round=1, maker_id="a", receipt_hash=b"x")]},
                 Code.INVALID_ARGUMENT, "echoes", id="echo-hash-malformed"),
    pytest.param({"echoes": [pb.ReceiptEcho(round=1, phase=7, maker_id="a", receipt_hash=bytes(32))]},  # type: ignore[arg-type]
                 Code.INVALID_ARGUMENT, "echoes", id="echo-phase-unknown"),
    pytest.param({"round": 2**64 - 1}, Code.INVALID_ARGUMENT, "below 2^53", id="round-beyond-2^53"),
    pytest.param({"recent_digests": [pb.RoundDigest(round=2**60, param_digest="p")]}, Code.INVALID_ARGUMENT,
                 "below 2^53", id="digest-round-beyond-2^53"),
    pytest.param({"recent_digests": [pb.RoundDigest(round=1, param_digest="p" * 129)]}, Code.INVALID_ARGUMENT,
                 "128 characters", id="digest-too-long"),
] + [  # the settings every member must share: refused naming the flag and both values
    pytest.param({"settings": settings_to_pb(replace(Settings(), **change))}, Code.FAILED_PRECONDITION, flag,
                 id=f"settings-{flag}")
    for change, flag in [({"codec": "int8"}, "--codec int8"), ({"averaging": "reduce-scatter"}, "--averaging"),
                         ({"aggregator": "median"}, "--aggregator"), ({"outer_lr": 0.5}, "--outer-lr"),
                         ({"outer_momentum": 0.8}, "--outer-momentum"), ({"overlap": True}, "--overlap"),
                         ({"max_local_workers": 8}, "--max-local-workers 8"),
                         ({"max_weight": 800.0}, "--max-weight 800")]
])
async def test_mismatched_hello_is_refused(
    client: Client, override: dict[str, Any], code: Code, keyword: str,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await client.hello(**override)
    assert refused.value.code() == code
    assert keyword in (refused.value.details() or "")
    assert set(client.node.table.peers) == set()
    assert client.advertise not in client.node.table.addresses  # nor will it be dialed
    # A refused peer stays a stranger: its contributions are not taken (until a Hello of its is).
    status, details, _ = await client.push(honest_chunks())
    assert status == Code.UNAVAILABLE and "say Hello first" in details, details
    assert ROGUE not in client.node.book.contributors(0)
    await client.assert_serving()


# ---- peers that stay silent, leave, or train another model -----------------------------------


async def test_silent_peer_costs_one_deadline(nodes: Nodes) -> None:
    a = await nodes.start("a", sync_timeout_s=2.0)
    b = await nodes.start("b", peers=[a.advertise])  # alive, answers heartbeats, never exchanges
    await wait_until(lambda: alive_ids(a) == {"b"} and alive_ids(b) == {"a"}, what="a and b to meet")

    t0 = time.monotonic()
    got = await exchange(a, encode("a", make_vector(1)))
    elapsed_s = time.monotonic() - t0
    assert got.contributors == ["a"]
    assert 1.9 <= elapsed_s < 10.0, f"exchange took {elapsed_s:.2f} s with a 2 s deadline"
    assert alive_ids(a) == {"b"}  # b was silent, not gone
    assert "a" in b.book.contributors(0)  # our push still reached it


async def test_peer_leaving_mid_round_ends_the_wait(nodes: Nodes) -> None:
    a = await nodes.start("a", sync_timeout_s=30.0)
    b = await nodes.start("b", peers=[a.advertise])
    await wait_until(lambda: alive_ids(a) == {"b"} and alive_ids(b) == {"a"}, what="a and b to meet")

    t0 = time.monotonic()
    ex = asyncio.create_task(exchange(a, encode("a", make_vector(1))))
    try:
        await wait_until(lambda: "a" in b.book.contributors(0), what="a's contribution at b")
        assert not ex.done(), "a closed the round without waiting for b"
        await nodes.stop(b)
        got = await asyncio.wait_for(ex, timeout=15.0)
    finally:
        ex.cancel()
        await asyncio.gather(ex, return_exceptions=True)
    elapsed_s = time.monotonic() - t0
    assert got.contributors == ["a"]
    assert elapsed_s < 10.0, f"exchange took {elapsed_s:.2f} s after b left (deadline 30 s)"
    assert alive_ids(a) == set()


async def test_nodes_of_different_models_stay_apart(
    nodes: Nodes, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="neuronode.swarm")
    a = await nodes.start("a")
    b = await nodes.start("b", peers=[a.advertise], manifest_hash="b2" * 32)
    a.table.add_address(b.advertise)  # both dial each other

    def refused(node: SwarmNode) -> bool:
        """Whether a Hello of `node` was refused (logged by caller or callee, naming `node`)."""
        mark = f"manifest mismatch: {node.cfg.node_id} trains another model"
        return any(mark in r.getMessage() for r in caplog.records)

    await wait_until(lambda: refused(a) and refused(b), what="each node's hello to be refused")
    # Apart is a state that must last: check it across several heartbeats (redials included).
    await holds_for(lambda: not a.table.peers and not b.table.peers,
                    what="a and b to stay apart", duration_s=6 * HEARTBEAT_S)


@pytest.mark.timeout(60)
async def test_push_window_follows_min_peers_extension() -> None:
    """A round kept open by --min-peers keeps pushing our contribution to peers that join late,
    so neither side waits for the other forever."""
    pool = ThreadPoolExecutor(2)
    a = SwarmNode(swarm_config("a", sync_timeout_s=1.0, min_contributors=2), executor=pool)
    await a.start()
    b = None
    try:
        ex_a = asyncio.create_task(exchange(a, encode("a", make_vector(1))))
        # Let a's first deadline pass (it then waits alone for --min-peers) before b exists.
        await asyncio.wait({ex_a}, timeout=2.5)
        assert not ex_a.done()
        b = SwarmNode(swarm_config("b", peers=(a.advertise,), sync_timeout_s=1.0, min_contributors=2),
                      executor=pool)
        await b.start()
        got_b = await asyncio.wait_for(exchange(b, encode("b", make_vector(2))), timeout=20)
        got_a = await asyncio.wait_for(ex_a, timeout=20)
        assert got_a.contributors == got_b.contributors == ["a", "b"]
    finally:
        await a.stop(grace_s=0.2)
        if b is not None:
            await b.stop(grace_s=0.2)
        pool.shutdown()
