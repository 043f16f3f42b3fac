"""gRPC settings and proto conversions shared by the server and the clients."""

from __future__ import annotations

from typing import Any

import grpc

from neuronode.v1 import node_pb2 as pb

# 2: reduce-scatter shard receipts; 3: swarm-wide settings in Hello (NodeInfo.settings);
# 4: this release (the task's settings in NodeInfo.settings.task, SwarmSettings.max_local_workers,
# --max-weight (SwarmSettings.max_weight),
# the sparse codec and its settings, state transfer by verified chunks, resumable
# (StateHeader.chunk_digests, StateRequest.resume_from), ...: docs/protocol.md)
PROTOCOL_VERSION = 5
# Chunks are at most 4 MiB of payload (config bounds --chunk-bytes); messages get headroom so a
# legal chunk never trips the limit, and anything bigger is refused by gRPC before we read it.
MAX_MESSAGE_BYTES = 8 << 20
MAX_ID_CHARS = 128
MAX_ADDRESS_CHARS = 256
MAX_PEERS_LISTED = 256
MAX_TASK_SETTINGS = 32
MAX_SETTING_NAME_CHARS = 64
MAX_SETTING_VALUE_CHARS = 128
# A transfer (a push, a fetch, a session's stream, a state download) that moves no chunk for
# STALL_S is cut; one that may last longer than STALL_S goes on while it moves at least
# MIN_RATE_BYTES_PER_S.
STALL_S = 30.0
MIN_RATE_BYTES_PER_S = 128 << 10

CODEC_TO_PB = {
    "fp32": pb.CODEC_FP32,
    "fp16": pb.CODEC_FP16,
    "bf16": pb.CODEC_BF16,
    "int8": pb.CODEC_INT8,
    "int4": pb.CODEC_INT4,
    "sparse": pb.CODEC_SPARSE,
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
    "ABORTED": grpc.StatusCode.ABORTED,
    "DEADLINE_EXCEEDED": grpc.StatusCode.DEADLINE_EXCEEDED,
    "NOT_FOUND": grpc.StatusCode.NOT_FOUND,
}


def settings_to_pb(s: Any) -> pb.SwarmSettings:
    """Settings (neuronode.swarm.context) as NodeInfo.settings."""
    return pb.SwarmSettings(codec=CODEC_TO_PB[s.codec], averaging=s.averaging, aggregator=s.aggregator,
                            outer_lr=s.outer_lr, outer_momentum=s.outer_momentum, overlap=s.overlap,
                            max_local_workers=s.max_local_workers,
                            task=[pb.TaskSetting(name=k, value=v) for k, v in s.task],
                            sparse_k=s.sparse_k, sparse_bits=s.sparse_bits, sparse_block=s.sparse_block,
                            sparse_decay=s.sparse_decay, max_weight=s.max_weight, gather_makers=s.gather_makers)


def settings_fields(m: pb.SwarmSettings) -> dict[str, Any]:
    """NodeInfo.settings as the fields of Settings (an unknown codec reads as its number)."""
    return {"codec": PB_TO_CODEC.get(m.codec, f"codec {m.codec}"), "averaging": m.averaging,
            "aggregator": m.aggregator, "outer_lr": m.outer_lr, "outer_momentum": m.outer_momentum,
            "overlap": m.overlap, "max_local_workers": m.max_local_workers,
            "task": tuple((t.name, t.value) for t in m.task), "sparse_k": m.sparse_k,
            "sparse_bits": m.sparse_bits, "sparse_block": m.sparse_block, "sparse_decay": m.sparse_decay,
            "max_weight": m.max_weight, "gather_makers": m.gather_makers}


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
        elif fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            value = dict(value)
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
