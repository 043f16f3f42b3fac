"""ContributionChunk framing without protobuf payload copies (neuronode.swarm.wire): the bytes
are a ContributionChunk's, and ChunkView reads any ContributionChunk exactly as protobuf does."""

from __future__ import annotations

import time

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from neuronode.swarm.streams.chunks import ChunkView, serialize_chunk
from neuronode.v1 import node_pb2 as pb

TEXT = st.characters(exclude_categories=("Cs",))  # protobuf strings are UTF-8: no lone surrogates
HEADERS = st.builds(
    pb.ContributionChunk,
    round_id=st.integers(0, 2**64 - 1),
    total_elements=st.integers(0, 2**64 - 1),
    contributors=st.lists(st.text(TEXT, max_size=8), max_size=4),
    sender_id=st.text(TEXT, max_size=20),
    chunk_index=st.integers(0, 2**32 - 1),
    chunk_count=st.integers(0, 2**32 - 1),
    codec=st.sampled_from(list(pb.Codec.values())),
    compressed=st.booleans(),
    contribution_digest=st.text(TEXT, max_size=64),
    weight=st.floats(allow_nan=False),
    members=st.lists(st.text(TEXT, max_size=8), max_size=4),
    auth_tag=st.text(TEXT, max_size=32),
    phase=st.sampled_from(list(pb.Phase.values())),
)


def split(message: pb.ContributionChunk) -> tuple[pb.ContributionChunk, bytes]:
    header = pb.ContributionChunk()
    header.CopyFrom(message)
    header.ClearField("payload")
    return header, message.payload


def same_as_protobuf(data: bytes) -> None:
    """ChunkView.parse(data) gives protobuf's header and payload, or both refuse."""
    try:
        message = pb.ContributionChunk.FromString(data)
    except DecodeError:
        with pytest.raises((DecodeError, ValueError)):
            ChunkView.parse(data)
        return
    view = ChunkView.parse(data)
    header, payload = split(message)
    assert view.header == header
    assert bytes(view.payload) == payload
    assert view.ByteSize() == len(data)


@given(HEADERS, st.binary(max_size=5000))
def test_serialized_chunk_is_the_protobuf_message(header: pb.ContributionChunk, payload: bytes) -> None:
    data = serialize_chunk(header, payload)
    message = pb.ContributionChunk.FromString(data)
    assert split(message) == (header, payload)
    same_as_protobuf(data)


@given(HEADERS, st.binary(max_size=300), st.binary(max_size=300))
def test_view_reads_protobufs_own_serialization_and_repeated_payloads(
    header: pb.ContributionChunk, first: bytes, second: bytes,
) -> None:
    """Payload anywhere in the message, and twice (the last occurrence counts)."""
    full = pb.ContributionChunk(payload=first)
    full.MergeFrom(header)
    same_as_protobuf(full.SerializeToString())
    same_as_protobuf(serialize_chunk(header, first) + pb.ContributionChunk(payload=second).SerializeToString())
    same_as_protobuf(pb.ContributionChunk(payload=second).SerializeToString() + serialize_chunk(header, first))


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_garbage_is_refused_as_protobuf_refuses_it(data: bytes) -> None:
    try:
        same_as_protobuf(data)
    except ValueError as exc:
        # Stricter than protobuf in one place: groups (wire types 3 and 4), which upb keeps as
        # unknown fields and no neuronode message has.
        assert "wire type" in str(exc), exc


@pytest.mark.parametrize("data", [
    b"\x3a\x05ab",  # payload longer than the message
    b"\x08",  # truncated varint
    b"\x08" + b"\xff" * 11,  # overlong varint
    b"\x00\x01",  # field number 0
])
def test_malformed_messages_are_refused(data: bytes) -> None:
    with pytest.raises((DecodeError, ValueError)):
        ChunkView.parse(data)


def test_payload_is_a_read_only_view_not_a_copy() -> None:
    payload = bytes(range(256)) * 8
    data = serialize_chunk(pb.ContributionChunk(round_id=1, sender_id="a"), payload)
    view = ChunkView.parse(data)
    assert isinstance(view.payload, memoryview) and view.payload.readonly
    assert view.payload.obj is data  # no copy: a view into the received bytes
    assert view.round_id == 1 and view.sender_id == "a"  # header fields read as on the message
    assert view.ByteSize() == len(data)


def test_a_message_of_many_tiny_fields_is_left_to_protobuf() -> None:
    """Millions of one-byte fields would hold the event loop for seconds in a Python walk; past
    MAX_FIELDS_WALKED the C parser takes over, with the same result."""
    payload = b"p" * 1000
    # 3,000,000 chunk_index fields: 6 MB, under the message size limit.
    data = serialize_chunk(pb.ContributionChunk(round_id=1), payload) + b"\x18\x05" * 3_000_000
    started = time.perf_counter()
    view = ChunkView.parse(data)
    elapsed = time.perf_counter() - started
    assert view.chunk_index == 5 and view.round_id == 1 and bytes(view.payload) == payload
    assert view.ByteSize() == len(data)
    same_as_protobuf(data)
    # Bounded work, not a timing target: here the Python walk of all fields took 1.4 s, the
    # capped walk and protobuf's parse 0.01 s.
    assert elapsed < 0.5, elapsed
