"""ContributionChunk framing without protobuf copying the payload.

Protobuf's Python runtime copies a bytes field when it builds, serializes or parses a message
and on every read, and ByteSize() serializes the whole message (for a 1 MiB payload ~0.6 ms to
send a chunk and ~0.8 ms to take one in on 2 cores). The header (every field but the payload)
goes through protobuf, the payload is appended as field 7 and read back as a view into the
received bytes: the bytes are exactly a ContributionChunk's, and any protobuf parser reads them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from functools import partial
from typing import Any

from neuronode.codec import Contribution, repack, shuffle_width
from neuronode.swarm.wire import CODEC_TO_PB, MAX_PEERS_LISTED, Refusal
from neuronode.v1 import node_pb2 as pb

PAYLOAD_FIELD = pb.ContributionChunk.DESCRIPTOR.fields_by_name["payload"].number
# A valid chunk has 22 fields, two of them repeated with at most MAX_PEERS_LISTED entries each.
# Walking more fields than this in Python is left to protobuf's C parser (a hostile message of
# millions of one-byte fields must not hold the event loop for seconds).
MAX_FIELDS_WALKED = 4 * MAX_PEERS_LISTED
_PAYLOAD_KEY = bytes([PAYLOAD_FIELD << 3 | 2])  # field 7, wire type 2 (length-delimited)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def serialize_chunk(header: pb.ContributionChunk, payload: bytes) -> bytes:
    """`header` (its payload unset) with `payload` as one serialized ContributionChunk."""
    return b"".join((header.SerializeToString(), _PAYLOAD_KEY, _varint(len(payload)), payload))


def header_of(c: Contribution, *, tag: str = "", swarm_id: str = "") -> pb.ContributionChunk:
    """The header every chunk of contribution `c` repeats (chunk index and compression unset):
    its maker's statement and signature, and `tag`, the membership proof of a closed swarm."""
    return pb.ContributionChunk(
        round_id=c.round_id, sender_id=c.sender_id, swarm_id=swarm_id, chunk_count=c.data.count,
        codec=CODEC_TO_PB[c.codec], contribution_digest=c.digest, weight=c.weight, total_elements=c.n_elements,
        chunk_elements=c.chunk_elements, auth_tag=tag, shuffled=c.shuffled, base_digest=c.base_digest,
        phase=int(c.phase), shard_index=c.shard_index, shard_count=len(c.members),  # type: ignore[arg-type]
        members=c.members, contributors=c.contributors, signature=c.signature, sender_host=c.host)


async def maker_chunks(c: Contribution, *, swarm_id: str, executor: Executor,
                       zstd_level: int) -> AsyncIterator[bytes]:
    """Another member's contribution `c`, serialized chunk by chunk as its maker signed it (its
    statement and signature in every header; payloads compressed again, off the event loop):
    what a holder serves (FetchContribution) and a relay forwards. `zstd_level`: the node's
    --zstd-level (auto, -1: level 1, cheap, and these bytes cross a home link twice)."""
    zstd_level = 1 if zstd_level < 0 else zstd_level
    header = header_of(c, swarm_id=swarm_id)
    width, loop = shuffle_width(c.codec, c.shuffled), asyncio.get_running_loop()
    for index in range(c.data.count):
        data, compressed = await loop.run_in_executor(
            executor, partial(repack, c.data.raw(index), width=width, zstd_level=zstd_level))
        header.chunk_index, header.compressed = index, compressed
        yield serialize_chunk(header, data)


def _read_varint(data: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("truncated or overlong varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


class ChunkView:
    """A received ContributionChunk: header fields parsed by protobuf (read them as attributes,
    as on the message), `payload` a read-only view into the received bytes (no copy), and
    ByteSize() the size received."""

    __slots__ = ("header", "payload", "wire_size")

    def __init__(self, header: pb.ContributionChunk, payload: memoryview | bytes, wire_size: int) -> None:
        self.header = header
        self.payload = payload
        self.wire_size = wire_size

    def __getattr__(self, name: str) -> Any:
        return getattr(self.header, name)

    def ByteSize(self) -> int:  # noqa: N802 - the message's method name
        return self.wire_size

    @classmethod
    def parse(cls, data: bytes) -> ChunkView:
        """Split `data` at its payload field(s) (the last one counts, as protobuf has it) and
        parse the rest; ValueError or protobuf's DecodeError when it is not a valid message."""
        view = memoryview(data)
        pos, end, walked = 0, len(data), 0
        spans: list[tuple[int, int]] = []  # (field start, payload end)
        payload_at = 0
        while pos < end:
            walked += 1
            if walked > MAX_FIELDS_WALKED:  # not a chunk we sent: protobuf parses (and copies) it
                message = pb.ContributionChunk.FromString(data)
                payload = message.payload
                message.ClearField("payload")
                return cls(message, payload, end)
            start = pos
            key, pos = _read_varint(view, pos)
            number, wire_type = key >> 3, key & 7
            if number == 0:
                raise ValueError("field number 0")
            if wire_type == 0:
                _, pos = _read_varint(view, pos)
            elif wire_type in (1, 5):
                pos += 8 if wire_type == 1 else 4
            elif wire_type == 2:
                length, pos = _read_varint(view, pos)
                if number == PAYLOAD_FIELD:
                    spans.append((start, pos + length))
                    payload_at = pos
                pos += length
            else:
                raise ValueError(f"unsupported wire type {wire_type}")
            if pos > end:
                raise ValueError("truncated message")
        if not spans:
            return cls(pb.ContributionChunk.FromString(data), b"", end)
        pieces, at = [], 0
        for start, stop in spans:
            pieces.append(view[at:start])
            at = stop
        pieces.append(view[at:])
        return cls(pb.ContributionChunk.FromString(b"".join(pieces)), view[payload_at:spans[-1][1]], end)


def parse_chunk(data: bytes | ChunkView | pb.ContributionChunk, index: int) -> ChunkView | pb.ContributionChunk:
    """A chunk off the wire, or a Refusal naming what is wrong with it."""
    if not isinstance(data, (bytes, bytearray)):
        return data  # in-process callers hand messages over as they are
    try:
        return ChunkView.parse(bytes(data))
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise Refusal("INVALID_ARGUMENT", f"PushContribution: chunk {index} is not a valid ContributionChunk "
                      f"message ({type(exc).__name__}: {str(exc)[:200]}); check that both sides run the "
                      "same neuronode protocol") from None
