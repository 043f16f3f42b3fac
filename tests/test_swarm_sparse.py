"""The sparse codec in a swarm of in-process SwarmNodes on 127.0.0.1:0: members average each
other's sparse contributions bit-identically, a member with other --sparse-* settings is refused
at Hello naming the flag, and a member's hostile sparse chunks are refused INVALID_ARGUMENT
without anything of them stored (the node takes its honest stream right after)."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import grpc
import numpy as np
import pytest
import torch
import zstandard as zstd
from helpers import Nodes, chunks_of, hides_refusal, key_of, wait_until

from neuronode.averaging import AllToAll, AveragingConfig, Prepared
from neuronode.codec import ContributionEncoder, EncoderConfig, VectorEncoder, get_codec
from neuronode.diloco import average
from neuronode.swarm.context import Settings
from neuronode.swarm.guard.proofs import Security
from neuronode.swarm.node import SwarmNode
from neuronode.swarm.wire import PROTOCOL_VERSION, settings_to_pb
from neuronode.v1 import node_pb2 as pb
from neuronode.v1 import node_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)

SWARM, MANIFEST, ROGUE = "net-test", "a1" * 32, "rogue"
SETTINGS = Settings(codec="sparse", sparse_k=8, sparse_bits=4, sparse_block=64)  # 8 of 64: many blocks
SPEC = SETTINGS.codec_spec
N_ELEMENTS = 10_000  # 157 blocks, the last of 16 elements
CHUNK_BYTES = 1024  # 78 blocks a chunk: 3 chunks
Code = grpc.StatusCode
Chunks = list[pb.ContributionChunk]


def vector(seed: int) -> torch.Tensor:
    return torch.randn(N_ELEMENTS, generator=torch.Generator().manual_seed(seed))


def sparse(node_id: str, x: torch.Tensor, *, weight: float = 1.0) -> Any:
    return VectorEncoder(codec=SPEC, chunk_bytes=CHUNK_BYTES, zstd_level=1, byte_shuffle=False).encode(
        x, 0.0, weight=weight, sender_id=node_id)


def honest() -> Chunks:
    return chunks_of(sparse(ROGUE, vector(7)), swarm_id=SWARM, sender_id=ROGUE)


async def start(nodes: Nodes, node_id: str, **overrides: Any) -> SwarmNode:
    return await nodes.start(node_id, settings=SETTINGS, **overrides)


class Rogue:
    """A raw member: it says Hello with the swarm's settings (or others) and pushes chunks."""

    def __init__(self, node: SwarmNode, channel: grpc.aio.Channel, advertise: str) -> None:
        self.node, self.stub, self.advertise = node, pb_grpc.NodeStub(channel), advertise

    async def hello(self, settings: Settings = SETTINGS) -> None:
        request = pb.HelloRequest(info=pb.NodeInfo(
            node_id=ROGUE, swarm_id=SWARM, protocol_version=PROTOCOL_VERSION, manifest_hash=MANIFEST,
            advertise=self.advertise, settings=settings_to_pb(settings)))
        Security(node_id=ROGUE, swarm_id=SWARM, key=key_of(ROGUE)).sign_hello(request)
        await self.stub.Hello(request, timeout=10)

    async def push(self, chunks: Chunks) -> tuple[Code, str]:
        async def stream() -> AsyncIterator[pb.ContributionChunk]:
            for chunk in chunks:
                yield chunk

        for _ in range(5):
            try:
                await self.stub.PushContribution(stream(), timeout=10)
            except grpc.aio.AioRpcError as exc:
                if hides_refusal(exc.code(), exc.details() or ""):
                    continue  # helpers.GRPC_EARLY_STATUS_BUG
                return exc.code(), exc.details() or ""
            return Code.OK, ""
        raise AssertionError("every push met grpc/grpc#36066")


@pytest.fixture
async def rogue(nodes: Nodes, refused_address: str) -> AsyncIterator[Rogue]:
    node = await start(nodes, "target")
    channel = grpc.aio.insecure_channel(node.advertise)
    try:
        yield Rogue(node, channel, refused_address)
    finally:
        await channel.close()


