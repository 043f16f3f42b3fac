from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Reachability(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REACHABILITY_UNSPECIFIED: _ClassVar[Reachability]
    REACHABILITY_YES: _ClassVar[Reachability]
    REACHABILITY_NO: _ClassVar[Reachability]

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    CODEC_FP32: _ClassVar[Codec]
    CODEC_FP16: _ClassVar[Codec]
    CODEC_BF16: _ClassVar[Codec]
    CODEC_INT8: _ClassVar[Codec]
    CODEC_INT4: _ClassVar[Codec]
    CODEC_SPARSE: _ClassVar[Codec]

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    PHASE_SHARD: _ClassVar[Phase]
    PHASE_AVERAGED: _ClassVar[Phase]
    PHASE_UPDATE: _ClassVar[Phase]

class StatePart(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATE_PART_UNSPECIFIED: _ClassVar[StatePart]
    STATE_PART_PARAMS: _ClassVar[StatePart]
    STATE_PART_MOMENTUM: _ClassVar[StatePart]
REACHABILITY_UNSPECIFIED: Reachability
REACHABILITY_YES: Reachability
REACHABILITY_NO: Reachability
CODEC_UNSPECIFIED: Codec
CODEC_FP32: Codec
CODEC_FP16: Codec
CODEC_BF16: Codec
CODEC_INT8: Codec
CODEC_INT4: Codec
CODEC_SPARSE: Codec
PHASE_UNSPECIFIED: Phase
PHASE_SHARD: Phase
PHASE_AVERAGED: Phase
PHASE_UPDATE: Phase
STATE_PART_UNSPECIFIED: StatePart
STATE_PART_PARAMS: StatePart
STATE_PART_MOMENTUM: StatePart

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "swarm_id", "protocol_version", "manifest_hash", "advertise", "round", "param_digest", "recent_digests", "leaving", "contributes_from", "settings", "public_key", "receipts", "echoes", "disputed", "reachable", "carried_by", "wanted")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SWARM_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_HASH_FIELD_NUMBER: _ClassVar[int]
    ADVERTISE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PARAM_DIGEST_FIELD_NUMBER: _ClassVar[int]
    RECENT_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTES_FROM_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    RECEIPTS_FIELD_NUMBER: _ClassVar[int]
    ECHOES_FIELD_NUMBER: _ClassVar[int]
    DISPUTED_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    CARRIED_BY_FIELD_NUMBER: _ClassVar[int]
    WANTED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    swarm_id: str
    protocol_version: int
    manifest_hash: str
    advertise: str
    round: int
    param_digest: str
    recent_digests: _containers.RepeatedCompositeFieldContainer[RoundDigest]
    leaving: bool
    contributes_from: int
    settings: SwarmSettings
    public_key: bytes
    receipts: _containers.RepeatedCompositeFieldContainer[Receipt]
    echoes: _containers.RepeatedCompositeFieldContainer[ReceiptEcho]
    disputed: _containers.RepeatedCompositeFieldContainer[Receipt]
    reachable: Reachability
    carried_by: _containers.RepeatedScalarFieldContainer[str]
    wanted: _containers.RepeatedCompositeFieldContainer[ReceiptEcho]
    def __init__(self, node_id: _Optional[str] = ..., swarm_id: _Optional[str] = ..., protocol_version: _Optional[int] = ..., manifest_hash: _Optional[str] = ..., advertise: _Optional[str] = ..., round: _Optional[int] = ..., param_digest: _Optional[str] = ..., recent_digests: _Optional[_Iterable[_Union[RoundDigest, _Mapping]]] = ..., leaving: _Optional[bool] = ..., contributes_from: _Optional[int] = ..., settings: _Optional[_Union[SwarmSettings, _Mapping]] = ..., public_key: _Optional[bytes] = ..., receipts: _Optional[_Iterable[_Union[Receipt, _Mapping]]] = ..., echoes: _Optional[_Iterable[_Union[ReceiptEcho, _Mapping]]] = ..., disputed: _Optional[_Iterable[_Union[Receipt, _Mapping]]] = ..., reachable: _Optional[_Union[Reachability, str]] = ..., carried_by: _Optional[_Iterable[str]] = ..., wanted: _Optional[_Iterable[_Union[ReceiptEcho, _Mapping]]] = ...) -> None: ...

class Statement(_message.Message):
    __slots__ = ("sender_id", "phase", "shard_index", "lineage", "body", "signature", "public_key")
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    sender_id: str
    phase: Phase
    shard_index: int
    lineage: bytes
    body: bytes
    signature: bytes
    public_key: bytes
    def __init__(self, sender_id: _Optional[str] = ..., phase: _Optional[_Union[Phase, str]] = ..., shard_index: _Optional[int] = ..., lineage: _Optional[bytes] = ..., body: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., public_key: _Optional[bytes] = ...) -> None: ...

class Receipt(_message.Message):
    __slots__ = ("round", "phase", "maker_id", "statements", "signature", "public_key", "listed_digest", "statement_ids")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    MAKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATEMENTS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    LISTED_DIGEST_FIELD_NUMBER: _ClassVar[int]
    STATEMENT_IDS_FIELD_NUMBER: _ClassVar[int]
    round: int
    phase: Phase
    maker_id: str
    statements: _containers.RepeatedCompositeFieldContainer[Statement]
    signature: bytes
    public_key: bytes
    listed_digest: bytes
    statement_ids: bytes
    def __init__(self, round: _Optional[int] = ..., phase: _Optional[_Union[Phase, str]] = ..., maker_id: _Optional[str] = ..., statements: _Optional[_Iterable[_Union[Statement, _Mapping]]] = ..., signature: _Optional[bytes] = ..., public_key: _Optional[bytes] = ..., listed_digest: _Optional[bytes] = ..., statement_ids: _Optional[bytes] = ...) -> None: ...

class ReceiptEcho(_message.Message):
    __slots__ = ("round", "phase", "maker_id", "receipt_hash", "whole")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    MAKER_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_HASH_FIELD_NUMBER: _ClassVar[int]
    WHOLE_FIELD_NUMBER: _ClassVar[int]
    round: int
    phase: Phase
    maker_id: str
    receipt_hash: bytes
    whole: bool
    def __init__(self, round: _Optional[int] = ..., phase: _Optional[_Union[Phase, str]] = ..., maker_id: _Optional[str] = ..., receipt_hash: _Optional[bytes] = ..., whole: _Optional[bool] = ...) -> None: ...

class SwarmSettings(_message.Message):
    __slots__ = ("codec", "averaging", "aggregator", "outer_lr", "outer_momentum", "overlap", "max_local_workers", "task", "sparse_k", "sparse_bits", "sparse_block", "sparse_decay", "max_weight", "gather_makers")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    AVERAGING_FIELD_NUMBER: _ClassVar[int]
    AGGREGATOR_FIELD_NUMBER: _ClassVar[int]
    OUTER_LR_FIELD_NUMBER: _ClassVar[int]
    OUTER_MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    MAX_LOCAL_WORKERS_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    SPARSE_K_FIELD_NUMBER: _ClassVar[int]
    SPARSE_BITS_FIELD_NUMBER: _ClassVar[int]
    SPARSE_BLOCK_FIELD_NUMBER: _ClassVar[int]
    SPARSE_DECAY_FIELD_NUMBER: _ClassVar[int]
    MAX_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    GATHER_MAKERS_FIELD_NUMBER: _ClassVar[int]
    codec: Codec
    averaging: str
    aggregator: str
    outer_lr: float
    outer_momentum: float
    overlap: bool
    max_local_workers: int
    task: _containers.RepeatedCompositeFieldContainer[TaskSetting]
    sparse_k: int
    sparse_bits: int
    sparse_block: int
    sparse_decay: float
    max_weight: float
    gather_makers: int
    def __init__(self, codec: _Optional[_Union[Codec, str]] = ..., averaging: _Optional[str] = ..., aggregator: _Optional[str] = ..., outer_lr: _Optional[float] = ..., outer_momentum: _Optional[float] = ..., overlap: _Optional[bool] = ..., max_local_workers: _Optional[int] = ..., task: _Optional[_Iterable[_Union[TaskSetting, _Mapping]]] = ..., sparse_k: _Optional[int] = ..., sparse_bits: _Optional[int] = ..., sparse_block: _Optional[int] = ..., sparse_decay: _Optional[float] = ..., max_weight: _Optional[float] = ..., gather_makers: _Optional[int] = ...) -> None: ...

class TaskSetting(_message.Message):
    __slots__ = ("name", "value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: str
    def __init__(self, name: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class RoundDigest(_message.Message):
    __slots__ = ("round", "param_digest", "contributors", "momentum_digest")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PARAM_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_DIGEST_FIELD_NUMBER: _ClassVar[int]
    round: int
    param_digest: str
    contributors: int
    momentum_digest: str
    def __init__(self, round: _Optional[int] = ..., param_digest: _Optional[str] = ..., contributors: _Optional[int] = ..., momentum_digest: _Optional[str] = ...) -> None: ...

class PeerRecord(_message.Message):
    __slots__ = ("node_id", "address")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class HelloRequest(_message.Message):
    __slots__ = ("info", "known_peers", "auth_tag", "timestamp_s", "signature")
    INFO_FIELD_NUMBER: _ClassVar[int]
    KNOWN_PEERS_FIELD_NUMBER: _ClassVar[int]
    AUTH_TAG_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_S_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    info: NodeInfo
    known_peers: _containers.RepeatedCompositeFieldContainer[PeerRecord]
    auth_tag: str
    timestamp_s: int
    signature: bytes
    def __init__(self, info: _Optional[_Union[NodeInfo, _Mapping]] = ..., known_peers: _Optional[_Iterable[_Union[PeerRecord, _Mapping]]] = ..., auth_tag: _Optional[str] = ..., timestamp_s: _Optional[int] = ..., signature: _Optional[bytes] = ...) -> None: ...

class HelloResponse(_message.Message):
    __slots__ = ("info", "known_peers", "auth_tag", "timestamp_s", "signature", "observed_address")
    INFO_FIELD_NUMBER: _ClassVar[int]
    KNOWN_PEERS_FIELD_NUMBER: _ClassVar[int]
    AUTH_TAG_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_S_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    info: NodeInfo
    known_peers: _containers.RepeatedCompositeFieldContainer[PeerRecord]
    auth_tag: str
    timestamp_s: int
    signature: bytes
    observed_address: str
    def __init__(self, info: _Optional[_Union[NodeInfo, _Mapping]] = ..., known_peers: _Optional[_Iterable[_Union[PeerRecord, _Mapping]]] = ..., auth_tag: _Optional[str] = ..., timestamp_s: _Optional[int] = ..., signature: _Optional[bytes] = ..., observed_address: _Optional[str] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("node_id", "swarm_id", "timestamp_s", "signature", "callee_id", "nonce")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SWARM_ID_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_S_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    CALLEE_ID_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    swarm_id: str
    timestamp_s: int
    signature: bytes
    callee_id: str
    nonce: bytes
    def __init__(self, node_id: _Optional[str] = ..., swarm_id: _Optional[str] = ..., timestamp_s: _Optional[int] = ..., signature: _Optional[bytes] = ..., callee_id: _Optional[str] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ContributionChunk(_message.Message):
    __slots__ = ("round_id", "sender_id", "chunk_index", "chunk_count", "codec", "compressed", "payload", "contribution_digest", "weight", "total_elements", "swarm_id", "chunk_elements", "auth_tag", "shuffled", "base_digest", "phase", "shard_index", "shard_count", "members", "contributors", "signature", "sender_host")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    COMPRESSED_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTION_DIGEST_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    SWARM_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    AUTH_TAG_FIELD_NUMBER: _ClassVar[int]
    SHUFFLED_FIELD_NUMBER: _ClassVar[int]
    BASE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    SENDER_HOST_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    sender_id: str
    chunk_index: int
    chunk_count: int
    codec: Codec
    compressed: bool
    payload: bytes
    contribution_digest: str
    weight: float
    total_elements: int
    swarm_id: str
    chunk_elements: int
    auth_tag: str
    shuffled: bool
    base_digest: str
    phase: Phase
    shard_index: int
    shard_count: int
    members: _containers.RepeatedScalarFieldContainer[str]
    contributors: _containers.RepeatedScalarFieldContainer[str]
    signature: bytes
    sender_host: str
    def __init__(self, round_id: _Optional[int] = ..., sender_id: _Optional[str] = ..., chunk_index: _Optional[int] = ..., chunk_count: _Optional[int] = ..., codec: _Optional[_Union[Codec, str]] = ..., compressed: _Optional[bool] = ..., payload: _Optional[bytes] = ..., contribution_digest: _Optional[str] = ..., weight: _Optional[float] = ..., total_elements: _Optional[int] = ..., swarm_id: _Optional[str] = ..., chunk_elements: _Optional[int] = ..., auth_tag: _Optional[str] = ..., shuffled: _Optional[bool] = ..., base_digest: _Optional[str] = ..., phase: _Optional[_Union[Phase, str]] = ..., shard_index: _Optional[int] = ..., shard_count: _Optional[int] = ..., members: _Optional[_Iterable[str]] = ..., contributors: _Optional[_Iterable[str]] = ..., signature: _Optional[bytes] = ..., sender_host: _Optional[str] = ...) -> None: ...

class PushAck(_message.Message):
    __slots__ = ("chunks_received",)
    CHUNKS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    chunks_received: int
    def __init__(self, chunks_received: _Optional[int] = ...) -> None: ...

class ContributionRequest(_message.Message):
    __slots__ = ("node_id", "swarm_id", "timestamp_s", "signature", "round_id", "sender_id", "phase", "shard_index", "body", "callee_id", "nonce")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SWARM_ID_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_S_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    CALLEE_ID_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    swarm_id: str
    timestamp_s: int
    signature: bytes
    round_id: int
    sender_id: str
    phase: Phase
    shard_index: int
    body: bytes
    callee_id: str
    nonce: bytes
    def __init__(self, node_id: _Optional[str] = ..., swarm_id: _Optional[str] = ..., timestamp_s: _Optional[int] = ..., signature: _Optional[bytes] = ..., round_id: _Optional[int] = ..., sender_id: _Optional[str] = ..., phase: _Optional[_Union[Phase, str]] = ..., shard_index: _Optional[int] = ..., body: _Optional[bytes] = ..., callee_id: _Optional[str] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("node_id", "swarm_id", "timestamp_s", "signature", "callee_id", "nonce")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SWARM_ID_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_S_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    CALLEE_ID_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    swarm_id: str
    timestamp_s: int
    signature: bytes
    callee_id: str
    nonce: bytes
    def __init__(self, node_id: _Optional[str] = ..., swarm_id: _Optional[str] = ..., timestamp_s: _Optional[int] = ..., signature: _Optional[bytes] = ..., callee_id: _Optional[str] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class SessionMessage(_message.Message):
    __slots__ = ("hello", "chunk", "stream", "end", "relayed")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    RELAYED_FIELD_NUMBER: _ClassVar[int]
    hello: HelloResponse
    chunk: bytes
    stream: int
    end: bool
    relayed: HelloRequest
    def __init__(self, hello: _Optional[_Union[HelloResponse, _Mapping]] = ..., chunk: _Optional[bytes] = ..., stream: _Optional[int] = ..., end: _Optional[bool] = ..., relayed: _Optional[_Union[HelloRequest, _Mapping]] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("node_id", "swarm_id", "timestamp_s", "signature", "resume_from", "resume_digest", "chunks_root", "chunks", "header_only", "callee_id", "nonce")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SWARM_ID_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_S_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_FIELD_NUMBER: _ClassVar[int]
    RESUME_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_ROOT_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    HEADER_ONLY_FIELD_NUMBER: _ClassVar[int]
    CALLEE_ID_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    swarm_id: str
    timestamp_s: int
    signature: bytes
    resume_from: int
    resume_digest: bytes
    chunks_root: str
    chunks: _containers.RepeatedScalarFieldContainer[int]
    header_only: bool
    callee_id: str
    nonce: bytes
    def __init__(self, node_id: _Optional[str] = ..., swarm_id: _Optional[str] = ..., timestamp_s: _Optional[int] = ..., signature: _Optional[bytes] = ..., resume_from: _Optional[int] = ..., resume_digest: _Optional[bytes] = ..., chunks_root: _Optional[str] = ..., chunks: _Optional[_Iterable[int]] = ..., header_only: _Optional[bool] = ..., callee_id: _Optional[str] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class StateHeader(_message.Message):
    __slots__ = ("round", "param_digest", "n_elements", "has_momentum", "momentum_digest", "inner_steps_total", "chunk_elements", "manifest_hash", "auth_tag", "chunk_digests", "state_digest", "first_chunk", "chunks_root")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PARAM_DIGEST_FIELD_NUMBER: _ClassVar[int]
    N_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    HAS_MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_DIGEST_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CHUNK_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_HASH_FIELD_NUMBER: _ClassVar[int]
    AUTH_TAG_FIELD_NUMBER: _ClassVar[int]
    CHUNK_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHUNK_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_ROOT_FIELD_NUMBER: _ClassVar[int]
    round: int
    param_digest: str
    n_elements: int
    has_momentum: bool
    momentum_digest: str
    inner_steps_total: int
    chunk_elements: int
    manifest_hash: str
    auth_tag: str
    chunk_digests: _containers.RepeatedScalarFieldContainer[bytes]
    state_digest: str
    first_chunk: int
    chunks_root: str
    def __init__(self, round: _Optional[int] = ..., param_digest: _Optional[str] = ..., n_elements: _Optional[int] = ..., has_momentum: _Optional[bool] = ..., momentum_digest: _Optional[str] = ..., inner_steps_total: _Optional[int] = ..., chunk_elements: _Optional[int] = ..., manifest_hash: _Optional[str] = ..., auth_tag: _Optional[str] = ..., chunk_digests: _Optional[_Iterable[bytes]] = ..., state_digest: _Optional[str] = ..., first_chunk: _Optional[int] = ..., chunks_root: _Optional[str] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("header", "part", "chunk_index", "chunk_count", "compressed", "payload")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    COMPRESSED_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    header: StateHeader
    part: StatePart
    chunk_index: int
    chunk_count: int
    compressed: bool
    payload: bytes
    def __init__(self, header: _Optional[_Union[StateHeader, _Mapping]] = ..., part: _Optional[_Union[StatePart, str]] = ..., chunk_index: _Optional[int] = ..., chunk_count: _Optional[int] = ..., compressed: _Optional[bool] = ..., payload: _Optional[bytes] = ...) -> None: ...

class ReachRequest(_message.Message):
    __slots__ = ("node_id", "swarm_id", "timestamp_s", "signature", "address", "callee_id", "nonce")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SWARM_ID_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_S_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CALLEE_ID_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    swarm_id: str
    timestamp_s: int
    signature: bytes
    address: str
    callee_id: str
    nonce: bytes
    def __init__(self, node_id: _Optional[str] = ..., swarm_id: _Optional[str] = ..., timestamp_s: _Optional[int] = ..., signature: _Optional[bytes] = ..., address: _Optional[str] = ..., callee_id: _Optional[str] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class ReachResponse(_message.Message):
    __slots__ = ("reachable", "address", "detail")
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    reachable: bool
    address: str
    detail: str
    def __init__(self, reachable: _Optional[bool] = ..., address: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PeerStatus(_message.Message):
    __slots__ = ("node_id", "address", "last_seen_s", "alive")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_S_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    last_seen_s: float
    alive: bool
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., last_seen_s: _Optional[float] = ..., alive: _Optional[bool] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("node_id", "round", "phase", "peers", "last_round_contributors", "param_digest", "loss", "val_loss", "bytes_sent", "bytes_received", "swarm_id", "advertise", "inner_steps", "agreement", "tokens_per_s", "protocol_version", "last_round_contributor_ids", "state_transfers", "states_served", "utilization", "reachable", "buffered_bytes", "buffered_bytes_bound", "observed_address", "sessions", "bytes_relayed", "control_bytes_sent", "control_bytes_received", "state_digest", "state_download_bytes", "state_download_total_bytes", "state_download_bytes_per_s", "state_download_eta_s", "state_download_donors", "task", "n_params", "task_settings", "data_pass", "data_documents", "local_workers", "rank_tokens_per_s", "rank_param_digests", "codec", "feedback_norm")
    class TaskSettingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    LAST_ROUND_CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    PARAM_DIGEST_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    VAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    SWARM_ID_FIELD_NUMBER: _ClassVar[int]
    ADVERTISE_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_ROUND_CONTRIBUTOR_IDS_FIELD_NUMBER: _ClassVar[int]
    STATE_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    STATES_SERVED_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_BYTES_BOUND_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_RELAYED_FIELD_NUMBER: _ClassVar[int]
    CONTROL_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    CONTROL_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    STATE_DOWNLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_DOWNLOAD_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_DOWNLOAD_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    STATE_DOWNLOAD_ETA_S_FIELD_NUMBER: _ClassVar[int]
    STATE_DOWNLOAD_DONORS_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    N_PARAMS_FIELD_NUMBER: _ClassVar[int]
    TASK_SETTINGS_FIELD_NUMBER: _ClassVar[int]
    DATA_PASS_FIELD_NUMBER: _ClassVar[int]
    DATA_DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WORKERS_FIELD_NUMBER: _ClassVar[int]
    RANK_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    RANK_PARAM_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    FEEDBACK_NORM_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    round: int
    phase: str
    peers: _containers.RepeatedCompositeFieldContainer[PeerStatus]
    last_round_contributors: int
    param_digest: str
    loss: float
    val_loss: float
    bytes_sent: int
    bytes_received: int
    swarm_id: str
    advertise: str
    inner_steps: int
    agreement: str
    tokens_per_s: float
    protocol_version: int
    last_round_contributor_ids: _containers.RepeatedScalarFieldContainer[str]
    state_transfers: int
    states_served: int
    utilization: float
    reachable: str
    buffered_bytes: int
    buffered_bytes_bound: int
    observed_address: str
    sessions: _containers.RepeatedScalarFieldContainer[str]
    bytes_relayed: int
    control_bytes_sent: int
    control_bytes_received: int
    state_digest: str
    state_download_bytes: int
    state_download_total_bytes: int
    state_download_bytes_per_s: float
    state_download_eta_s: float
    state_download_donors: int
    task: str
    n_params: int
    task_settings: _containers.ScalarMap[str, str]
    data_pass: int
    data_documents: int
    local_workers: int
    rank_tokens_per_s: _containers.RepeatedScalarFieldContainer[float]
    rank_param_digests: _containers.RepeatedScalarFieldContainer[str]
    codec: str
    feedback_norm: float
    def __init__(self, node_id: _Optional[str] = ..., round: _Optional[int] = ..., phase: _Optional[str] = ..., peers: _Optional[_Iterable[_Union[PeerStatus, _Mapping]]] = ..., last_round_contributors: _Optional[int] = ..., param_digest: _Optional[str] = ..., loss: _Optional[float] = ..., val_loss: _Optional[float] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., swarm_id: _Optional[str] = ..., advertise: _Optional[str] = ..., inner_steps: _Optional[int] = ..., agreement: _Optional[str] = ..., tokens_per_s: _Optional[float] = ..., protocol_version: _Optional[int] = ..., last_round_contributor_ids: _Optional[_Iterable[str]] = ..., state_transfers: _Optional[int] = ..., states_served: _Optional[int] = ..., utilization: _Optional[float] = ..., reachable: _Optional[str] = ..., buffered_bytes: _Optional[int] = ..., buffered_bytes_bound: _Optional[int] = ..., observed_address: _Optional[str] = ..., sessions: _Optional[_Iterable[str]] = ..., bytes_relayed: _Optional[int] = ..., control_bytes_sent: _Optional[int] = ..., control_bytes_received: _Optional[int] = ..., state_digest: _Optional[str] = ..., state_download_bytes: _Optional[int] = ..., state_download_total_bytes: _Optional[int] = ..., state_download_bytes_per_s: _Optional[float] = ..., state_download_eta_s: _Optional[float] = ..., state_download_donors: _Optional[int] = ..., task: _Optional[str] = ..., n_params: _Optional[int] = ..., task_settings: _Optional[_Mapping[str, str]] = ..., data_pass: _Optional[int] = ..., data_documents: _Optional[int] = ..., local_workers: _Optional[int] = ..., rank_tokens_per_s: _Optional[_Iterable[float]] = ..., rank_param_digests: _Optional[_Iterable[str]] = ..., codec: _Optional[str] = ..., feedback_norm: _Optional[float] = ...) -> None: ...
