"""The sparse codec: per block, the k largest magnitudes, b-bit values and Rice-coded indices.

Per block of ``block`` elements (``--sparse-block``) it keeps the ``k`` (``--sparse-k``)
largest-magnitude entries (all of a block shorter than k), each as a ``bits``-bit value
(``--sparse-bits``: a sign bit and a magnitude code c in [0, L), L = 2^(bits-1)) against one
float32 scale per block: s = max|x| / 2L, and an entry decodes to ±(2c + 1)·s, the middle of
its bin of width max|x| / L, so no kept value is off by more than max|x| / 2L. Everything not
kept decodes to 0; error feedback (``neuronode.codec.feedback``) carries it to the next round.

Indices are coded as gaps: within a block the kept indices i_0 < i_1 < ... are sent as
g_j = i_j - i_(j-1) - 1 (i_(-1) = -1), each g split into q = g >> r, sent in unary, and its r
low bits, sent as they are (Rice coding with parameter r = floor(log2((block - k) // k)), 5 for
64 of 4096, about 7.5 bits a gap). A gap is never negative, so the code cannot express a
repeated or decreasing index.

A payload of n elements (a chunk: chunks cut at block boundaries) is three sections, each
padded to whole bytes with zero bits:

    [scale of every block, float32 LE][fields: (g & (2^r - 1)) << bits | value, bits + r each]
    [unary: q zero bits then a one, per entry]

Entries run block after block, indices ascending within a block, in both bit sections (bits
little-endian within each byte, numpy's ``bitorder="little"``). The first two sections have a
length fixed by n; the unary one varies with the gaps, from K to K + Q bits (K entries; Q, the
most all q can sum to, is sum over blocks of (len - kept) >> r, since a block's gaps sum to at
most its length minus what it keeps). So a payload's size is not fixed: ``payload_bytes(n)`` is
the most it may take (84 bytes a block, 0.0205 bytes per parameter at the defaults, typically 0.0195), and the
payload carries its own length (the frame's, or a compressed frame's declared content size,
bounded by that: ``neuronode.codec.framing``). There is one valid encoding per kept set and
value: a decoder refuses a payload shorter or longer than its sections, a scale that is not a
finite number >= 0, set padding bits, a unary section with fewer or more terminators than
entries or whole bytes after the last one, and an index past its block's end.
"""

from __future__ import annotations

import numpy as np
import torch

from neuronode.codec.quant import NOT_FINITE, Codec, CodecError, all_finite, check_input
from neuronode.memory import empty_floats

__all__ = ["BITS", "DEFAULT_BITS", "DEFAULT_BLOCK", "DEFAULT_DECAY", "DEFAULT_K", "SparseCodec",
           "rice_parameter", "sparse_spec"]

NAME = "sparse"
BITS = (2, 4, 8)
DEFAULT_K, DEFAULT_BITS, DEFAULT_BLOCK, DEFAULT_DECAY = 64, 2, 4096, 0.95
# Bounds that keep one block's payload within the smallest --chunk-bytes (4096): at most
# about 2.1 kB (k = 1024, 8 bits, block 65536).
MIN_BLOCK, MAX_BLOCK, MAX_K = 64, 65536, 1024
SLAB_ELEMENTS = 1 << 18  # the encoder selects in slabs of blocks of about 1 MB, kept in the cache
MOST_GROUPED = 16  # elements per group of the encoder's prefilter, at most


def sparse_spec(k: int = DEFAULT_K, bits: int = DEFAULT_BITS, block: int = DEFAULT_BLOCK) -> str:
    """The codec name `get_codec` takes for these parameters ("sparse" for the defaults)."""
    if (k, bits, block) == (DEFAULT_K, DEFAULT_BITS, DEFAULT_BLOCK):
        return NAME
    return f"{NAME}:k={k},bits={bits},block={block}"


def parse_spec(spec: str) -> tuple[int, int, int]:
    """(k, bits, block) of a `sparse_spec` name; CodecError when it is not one."""
    name, _, options = spec.partition(":")
    values = {"k": DEFAULT_K, "bits": DEFAULT_BITS, "block": DEFAULT_BLOCK}
    if name != NAME:
        raise CodecError(f"{spec!r} is not a sparse codec")
    for option in filter(None, options.split(",")):
        key, _, value = option.partition("=")
        if key not in values or not value.isdigit():
            raise CodecError(f"{spec!r}: options are k=, bits= and block= with whole numbers")
        values[key] = int(value)
    return values["k"], values["bits"], values["block"]


def check_parameters(k: int, bits: int, block: int) -> None:
    """Raise CodecError naming the flag whose value is out of range."""
    if bits not in BITS:
        raise CodecError(f"--sparse-bits {bits}: choose one of {', '.join(map(str, BITS))}")
    if not MIN_BLOCK <= block <= MAX_BLOCK:
        raise CodecError(f"--sparse-block {block}: must be between {MIN_BLOCK} and {MAX_BLOCK}")
    if not 1 <= k <= min(block, MAX_K):
        raise CodecError(f"--sparse-k {k}: must be between 1 and {min(block, MAX_K)} (and at most --sparse-block)")


