"""What a contribution stream's header says, read by itself (who may say it is checked in
neuronode.swarm.streams.inbound): the fields every chunk of one stream repeats unchanged, the
statement a header makes (what its maker signs, neuronode.averaging.agreement) and what its tag
binds, and the payload it announces: the whole model, one reduce-scatter shard (by its members
and its role, as this swarm's --averaging has it), or an averaged update (the whole model in
fp32). Every function takes a header's fields, never its payload."""

from __future__ import annotations

import json
from typing import Any

from neuronode.averaging.agreement import Statement, body_hash, lineage_hash
from neuronode.codec import Phase, shard_ranges
from neuronode.swarm.wire import MAX_PEERS_LISTED, PB_TO_CODEC, Refusal

STREAM_FIELDS = ("round_id", "sender_id", "chunk_count", "codec", "contribution_digest", "weight",
                 "total_elements", "chunk_elements", "swarm_id", "auth_tag", "shuffled", "base_digest",
                 "phase", "shard_index", "shard_count", "members", "contributors", "signature", "sender_host")


def stream_key(header: Any) -> tuple[Any, ...]:
    """The header fields every chunk of one stream must repeat unchanged."""
    return tuple(getattr(header, name) for name in STREAM_FIELDS)


def check_same_stream(first: tuple[Any, ...], header: Any) -> None:
    """Header fields may not change within one stream (`first`: the first chunk's stream_key)."""
    key = stream_key(header)
    if key != first:
        name = next(n for n, a, b in zip(STREAM_FIELDS, first, key, strict=True) if a != b)
        raise Refusal("INVALID_ARGUMENT", f"{name} changed within one contribution stream")


def bound_digest(digest: str, base_digest: str, phase: int, shard_index: int,
                 members: Any, contributors: Any) -> str:
    """Everything a contribution's tag must bind besides round, sender, codec, weight and size:
    its payload digest, the parameters it started from and its reduce-scatter role."""
    return json.dumps([digest, base_digest, int(phase), int(shard_index), list(members), list(contributors)])


def header_statement(chunk: Any, *, signature: bytes | None = None) -> Statement:
    """The statement a chunk header makes (neuronode.averaging.agreement), with its signature."""
    return Statement(round_id=chunk.round_id, sender=chunk.sender_id, phase=Phase(chunk.phase),
                     shard_index=chunk.shard_index, lineage=lineage_hash(chunk.base_digest, chunk.members),
                     body=body_hash(digest=chunk.contribution_digest, codec=PB_TO_CODEC.get(chunk.codec, "?"),
                                    weight=chunk.weight, n_elements=chunk.total_elements,
                                    contributors=chunk.contributors, host=chunk.sender_host),
                     signature=chunk.signature if signature is None else signature)


def payload_elements(chunk: Any, codec: str, *, averaging: str, n_elements: int, node_id: str) -> int:
    """Elements a stream carries: the model (`n_elements`), or one reduce-scatter shard of it
    (a slice this node, `node_id`, reduces, or an averaged shard its sender reduced)."""
    whole = averaging in ("all-to-all", "gather")  # a phase the swarm does not use would stay buffered
    if chunk.phase in (Phase.WHOLE, Phase.SHARD, Phase.AVERAGED) and (chunk.phase == Phase.WHOLE) != whole:
        raise Refusal("INVALID_ARGUMENT", f"this swarm averages {averaging} (--averaging): " + (
            "whole contributions only" if whole else "slices and averaged shards only"))
    if chunk.phase == Phase.WHOLE:
        if chunk.members or chunk.shard_count or chunk.contributors:
            raise Refusal("INVALID_ARGUMENT", "a whole contribution names no shard and no contributors")
        return n_elements
    if chunk.phase not in (Phase.SHARD, Phase.AVERAGED):
        raise Refusal("INVALID_ARGUMENT", f"unknown phase {chunk.phase}")
    members = list(chunk.members)
    if not 0 < len(members) <= MAX_PEERS_LISTED or members != sorted(set(members)) \
            or chunk.shard_count != len(members) or chunk.shard_index >= len(members):
        raise Refusal("INVALID_ARGUMENT", "members must be sorted unique node ids, one shard each")
    reducer = members[chunk.shard_index]
    if chunk.phase == Phase.SHARD and reducer != node_id:
        raise Refusal("INVALID_ARGUMENT", f"shard {chunk.shard_index} is reduced by {reducer}, not here")
    if chunk.phase == Phase.AVERAGED and reducer != chunk.sender_id:
        raise Refusal("INVALID_ARGUMENT", f"shard {chunk.shard_index} is reduced by {reducer}, not the sender")
    contributors = list(chunk.contributors)
    if chunk.phase == Phase.SHARD and contributors:
        raise Refusal("INVALID_ARGUMENT", "a slice names no contributors (an averaged shard does)")
    if len(contributors) > MAX_PEERS_LISTED or contributors != sorted(set(contributors)):
        raise Refusal("INVALID_ARGUMENT", f"contributors must be sorted unique node ids, at most {MAX_PEERS_LISTED}")
    start, stop = shard_ranges(n_elements, len(members), codec)[chunk.shard_index]
    return stop - start


def check_update(chunk: Any, n_elements: int) -> None:
    """An averaged update a holder serves is the whole model (`n_elements`) in fp32, of positive
    weight, naming no shard, and at most MAX_PEERS_LISTED sorted unique contributors."""
    contributors = list(chunk.contributors)
    if PB_TO_CODEC.get(chunk.codec) != "fp32" or chunk.total_elements != n_elements \
            or chunk.members or chunk.shard_count or not 0 < chunk.weight \
            or len(contributors) > MAX_PEERS_LISTED or contributors != sorted(set(contributors)):
        raise Refusal("INVALID_ARGUMENT", "an averaged update is the whole model in fp32, of positive weight, "
                      f"naming no shard, and at most {MAX_PEERS_LISTED} sorted unique contributors")
