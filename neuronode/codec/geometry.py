"""How a contribution is cut: chunk and shard ranges, and the payload bytes each chunk holds.

Pure arithmetic on element counts and a codec's block size (no payload passes through here):
the sender cuts its vector with these, and a receiver bounds every frame it accepts by them
before it decompresses anything (``neuronode.codec.framing``). Chunk boundaries are multiples
of the codec's block, so a chunk's payload is itself a valid payload of its elements.
"""

from __future__ import annotations

from neuronode.codec.quant import CodecError
from neuronode.codec.registry import get_codec

__all__ = [
    "MAX_CHUNK_PAYLOAD",
    "announced_chunk_bytes",
    "chunk_elements",
    "chunk_ranges",
    "expected_raw_lens",
    "shard_ranges",
    "shuffle_width",
]

MAX_CHUNK_PAYLOAD = 4 << 20  # bytes of raw payload in one chunk, at most (--chunk-bytes' bound)


def chunk_ranges(n_elems: int, codec: str, chunk_bytes: int) -> list[tuple[int, int]]:
    """Element ranges ``[start, stop)`` covering ``n_elems``, block-aligned, each at most
    ``chunk_bytes`` of payload.  All chunks but the last have the same length."""
    if n_elems < 0:
        raise CodecError(f"n_elems must be >= 0, got {n_elems}")
    c = get_codec(codec)
    block_bytes = c.payload_bytes(c.block_elems)
    blocks_per_chunk = chunk_bytes // block_bytes
    if blocks_per_chunk < 1:
        raise CodecError(
            f"chunk_bytes={chunk_bytes} is below one {codec} block ({block_bytes} bytes); raise it"
        )
    # payload_bytes is monotone in n, so a partial last chunk is no larger than a full one.
    step = blocks_per_chunk * c.block_elems
    return [(start, min(start + step, n_elems)) for start in range(0, n_elems, step)]


def shard_ranges(n_elems: int, n_shards: int, codec: str) -> list[tuple[int, int]]:
    """Split ``n_elems`` into ``n_shards`` contiguous, block-aligned, near-equal ranges
    (reduce-scatter: member i reduces shard i). Deterministic: every member computes the same."""
    if n_shards < 1:
        raise CodecError(f"n_shards must be >= 1, got {n_shards}")
    block = get_codec(codec).block_elems
    blocks = -(-n_elems // block)
    bounds = [min(n_elems, (blocks * i // n_shards) * block) for i in range(n_shards + 1)]
    bounds[-1] = n_elems
    return [(bounds[i], bounds[i + 1]) for i in range(n_shards)]


def chunk_elements(codec: str, chunk_bytes: int) -> int:
    """Elements per chunk (all but the last) when chunks hold at most ``chunk_bytes`` of payload."""
    c = get_codec(codec)
    return (chunk_bytes // c.payload_bytes(c.block_elems)) * c.block_elems


def announced_chunk_bytes(*, codec: str, n_elems: int, chunk_elements: int, chunk_count: int) -> int:
    """The ``chunk_bytes`` of a stream whose header announces this geometry; raises CodecError
    naming the field when it is not one a sender of ``n_elems`` could make."""
    c = get_codec(codec)
    if chunk_elements <= 0 or chunk_elements % c.block_elems or c.payload_bytes(chunk_elements) > MAX_CHUNK_PAYLOAD:
        raise CodecError(f"chunk_elements {chunk_elements} is not a positive multiple of "
                         f"{c.block_elems} within {MAX_CHUNK_PAYLOAD} bytes")
    chunk_bytes = c.payload_bytes(chunk_elements)
    count = len(chunk_ranges(n_elems, codec, chunk_bytes))
    if chunk_count != count:
        raise CodecError(f"chunk_count {chunk_count} does not match {count} chunks of "
                         f"{chunk_elements} elements")
    return chunk_bytes


def expected_raw_lens(n_elems: int, codec: str, chunk_bytes: int) -> list[int]:
    """Raw payload length of each chunk; receivers use it to bound every frame."""
    c = get_codec(codec)
    return [c.payload_bytes(b - a) for a, b in chunk_ranges(n_elems, codec, chunk_bytes)]


def shuffle_width(codec: str, shuffle: bool) -> int:
    """Byte-plane width for ``decode_frame``: element size if shuffling, else 1 (no-op)."""
    return get_codec(codec).shuffle_width if shuffle else 1