def rice_parameter(block: int, k: int) -> int:
    """r = floor(log2(mean gap)), the mean gap being (block - k) // k; integers only, so every
    node computes the same r."""
    return max(0, ((block - k) // k).bit_length() - 1)


def group_size(length: int, keep: int) -> int:
    """Elements per group when the encoder prefilters a block of `length` for its `keep`
    largest: a power of two from 2 to MOST_GROUPED that leaves at least 4 * keep groups and
    divides the block; 0 for none (the block is selected without the prefilter)."""
    size = MOST_GROUPED
    while size >= 2 and (length // size < 4 * keep or length % size):
        size //= 2
    return size if size >= 2 else 0


def _field_bytes(width: int) -> int:
    """Bytes of the smallest unsigned integer holding `width` bits (1, 2 or 4)."""
    return 1 if width <= 8 else 2 if width <= 16 else 4


def pack_fields(values: np.ndarray, width: int) -> bytes:
    """`values` (non-negative, below 2^width) as `width`-bit fields, little-endian bit order,
    zero-padded to whole bytes."""
    size = _field_bytes(width)
    octets = values.astype(f"<u{size}").view(np.uint8).reshape(-1, size)
    bits = np.unpackbits(octets, axis=1, bitorder="little")  # (K, 8 * size): each value's bits, lowest first
    return np.packbits(bits[:, :width], bitorder="little").tobytes()


def unpack_fields(buf: bytes | memoryview, count: int, width: int) -> np.ndarray:
    """The inverse of `pack_fields` (int64); CodecError when a padding bit is set."""
    bits = np.unpackbits(np.frombuffer(buf, dtype=np.uint8), bitorder="little")
    if bits[count * width:].any():
        raise CodecError("sparse payload: trailing bits set after the value fields")
    size = _field_bytes(width)
    padded = np.zeros((count, 8 * size), dtype=np.uint8)
    padded[:, :width] = bits[:count * width].reshape(count, width)
    return np.packbits(padded.reshape(-1), bitorder="little").view(f"<u{size}").astype(np.int64)


class SparseCodec(Codec):
    """Top-k per block, b-bit values, Rice-coded index gaps (see the module docstring)."""

    name = NAME
    lossy = True
    exact_size = False

    def __init__(self, k: int = DEFAULT_K, bits: int = DEFAULT_BITS, block: int = DEFAULT_BLOCK) -> None:
        check_parameters(k, bits, block)
        self.k, self.bits, self.block_elems = k, bits, block
        self.rice = rice_parameter(block, k)
        self.levels = 1 << (bits - 1)  # magnitude codes per sign
        codes = np.arange(1 << bits)
        self._units = np.where(codes >> (bits - 1), np.float32(-1), np.float32(1)) * (
            2 * (codes & (self.levels - 1)) + 1).astype(np.float32)  # code -> +-(2c + 1), float32

    @property
    def spec(self) -> str:
        return sparse_spec(self.k, self.bits, self.block_elems)

    def __repr__(self) -> str:
        return f"<codec {self.spec}>"

    # ---- geometry ------------------------------------------------------------------------------

    def _blocks(self, n: int) -> tuple[int, int]:
        """(full blocks, length of the short last block or 0) of n elements."""
        if n < 0:
            raise CodecError(f"element count must be >= 0, got {n}")
        return n // self.block_elems, n % self.block_elems

    def entries(self, n: int) -> int:
        """Entries kept of n elements: k per block, all of a block shorter than k."""
        full, tail = self._blocks(n)
        return full * self.k + min(self.k, tail)

    def _sections(self, n: int) -> tuple[int, int, int, int]:
        """(scale bytes, field bytes, fewest unary bytes, most unary bytes) of n elements."""
        full, tail = self._blocks(n)
        count = self.entries(n)
        most_q = full * ((self.block_elems - self.k) >> self.rice) + ((tail - min(self.k, tail)) >> self.rice)
        return (4 * (full + (tail > 0)), -(-count * (self.bits + self.rice) // 8), -(-count // 8),
                -(-(count + most_q) // 8))

    def payload_bytes(self, n: int) -> int:
        """The most n elements may take (the size varies with the kept indices): the sum of
        each block's own bound, so that a chunk's bound is its blocks' (``chunk_ranges``)."""
        full, tail = self._blocks(n)
        return full * self._block_bound(self.block_elems) + (self._block_bound(tail) if tail else 0)

    def _block_bound(self, length: int) -> int:
        kept = min(self.k, length)
        return 4 + -(-kept * (self.bits + self.rice) // 8) + -(-(kept + ((length - kept) >> self.rice)) // 8)

    def min_payload_bytes(self, n: int) -> int:
        scales, fields, unary, _ = self._sections(n)
        return scales + fields + unary

    # ---- encoding ------------------------------------------------------------------------------

    def _select(self, x: np.ndarray, length: int, keep: int) -> tuple[np.ndarray, np.ndarray]:
        """Per block of `length` elements of `x` (whole blocks): the flat positions of the
        `keep` largest magnitudes, ascending (m, keep) int64, and their values (m, keep).

        Done in slabs of blocks that stay in the cache (`_select_slab`); the choice is
        torch.topk's, the first encoder's, so the bytes are its bytes."""
        m = x.size // length
        rows = max(1, SLAB_ELEMENTS // length)
        magnitudes = np.empty((min(rows, m), length), dtype=np.float32)
        marked = np.empty((min(rows, m), length), dtype=bool)
        blocks = x.reshape(m, length)
        found = [self._select_slab(blocks[r0:r0 + rows], keep, magnitudes, marked) + r0 * length
                 for r0 in range(0, m, rows)]
        positions = np.concatenate(found).reshape(m, keep)
        return positions, x[positions]

    @staticmethod
    def _select_slab(xs: np.ndarray, keep: int, magnitudes: np.ndarray, marked: np.ndarray) -> np.ndarray:
        """The positions in `xs` (h, length), ascending, of each row's `keep` largest magnitudes.

        The keep-th largest magnitude of a row comes from numpy's partition (introselect), then a
        comparison marks the entries at or above it: exactly `keep` of them unless magnitudes tie
        there, and such rows take torch.topk's choice among the tied. Where the row is long
        enough, partition first runs on the maxima of its groups (`group_size`): at least `keep`
        entries reach the keep-th largest group maximum t, so the row's `keep` largest are among
        the entries >= t (typically 73 of 4096 for 64), and partition then runs on those only.
        A row where that does not mark exactly `keep` entries is done the plain way."""
        h, length = xs.shape
        mag, mark = magnitudes[:h], marked[:h]
        np.abs(xs, out=mag)
        size = group_size(length, keep)
        if size:
            width = length // size
            group_max = mag.reshape(h, size, width).max(axis=1)  # (h, width): group j holds j, j + width, ...
            if not all_finite(group_max):  # NaN and Inf reach their group's maximum
                raise CodecError(NOT_FINITE)
            group_max.partition(width - keep, axis=1)
            np.greater_equal(mag, group_max[:, width - keep, None], out=mark)
            at = np.flatnonzero(mark)
            row = at // length
            counts = np.bincount(row, minlength=h)
            most = int(counts.max())
            candidates = np.full((h, most), -1.0, dtype=np.float32)
            values = mag.reshape(-1)[at]
            candidates.reshape(-1)[row * most + np.arange(at.size) - (np.cumsum(counts) - counts)[row]] = values
            candidates.partition(most - keep, axis=1)
            chosen = at[values >= candidates[:, most - keep][row]]
            if chosen.size == h * keep:  # each row marks keep or more: so exactly keep, no tie
                return chosen
        elif not all_finite(mag):
            raise CodecError(NOT_FINITE)
        mag.partition(length - keep, axis=1)
        kth = mag[:, length - keep].copy()
        np.abs(xs, out=mag)
        np.greater_equal(mag, kth[:, None], out=mark)
        at = np.flatnonzero(mark)
        if at.size != h * keep:  # a tie at the keep-th magnitude: more are marked
            counts = np.bincount(at // length, minlength=h)
            tied = np.flatnonzero(counts != keep)
            chosen = torch.from_numpy(mag[tied]).topk(keep, dim=1, sorted=False).indices.sort(dim=1).values
            mark[tied] = False
            mark[tied[:, None], chosen.numpy()] = True
            at = np.flatnonzero(mark)
        return at

    def encode(self, x: torch.Tensor) -> bytes:
        x = check_input(x, finite=False)  # _select_slab refuses NaN and Inf in the pass it makes
        n = x.numel()
        if not n:
            return b""
        flat = x.numpy()
        full, tail = self._blocks(n)
        parts = []
        if full:
            parts.append(self._select(flat[:full * self.block_elems], self.block_elems, self.k))
        if tail:
            parts.append(self._select(flat[full * self.block_elems:], tail, min(self.k, tail)))
        scales, fields, q = [], [], []
        for positions, values in parts:
            s, f, g = self._quantize(positions, values)
            scales.append(s)
            fields.append(f)
            q.append(g)
        q_all = np.concatenate(q)
        unary = np.zeros(-(-(q_all.size + int(q_all.sum())) // 8) * 8, dtype=np.uint8)
        unary[np.cumsum(q_all + 1) - 1] = 1  # each entry: q zero bits, then a one
        return b"".join((np.concatenate(scales).astype("<f4").tobytes(),
                         pack_fields(np.concatenate(fields), self.bits + self.rice),
                         np.packbits(unary, bitorder="little").tobytes()))

    def _quantize(self, positions: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(scales (m,) float32, fields (m*keep,) int64, unary lengths q (m*keep,) int64) of the
        kept entries of m blocks: flat positions (m, keep), ascending, and values (m, keep)."""
        magnitudes = np.abs(values)
        scales = magnitudes.max(axis=1) / np.float32(2 * self.levels)  # exact: a power of two (bar subnormals)
        safe = np.where(scales > 0, scales, np.float32(1))
        codes = np.minimum(np.floor(magnitudes / (2 * safe[:, None])), self.levels - 1).astype(np.int64)
        codes |= (values < 0).astype(np.int64) << (self.bits - 1)
        gaps = np.diff(positions, axis=1, prepend=positions[:, :1] - positions[:, :1] % self.block_elems - 1) - 1
        fields = (gaps & ((1 << self.rice) - 1)) << self.bits | codes
        return scales, fields.reshape(-1), (gaps >> self.rice).reshape(-1)

    # ---- decoding ------------------------------------------------------------------------------

    def parse(self, buf: bytes, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The kept entries of a payload of n elements: (positions (K,) int64, ascending, and
        values (K,) float32); CodecError for anything but a payload `encode` could make."""
        scale_bytes, field_bytes, least, most = self._sections(n)
        fixed = scale_bytes + field_bytes
        if not fixed + least <= len(buf) <= fixed + most:
            raise CodecError(f"{self.name}: payload for {n} elements must be {fixed + least} to "
                             f"{fixed + most} bytes, got {len(buf)}")
        if n == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        scales = np.frombuffer(buf, dtype="<f4", count=scale_bytes // 4).astype(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            largest = scales * np.float32(2 * self.levels - 1)  # the largest value a scale decodes to
        if not (all_finite(largest) and bool((scales >= 0).all())):
            raise CodecError(f"{self.name}: a block scale is not a finite number >= 0 (or too large to decode)")
        count = self.entries(n)
        fields = unpack_fields(memoryview(buf)[scale_bytes:fixed], count, self.bits + self.rice)
        unary = np.unpackbits(np.frombuffer(buf, dtype=np.uint8, offset=fixed), bitorder="little")
        ends = np.flatnonzero(unary)
        if ends.size != count:
            raise CodecError(f"{self.name}: index bit stream holds {ends.size} entries, expected {count} "
                             f"({'truncated' if ends.size < count else 'more than k per block'})")
        if ends[-1] // 8 != len(buf) - fixed - 1:
            raise CodecError(f"{self.name}: trailing bytes after the index bit stream")
        gaps = (np.diff(ends, prepend=-1) - 1) << self.rice | fields >> self.bits
        positions = self._positions(gaps, n)
        # A code's value in units of its block's scale, +-(2c + 1): the product with the scale
        # rounds as (2c + 1) * s with the sign after, IEEE multiplication being symmetric.
        full, tail = self._blocks(n)
        per_block = np.full(full + (tail > 0), self.k)
        per_block[full:] = min(self.k, tail)
        return positions, self._units[fields & ((1 << self.bits) - 1)] * np.repeat(scales, per_block)

    def _positions(self, gaps: np.ndarray, n: int) -> np.ndarray:
        """Flat positions of the entries whose in-block gaps are `gaps`; CodecError when an
        index falls past its block's end."""
        full, tail = self._blocks(n)
        keep = [(full, self.k, self.block_elems)] + ([(1, min(self.k, tail), tail)] if tail else [])
        out, at, base = [], 0, 0
        for blocks, kept, length in keep:
            if not blocks:
                continue
            index = np.cumsum(gaps[at:at + blocks * kept].reshape(blocks, kept) + 1, axis=1) - 1
            if int(index[:, -1].max()) >= length:
                raise CodecError(f"{self.name}: an index is past the end of its {length}-element block")
            out.append((index + base + length * np.arange(blocks, dtype=np.int64)[:, None]).reshape(-1))
            at, base = at + blocks * kept, base + blocks * length
        return np.concatenate(out)

    def check_payload(self, buf: bytes, n: int) -> None:
        self.parse(buf, n)

    def decode_into(self, buf: bytes, n: int, out: torch.Tensor, *, vetted: bool = False) -> None:
        positions, values = self.parse(buf, n)
        target = out.numpy()
        target.fill(0)
        target[positions] = values

    def decode(self, buf: bytes, n: int) -> torch.Tensor:
        if n < 0:
            raise CodecError(f"{self.name}: {n} elements: a count is 0 or more")
        out = empty_floats(n)
        self.decode_into(buf, n, out)
        return out