async def test_three_members_average_sparse_contributions_bit_identically(nodes: Nodes) -> None:
    a = await start(nodes, "a")
    b = await start(nodes, "b", peers=[a.advertise])
    c = await start(nodes, "c", peers=[a.advertise])
    trio = {"a": a, "b": b, "c": c}
    await wait_until(lambda: all(len(n.table.alive()) == 2 for n in trio.values()), what="all three to meet")
    weights = {"a": 1.0, "b": 2.0, "c": 5.0}
    own = {n: sparse(n, vector(i), weight=weights[n]) for i, n in enumerate(trio)}

    async def exchange(name: str) -> Any:
        node = trio[name]
        encoder = ContributionEncoder(EncoderConfig(codec=SPEC, chunk_bytes=CHUNK_BYTES, zstd_level=1,
                                                    byte_shuffle=False), n_elements=N_ELEMENTS, sender_id=name)
        protocol = AllToAll(AveragingConfig(node_id=name, codec=SPEC, n_elements=N_ELEMENTS, sync_timeout_s=20,
                                            min_contributors=3),
                            transport=node.transport, encoder=encoder, encoder_pool=node.ctx.executor,
                            aggregate=average, executor=node.ctx.executor)
        return await protocol.exchange(Prepared(round_id=0, parts=[own[name]], compensated=own[name].data.decode()))

    results = await asyncio.gather(*(exchange(n) for n in trio))
    expected = average({n: (own[n].data.decode(), weights[n]) for n in trio})
    for got in results:
        assert got.contributors == ["a", "b", "c"]
        assert torch.equal(got.vector.view(torch.int32), expected.view(torch.int32))
    kept = sum(int((own[n].data.decode() != 0).sum()) for n in trio)
    assert 0 < int((expected != 0).sum()) <= kept  # the union of what each member kept


