"""zstd framing, digests and reassembly of one encoded contribution (how it is cut into chunks:
``neuronode.codec.geometry``).

A contribution (one peer's flat pseudo-gradient for one round) travels as ``count`` frames.
Frame ``i`` carries the codec payload of elements ``chunk_ranges(...)[i]``, zstd-compressed
when that makes it smaller.  The *raw payload* of a frame is the uncompressed codec output;
digests and the Assembler work on raw payloads, so they do not depend on the zstd level or on
which frames happened to compress.

A frame's raw length is its payload's length, or a compressed frame's declared content size:
for fixed-size codecs exactly ``Codec.payload_bytes`` of its elements, for the sparse codec
(``exact_size`` False) at most that, the codec checking the rest of the payload's structure.

Optional byte shuffle: before zstd, the bytes of each element are split into planes (all first
bytes, then all second bytes, ...).  It only touches compressed frames; a frame sent raw is the
plain payload.  Sender and receiver must agree on it (it belongs in the contribution header).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np
import torch
import zstandard as zstd

from neuronode.codec.geometry import announced_chunk_bytes, chunk_ranges
from neuronode.codec.quant import CodecError
from neuronode.codec.registry import get_codec
from neuronode.memory import empty_floats

__all__ = [
    "Assembler",
    "ContributionDigest",
    "Frame",
    "contribution_digest",
    "decode_frame",
    "encode_frames",
    "receiving",
    "repack",
    "roundtrip",
]

MAX_ZSTD_LEVEL = 22


@dataclass(frozen=True)
class Frame:
    """One chunk on the wire: ``data`` is zstd output if ``compressed`` else the raw payload."""

    index: int
    count: int
    compressed: bool
    data: bytes
    raw_len: int


def receiving(*, codec: str, n_elems: int, chunk_elements: int, chunk_count: int,
              shuffled: bool) -> Assembler:
    """The Assembler for a received stream whose header announces this geometry; raises
    CodecError naming the field when it is not one a sender of ``n_elems`` could make."""
    chunk_bytes = announced_chunk_bytes(codec=codec, n_elems=n_elems, chunk_elements=chunk_elements,
                                        chunk_count=chunk_count)
    return Assembler(n_elems=n_elems, codec=codec, chunk_bytes=chunk_bytes, shuffle=shuffled)


def _shuffle(raw: bytes, width: int) -> bytes:
    if width == 1:
        return raw
    return np.frombuffer(raw, dtype=np.uint8).reshape(-1, width).T.tobytes()


def _unshuffle(raw: bytes, width: int) -> bytes:
    if width == 1:
        return raw
    if len(raw) % width:
        raise CodecError(f"shuffled payload of {len(raw)} bytes is not a multiple of {width}")
    return np.frombuffer(raw, dtype=np.uint8).reshape(width, -1).T.tobytes()


def _check_level(zstd_level: int) -> None:
    if not 0 <= zstd_level <= MAX_ZSTD_LEVEL:
        raise CodecError(f"zstd_level must be in 0..{MAX_ZSTD_LEVEL} (0 = off), got {zstd_level}")


def encode_frames(
    x: torch.Tensor,
    *,
    codec: str,
    chunk_bytes: int,
    zstd_level: int,
    shuffle: bool = False,
    digest: ContributionDigest | None = None,
    own: Assembler | None = None,
) -> Iterator[Frame]:
    """Quantize and compress ``x`` one chunk at a time, yielding Frames in index order.

    ``zstd_level`` 0 never compresses; otherwise a chunk is sent compressed only if zstd made
    it strictly smaller.  If ``digest`` is given it is fed each raw payload, so the sender has
    the contribution digest when the generator is exhausted; if ``own`` is given it stores each
    raw payload (the sender's decoded form, without decompressing its own frames).  Deterministic for a given
    zstandard build.  Raises CodecError for bad arguments or NaN/Inf in ``x``.
    """
    _check_level(zstd_level)
    c = get_codec(codec)
    if x.dim() != 1:
        raise CodecError(f"expected a 1-D tensor, got shape {tuple(x.shape)}")
    ranges = chunk_ranges(x.numel(), codec, chunk_bytes)
    width = c.shuffle_width if shuffle else 1
    # zstandard compressors are not thread-safe: one per generator, never shared.
    compressor = (
        zstd.ZstdCompressor(level=zstd_level, write_content_size=True) if zstd_level else None
    )
    for index, (start, stop) in enumerate(ranges):
        raw = c.encode(x[start:stop])
        if digest is not None:
            digest.update(raw)
        if own is not None:
            own.add(index, raw, vetted=True)  # encode refuses NaN/Inf input
        data, compressed = raw, False
        if compressor is not None:
            packed = compressor.compress(_shuffle(raw, width))
            if len(packed) < len(raw):
                data, compressed = packed, True
        yield Frame(
            index=index, count=len(ranges), compressed=compressed, data=data, raw_len=len(raw)
        )


def repack(raw: bytes, *, width: int, zstd_level: int) -> tuple[bytes, bool]:
    """A received chunk's raw payload made into wire data again, as ``encode_frames`` makes it
    (byte planes of ``width``, zstd at ``zstd_level`` when that is smaller): what a member that
    holds another's contribution sends on. Returns (data, compressed)."""
    _check_level(zstd_level)
    if zstd_level:
        packed = zstd.ZstdCompressor(level=zstd_level, write_content_size=True).compress(_shuffle(raw, width))
        if len(packed) < len(raw):
            return packed, True
    return raw, False


def immutable(buf: bytes) -> bytes:
    """``buf`` itself when nobody can change it later (bytes, or a read-only view of bytes, such
    as a payload sliced out of a received message without copying), else a bytes copy. (Typed
    ``bytes`` as the payloads around it: type checkers accept a memoryview for bytes.)"""
    if type(buf) is bytes or (isinstance(buf, memoryview) and type(buf.obj) is bytes
                              and buf.c_contiguous and buf.format == "B"):
        return buf
    return bytes(buf)


def decode_frame(
    frame_data: bytes, compressed: bool, *, expected_raw_len: int, shuffle_width: int = 1, exact: bool = True
) -> bytes:
    """Return the raw payload of a frame, allocating at most ``expected_raw_len`` bytes.

    A compressed frame must declare its content size in the zstd header, that size must equal
    ``expected_raw_len`` (with ``exact`` False: be at most that, a codec whose payload sizes
    vary), and the frame must be shorter than that (the sender only compresses when it helps).
    So a decompression bomb is rejected from its header, before any output is allocated.
    Raises CodecError on any mismatch or corrupt data.
    """
    def wrong(length: int) -> bool:
        return length != expected_raw_len if exact else length > expected_raw_len

    bound = f"{'' if exact else 'at most '}{expected_raw_len}"
    if not compressed:
        if wrong(len(frame_data)):
            raise CodecError(f"raw frame is {len(frame_data)} bytes, expected {bound}")
        return immutable(frame_data)
    if len(frame_data) >= expected_raw_len:
        raise CodecError(f"compressed frame of {len(frame_data)} bytes is not smaller than its "
                         f"{expected_raw_len}-byte payload")
    try:
        declared = zstd.frame_content_size(frame_data)
    except zstd.ZstdError as e:
        raise CodecError(f"bad zstd frame header: {e}") from None
    if declared < 0 or wrong(declared):  # -1: size not in the header
        raise CodecError(f"zstd frame declares {declared} bytes of content, expected {bound}")
    if len(frame_data) >= declared:  # a codec whose sizes vary: its payload may be shorter
        raise CodecError(
            f"compressed frame of {len(frame_data)} bytes is not smaller than its "
            f"{declared}-byte payload"
        )
    try:
        # Content size is known, so the output buffer is exactly `declared` bytes; zstd
        # fails rather than write past it.  Trailing bytes after the frame are malformed.
        raw = zstd.ZstdDecompressor().decompress(
            frame_data, max_output_size=declared, allow_extra_data=False
        )
    except zstd.ZstdError as e:
        raise CodecError(f"corrupt zstd frame: {e}") from None
    if len(raw) != declared:
        raise CodecError(f"frame decompressed to {len(raw)} bytes, expected {declared}")
    return _unshuffle(raw, shuffle_width)


class ContributionDigest:
    """BLAKE3 over a contribution's raw payloads, fed in chunk index order. A node hashes every
    byte it sends and receives; BLAKE3 does that about 4x faster than sha256 (docs/protocol.md)."""

    def __init__(self, *, sha256: bool = False) -> None:
        # sha256 for state transfer, whose parameters must match the published param_digest
        self._h: Any = hashlib.sha256() if sha256 else blake3.blake3()

    def update(self, raw_payload: bytes) -> None:
        """Feed the next chunk's raw (uncompressed, still quantized) payload."""
        self._h.update(raw_payload if isinstance(raw_payload, bytes) else memoryview(raw_payload).cast("B"))

    def hexdigest(self) -> str:
        """Hex digest (32 bytes) of everything fed so far (the object stays usable)."""
        return self._h.hexdigest()


def contribution_digest(x: torch.Tensor, *, codec: str, chunk_bytes: int) -> str:
    """Digest of ``x`` as ``encode_frames`` would send it, without compressing anything."""
    d = ContributionDigest()
    for _ in encode_frames(x, codec=codec, chunk_bytes=chunk_bytes, zstd_level=0, digest=d):
        pass
    return d.hexdigest()


class Assembler:
    """Collects the raw payloads of one contribution, in any order, and decodes them.

    Holds payloads still quantized (P x bytes-per-param of the codec), not float32.
    """

    def __init__(
        self, *, n_elems: int, codec: str, chunk_bytes: int, shuffle: bool = False
    ) -> None:
        self._codec = get_codec(codec)
        self._ranges = chunk_ranges(n_elems, codec, chunk_bytes)
        self._raw_lens = [self._codec.payload_bytes(b - a) for a, b in self._ranges]
        self._width = self._codec.shuffle_width if shuffle else 1
        self._varies = not self._codec.exact_size  # raw lens are bounds, not exact sizes
        self._n_elems = n_elems
        self._chunks: dict[int, bytes] = {}
        self._held_bytes = 0
        self._unvetted = 0  # chunks added without a finiteness check (decode checks them)

    @property
    def count(self) -> int:
        """Number of chunks in the contribution."""
        return len(self._ranges)

    @property
    def complete(self) -> bool:
        """True once every chunk has arrived."""
        return len(self._chunks) == self.count

    @property
    def size_bytes(self) -> int:
        """Bytes of payload once complete (at most that, for a codec whose sizes vary)."""
        return sum(self._raw_lens)

    @property
    def held_bytes(self) -> int:
        """Bytes of payload held so far (for memory accounting)."""
        return self._held_bytes

    def missing(self) -> list[int]:
        """Indices not yet received, ascending."""
        return [i for i in range(self.count) if i not in self._chunks]

    def chunk_elems(self, index: int) -> int:
        """Number of elements chunk ``index`` decodes to."""
        self._check_index(index)
        start, stop = self._ranges[index]
        return stop - start

    @property
    def n_elems(self) -> int:
        return self._n_elems

    def expected_raw_len(self, index: int) -> int:
        """Raw payload length of chunk ``index`` (its bound, for a codec whose sizes vary);
        raises CodecError if out of range."""
        self._check_index(index)
        return self._raw_lens[index]

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.count:
            raise CodecError(f"chunk index {index} out of range for {self.count} chunks")

    def add(self, index: int, raw_payload: bytes, *, vetted: bool = False) -> None:
        """Store chunk ``index``; rejects out-of-range, duplicate and wrong-length chunks.
        ``vetted``: the caller checked the payload (``Codec.check_payload``, or encoded it from
        finite values), so decoding may skip the finiteness check."""
        self._check_index(index)
        if index in self._chunks:
            raise CodecError(f"duplicate chunk {index} of {self.count}")
        expected = self._raw_lens[index]
        if len(raw_payload) > expected if self._varies else len(raw_payload) != expected:
            raise CodecError(f"chunk {index} has {len(raw_payload)} bytes, expected "
                             f"{'at most ' if self._varies else ''}{expected}")
        self._chunks[index] = immutable(raw_payload)
        self._held_bytes += len(raw_payload)
        self._unvetted += not vetted

    def add_frame(self, frame: Frame) -> None:
        """Check a received Frame against this contribution, decompress (bounded) and add it."""
        if frame.count != self.count:
            raise CodecError(f"frame says {frame.count} chunks, contribution has {self.count}")
        expected = self.expected_raw_len(frame.index)
        if frame.raw_len > expected if self._varies else frame.raw_len != expected:
            raise CodecError(
                f"frame {frame.index} says raw_len {frame.raw_len}, expected {expected}"
            )
        if frame.index in self._chunks:  # before decompressing: a duplicate costs no CPU
            raise CodecError(f"duplicate chunk {frame.index} of {self.count}")
        raw = decode_frame(frame.data, frame.compressed, expected_raw_len=expected, shuffle_width=self._width,
                           exact=not self._varies)
        self.add(frame.index, raw)

    def take(self, index: int, payload: bytes, *, compressed: bool,
             digest: ContributionDigest) -> None:
        """A received chunk: bounded decompression, then a payload check that refuses what would
        decode to NaN/Inf before anything is stored (bad values never reach an average), then
        the digest. Chunks of one stream come one at a time, so the digest sees them in order."""
        expected = self.expected_raw_len(index)
        raw = decode_frame(payload, compressed, expected_raw_len=expected, shuffle_width=self._width,
                           exact=not self._varies)
        self._codec.check_payload(raw, self.chunk_elems(index))
        digest.update(raw)
        self.add(index, raw, vetted=True)

    def raw(self, index: int) -> bytes:
        """The raw payload of chunk ``index`` (what a holder serves on, uncompressed)."""
        self._check_index(index)
        return self._chunks[index]

    def _require_complete(self) -> None:
        if not self.complete:
            missing = self.missing()
            raise CodecError(
                f"contribution incomplete: {len(missing)} chunks missing, first {missing[0]}"
            )

    def digest(self) -> str:
        """ContributionDigest hex of the payloads in index order; requires ``complete``."""
        self._require_complete()
        d = ContributionDigest()
        for i in range(self.count):
            d.update(self._chunks[i])
        return d.hexdigest()

    def decode(self) -> torch.Tensor:
        """The contribution as one float32 vector; raises CodecError if incomplete or non-finite."""
        out = empty_floats(self._n_elems)
        self.decode_into(out)
        return out

    def __call__(self) -> torch.Tensor:
        """``decode()``: an Assembler is a lazy contribution for ``neuronode.diloco.aggregate``."""
        return self.decode()

    def add_into(self, acc: torch.Tensor, alpha: float) -> None:
        """``acc.add_(decode(), alpha=alpha)`` chunk by chunk, without building the decoded
        vector (element-wise, so bit-identical to the whole-vector add)."""
        self._require_complete()
        if acc.shape != (self._n_elems,) or acc.dtype != torch.float32:
            raise CodecError(f"add_into needs a float32 vector of {self._n_elems} elements")
        vetted = self._unvetted == 0
        for i, (start, stop) in enumerate(self._ranges):
            self._codec.add_into(self._chunks[i], stop - start, acc[start:stop], alpha, vetted=vetted)

    def decode_into(self, out: torch.Tensor) -> None:
        """``out[:] = decode()`` for a contiguous float32 CPU ``out``, without an extra copy."""
        self._require_complete()
        if out.shape != (self._n_elems,) or out.dtype != torch.float32 or not out.is_contiguous():
            raise CodecError(f"decode_into needs a contiguous float32 vector of {self._n_elems} elements")
        vetted = self._unvetted == 0
        for i, (start, stop) in enumerate(self._ranges):
            self._codec.decode_into(self._chunks[i], stop - start, out[start:stop], vetted=vetted)


def roundtrip(x: torch.Tensor, codec: str, *, chunk_elems: int = 1 << 20) -> torch.Tensor:
    """What a receiver decodes from ``x``: encode then decode, chunk by chunk.

    Decoded values do not depend on chunking (chunks are block-aligned), so this equals
    ``Assembler.decode()`` for any ``chunk_bytes``.  A node averages this form of its own
    contribution so that replicas stay identical under lossy codecs.
    """
    c = get_codec(codec)
    if x.dim() != 1:
        raise CodecError(f"expected a 1-D tensor, got shape {tuple(x.shape)}")
    step = max(c.block_elems, chunk_elems - chunk_elems % c.block_elems)
    out = empty_floats(x.numel())
    for start in range(0, x.numel(), step):
        stop = min(start + step, x.numel())
        out[start:stop] = c.decode(c.encode(x[start:stop]), stop - start)
    return out
