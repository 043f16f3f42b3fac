"""gRPC settings and proto conversions shared by the server and the clients."""

from __future__ import annotations

from typing import Any

import grpc

from neuronode.v1 import node_pb2 as pb

PROTOCOL_VERSION = 2  # 2: reduce-scatter shard receipts (NodeInfo.shards_received)
# Chunks are at most 4 MiB of payload (config bounds --chunk-bytes); messages get headroom so a
# legal chunk never trips the limit, and anything bigger is refused by gRPC before we read it.
MAX_MESSAGE_BYTES = 8 << 20
MAX_ID_CHARS = 128
MAX_ADDRESS_CHARS = 256
MAX_PEERS_LISTED = 256

CODEC_TO_PB = {
    "fp32": pb.CODEC_FP32,
    "fp16": pb.CODEC_FP16,
    "bf16": pb.CODEC_BF16,
    "int8": pb.CODEC_INT8,
    "int4": pb.CODEC_INT4,
}
PB_TO_CODEC = {v: k for k, v in CODEC_TO_PB.items()}

# Keepalive: clients ping every 30 s so idle connections through NAT stay open during long inner
# loops; servers accept pings that often even without calls in flight, and never answer them
# with a too_many_pings GOAWAY.
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 5000),
]
SERVER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.so_reuseport", 0),
]

STATUS_CODES = {
    "FAILED_PRECONDITION": grpc.StatusCode.FAILED_PRECONDITION,
    "ALREADY_EXISTS": grpc.StatusCode.ALREADY_EXISTS,
    "INVALID_ARGUMENT": grpc.StatusCode.INVALID_ARGUMENT,
    "DATA_LOSS": grpc.StatusCode.DATA_LOSS,
    "RESOURCE_EXHAUSTED": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "PERMISSION_DENIED": grpc.StatusCode.PERMISSION_DENIED,
    "UNAUTHENTICATED": grpc.StatusCode.UNAUTHENTICATED,
    "UNAVAILABLE": grpc.StatusCode.UNAVAILABLE,
}


class Refusal(Exception):
    """A request we refuse; carries the gRPC status code name and a message a person can act on."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def status_to_dict(resp: pb.StatusResponse) -> dict[str, Any]:
    """StatusResponse -> the JSON dict `neuronode status` prints (snake_case keys, real ints)."""
    out: dict[str, Any] = {}
    for fd in resp.DESCRIPTOR.fields:
        value = getattr(resp, fd.name)
        if fd.name == "peers":
            value = [
                {"node_id": p.node_id, "address": p.address,
                 "last_seen_s": round(p.last_seen_s, 3), "alive": p.alive}
                for p in value
            ]
        elif fd.is_repeated:
            value = list(value)
        out[fd.name] = value
    return out


def dict_to_status(d: dict[str, Any]) -> pb.StatusResponse:
    """The inverse of status_to_dict, ignoring keys the proto doesn't have."""
    known = {fd.name for fd in pb.StatusResponse.DESCRIPTOR.fields}
    fields = {k: v for k, v in d.items() if k in known and v is not None and k != "peers"}
    resp = pb.StatusResponse(**fields)
    for p in d.get("peers", []):
        resp.peers.add(**p)
    return resp


# ---- ContributionChunk without protobuf copying the payload ----------------------------------
# protobuf's Python runtime (upb) copies a bytes field when it builds a message, again when it
# serializes it, when it parses one and on every read of the field, and ByteSize() serializes
# the whole message. For a 1 MiB payload that was ~0.6 ms to send a chunk and ~0.8 ms to take
# one in, on the 2-core machine: a quarter of a reduce-scatter round's CPU. Chunks are therefore
# framed here: the header (every field but the payload) through protobuf, the payload appended
# as field 7 on the wire (fields may come in any order), and read back as a view into the
# received message. The bytes are exactly a ContributionChunk's: any protobuf parser reads them.

PAYLOAD_FIELD = pb.ContributionChunk.DESCRIPTOR.fields_by_name["payload"].number
# A valid chunk has 20 fields, two of them repeated with at most MAX_PEERS_LISTED entries each.
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
        pos, end = 0, len(data)
        spans: list[tuple[int, int, int]] = []  # (field start, payload start, payload end)
        walked = 0
        while pos < end:
            walked += 1
            if walked > MAX_FIELDS_WALKED:  # not a chunk we sent: protobuf parses (and copies) it
                message = pb.ContributionChunk.FromString(data)
                payload = message.payload
                message.ClearField("payload")
                return cls(message, payload, end)
            start = pos
            key, pos = _read_varint(view, pos)
            field, wire_type = key >> 3, key & 7
            if field == 0:
                raise ValueError("field number 0")
            if wire_type == 0:
                _, pos = _read_varint(view, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == 2:
                length, pos = _read_varint(view, pos)
                if field == PAYLOAD_FIELD:
                    spans.append((start, pos, pos + length))
                pos += length
            else:
                raise ValueError(f"unsupported wire type {wire_type}")
            if pos > end:
                raise ValueError("truncated message")
        if not spans:
            return cls(pb.ContributionChunk.FromString(data), b"", end)
        pieces, at = [], 0
        for start, _, stop in spans:
            pieces.append(view[at:start])
            at = stop
        pieces.append(view[at:])
        header = pb.ContributionChunk.FromString(b"".join(pieces))
        _, first, last = spans[-1]
        return cls(header, view[first:last], end)