@pytest.mark.parametrize(("change", "flag"), [
    ({"sparse_k": 16}, "--sparse-k 16"), ({"sparse_bits": 2}, "--sparse-bits 2"),
    ({"sparse_block": 128}, "--sparse-block 128"), ({"sparse_decay": 0.9}, "--sparse-decay 0.9"),
    ({"codec": "int8"}, "--codec int8"),
])
async def test_a_member_with_other_sparse_settings_is_refused_at_hello(rogue: Rogue, change: dict[str, Any],
                                                                        flag: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await rogue.hello(replace(SETTINGS, **change))
    details = refused.value.details() or ""
    assert refused.value.code() == Code.FAILED_PRECONDITION and flag in details, details
    ours = {"sparse_k": "--sparse-k 8", "sparse_bits": "--sparse-bits 4", "sparse_block": "--sparse-block 64",
            "sparse_decay": "--sparse-decay 0.95", "codec": "--codec sparse"}[next(iter(change))]
    assert ours in details, details
    assert ROGUE not in rogue.node.table.peers


# ---- hostile chunks: each payload fails the codec's checks, before its digest is even read ----


def unary_at() -> int:
    """Where chunk 0's index bit stream starts (the chunk holds whole blocks)."""
    codec = get_codec(SPEC)
    scales, fields, _, _ = codec._sections(chunk_elements())  # type: ignore[attr-defined]
    return int(scales + fields)


def chunk_elements() -> int:
    """Elements of chunk 0 (a full one)."""
    chunks = honest()
    assert len(chunks) == 3
    return int(chunks[0].chunk_elements)


def raw(tamper: Callable[[bytes], bytes]) -> Callable[[Chunks], Chunks]:
    """Chunk 0's raw payload rewritten by `tamper`, sent uncompressed."""

    def apply(chunks: Chunks) -> Chunks:
        payload = chunks[0].payload
        if chunks[0].compressed:
            payload = zstd.ZstdDecompressor().decompress(payload)
        chunks[0].payload, chunks[0].compressed = tamper(bytes(payload)), False
        return chunks

    return apply


def with_unary(change: Callable[[np.ndarray], np.ndarray]) -> Callable[[bytes], bytes]:
    def tamper(payload: bytes) -> bytes:
        at = unary_at()
        bits = np.unpackbits(np.frombuffer(payload[at:], dtype=np.uint8), bitorder="little")
        return payload[:at] + np.packbits(change(bits), bitorder="little").tobytes()

    return tamper


def extra_entry(bits: np.ndarray) -> np.ndarray:
    bits = bits.copy()
    last = int(np.flatnonzero(bits)[-1])
    if last % 8 == 7:
        return np.concatenate([bits, [1] + [0] * 7]).astype(np.uint8)
    bits[last + 1] = 1
    return bits


def first_gap_far(bits: np.ndarray) -> np.ndarray:
    """The first gap 2^r × 64 longer: its block's indices run past the block's end."""
    return np.concatenate([np.zeros(64, dtype=np.uint8), bits])


def compressed_past_bound(chunks: Chunks) -> Chunks:
    bound = get_codec(SPEC).payload_bytes(chunk_elements())
    chunks[0].payload = zstd.ZstdCompressor(level=1, write_content_size=True).compress(bytes(bound + 1))
    chunks[0].compressed = True
    return chunks


HOSTILE = [
    pytest.param(raw(lambda p: p[:-1]), id="truncated-bit-stream"),
    pytest.param(raw(lambda p: p + b"\x00"), id="trailing-byte"),
    pytest.param(raw(lambda p: p + bytes(4096)), id="longer-than-the-bound"),
    pytest.param(raw(lambda p: struct.pack("<f", float("nan")) + p[4:]), id="nan-scale"),
    pytest.param(raw(lambda p: struct.pack("<f", float("inf")) + p[4:]), id="inf-scale"),
    pytest.param(raw(lambda p: struct.pack("<f", -1.0) + p[4:]), id="negative-scale"),
    pytest.param(raw(with_unary(extra_entry)), id="more-than-k-entries"),
    pytest.param(raw(with_unary(lambda bits: np.zeros_like(bits))), id="no-entries"),
    pytest.param(raw(with_unary(first_gap_far)), id="index-out-of-range"),
    pytest.param(compressed_past_bound, id="declares-more-than-the-bound"),
]


@pytest.mark.parametrize("tamper", HOSTILE)
async def test_hostile_sparse_chunks_are_refused_and_never_stored(rogue: Rogue,
                                                                  tamper: Callable[[Chunks], Chunks]) -> None:
    await rogue.hello()
    status, details = await rogue.push(tamper(honest()))
    assert status == Code.INVALID_ARGUMENT, details
    assert ROGUE not in rogue.node.book.contributors(0)
    status, details = await rogue.push(honest())
    assert status == Code.OK, details
    stored = rogue.node.book.close(0)[ROGUE]
    assert torch.equal(stored.data.decode(), sparse(ROGUE, vector(7)).data.decode())


async def test_randomly_mutated_sparse_chunks_never_reach_the_book(rogue: Rogue) -> None:
    """Seeded fuzzing: one byte of one chunk's raw payload changed, or the payload cut or
    padded at random. A change the codec cannot tell from honest (a value's sign, a scale's
    low bits) fails the digest instead: every stream is refused, nothing is stored."""
    import random

    await rogue.hello()
    rng = random.Random(28)
    codes = set()
    for _ in range(24):
        chunks = honest()
        index = rng.randrange(len(chunks))
        payload = bytearray(zstd.ZstdDecompressor().decompress(chunks[index].payload)
                            if chunks[index].compressed else chunks[index].payload)
        how = rng.choice(["byte", "cut", "pad"])
        if how == "byte":
            at = rng.randrange(len(payload))
            payload[at] ^= rng.randrange(1, 256)
        elif how == "cut":
            del payload[rng.randrange(len(payload)):]
        else:
            payload += bytes(rng.randrange(1, 64))
        chunks[index].payload, chunks[index].compressed = bytes(payload), False
        status, details = await rogue.push(chunks)
        assert status in (Code.INVALID_ARGUMENT, Code.DATA_LOSS), (how, details)
        assert ROGUE not in rogue.node.book.contributors(0)
        codes.add(status)
    assert Code.INVALID_ARGUMENT in codes
