"""Quantization codecs for flat float32 pseudo-gradient vectors.

Every codec maps a 1-D float32 tensor of ``n`` elements to exactly ``payload_bytes(n)`` bytes
and back.  The byte layout is fixed little-endian so that peers on any host agree, and encoding
is deterministic (same input, same bytes), which the contribution digest relies on.

Block codecs (``int8``, ``int4``) quantize symmetric, round-to-nearest-even, with one float32
scale per block of ``BLOCK_ELEMS`` elements.  A payload is ``[scales][codes]``: all scales of
the vector first, then the codes.  Chunking (see ``framing``) cuts at block boundaries, so a
chunk's payload is itself a valid payload of its elements, and the decoded values do not depend
on how the vector was chunked.
"""

from __future__ import annotations

import math
import sys
import warnings

import numpy as np
import torch

# Fp32Codec.add_into reads received bytes in place through a read-only tensor it never writes.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)

__all__ = [
    "BLOCK_ELEMS",
    "DENSE_CODECS",
    "Codec",
    "CodecError",
    "check_finite",
]

# 64 keeps one outlier from flattening many neighbours; with a float32 scale the overhead is
# 4/64 = 0.0625 bytes/param (int8: 1.0625 B/param, int4: 0.5625 B/param).
BLOCK_ELEMS = 64


class CodecError(ValueError):
    """Malformed, truncated or non-finite data, or a bad codec argument."""


NOT_FINITE = "tensor contains NaN or Inf; refusing to encode or accept it"


def all_finite(a: np.ndarray) -> bool:
    """True if no element of the float array ``a`` is NaN or Inf."""
    # A finite sum means every element is finite (Inf and NaN propagate through additions): one
    # pass and no temporary, ~3x faster than isfinite().all(). Only a sum that overflowed (or a
    # real NaN/Inf) needs the element-wise check.
    with np.errstate(over="ignore", invalid="ignore"):
        if bool(np.isfinite(np.add.reduce(a, axis=None))):
            return True
    return bool(np.isfinite(a).all())


def check_finite(t: torch.Tensor) -> None:
    """Raise CodecError if ``t`` holds any NaN or Inf."""
    # numpy is ~20x faster than torch's isfinite on CPU float32 (measured on 1 MiB chunks).
    if t.numel() and not all_finite(t.detach().cpu().numpy()):
        raise CodecError(NOT_FINITE)


def _check_input(x: torch.Tensor, *, finite: bool = True) -> torch.Tensor:
    """Validate an encoder input and return it as a contiguous CPU tensor without grad.
    ``finite=False``: the caller checks for NaN/Inf itself, in a pass it makes anyway."""
    if x.dim() != 1 or x.dtype != torch.float32:
        raise CodecError(
            f"expected a 1-D float32 tensor, got {x.dtype} with shape {tuple(x.shape)}"
        )
    x = x.detach().to("cpu").contiguous()
    # NaN/Inf would poison every peer's average (and int scales); stop it at the sender.
    if finite:
        check_finite(x)
    return x


def _check_length(buf: bytes, n: int, expected: int, name: str) -> None:
    if n < 0:
        raise CodecError(f"element count must be >= 0, got {n}")
    if len(buf) != expected:
        raise CodecError(
            f"{name}: payload for {n} elements must be {expected} bytes, got {len(buf)}"
        )


def _ints_from(buf: bytes, le_dtype: str, native: type[np.generic]) -> torch.Tensor:
    """Little-endian ints from ``buf`` as a writable tensor (np.frombuffer of bytes is read-only)."""
    return torch.from_numpy(np.frombuffer(buf, dtype=le_dtype).astype(native, copy=True))


class Codec:
    """Base codec: subclasses set the class attributes and implement the three methods."""

    name: str = ""
    lossy: bool = False
    block_elems: int = 1  # chunk boundaries must be multiples of this
    shuffle_width: int = 1  # bytes per element for the optional byte-shuffle filter
    wire_dtype: torch.dtype | None = None  # the payload is these values, little-endian: read in place
    exact_size: bool = True  # False: a payload's size varies, payload_bytes(n) is its bound

    def payload_bytes(self, n: int) -> int:
        """Encoded size in bytes of ``n`` elements: exact, or the most it may take when the
        codec's sizes vary (``exact_size`` False)."""
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> bytes:
        """Encode a 1-D float32 tensor; raises CodecError on bad shape/dtype or NaN/Inf."""
        raise NotImplementedError

    def decode(self, buf: bytes, n: int) -> torch.Tensor:
        """Decode ``n`` float32 elements; raises CodecError on wrong length or non-finite data."""
        raise NotImplementedError

    def check_payload(self, buf: bytes, n: int) -> None:
        """Raise CodecError exactly when ``decode(buf, n)`` would, without building the float32
        output: receivers vet every chunk on arrival, and decode only when they average."""
        self.decode(buf, n)

    def decode_into(self, buf: bytes, n: int, out: torch.Tensor, *, vetted: bool = False) -> None:
        """``out[:] = decode(buf, n)`` (same values, same errors) for a contiguous float32 CPU
        ``out`` of ``n`` elements, with fewer copies where the codec allows. ``vetted``: the
        payload already passed ``check_payload``, so codecs may skip the finiteness check. After
        an error the content of ``out`` is undefined."""
        out.copy_(self.decode(buf, n))

    def add_into(self, buf: bytes, n: int, acc: torch.Tensor, alpha: float, *, vetted: bool = False) -> None:
        """``acc.add_(decode(buf, n), alpha=alpha)`` (same values, same errors) for a float32
        CPU ``acc`` of ``n`` elements, without a decoded copy where the codec allows."""
        if self.wire_dtype is None or sys.byteorder != "little":
            acc.add_(self.decode(buf, n), alpha=alpha)
            return
        if vetted:
            _check_length(buf, n, self.payload_bytes(n), self.name)
        else:
            self.check_payload(buf, n)
        # torch widens the wire values exactly and adds in float32: decode()'s bits, no copy.
        acc.add_(self._wire(buf), alpha=alpha)

    def _wire(self, buf: bytes) -> torch.Tensor:
        """The received values in place, as a read-only tensor of ``wire_dtype`` (length checked)."""
        assert self.wire_dtype is not None
        ints = np.frombuffer(buf, dtype=np.int32 if self.wire_dtype.itemsize == 4 else np.int16)
        return torch.from_numpy(ints).view(self.wire_dtype)

    def __repr__(self) -> str:
        return f"<codec {self.name}>"

    @property
    def spec(self) -> str:
        """The name ``get_codec`` takes for this codec, its parameters included."""
        return self.name


class Fp32Codec(Codec):
    """Lossless: the float32 bytes themselves."""

    name = "fp32"
    shuffle_width = 4
    wire_dtype = torch.float32

    def payload_bytes(self, n: int) -> int:
        return 4 * n

    def encode(self, x: torch.Tensor) -> bytes:
        return _check_input(x).numpy().astype("<f4", copy=False).tobytes()

    def decode(self, buf: bytes, n: int) -> torch.Tensor:
        _check_length(buf, n, self.payload_bytes(n), self.name)
        out = torch.from_numpy(np.frombuffer(buf, dtype="<f4").astype(np.float32, copy=True))
        check_finite(out)
        return out

    def check_payload(self, buf: bytes, n: int) -> None:
        _check_length(buf, n, self.payload_bytes(n), self.name)
        if not all_finite(np.frombuffer(buf, dtype="<f4")):
            raise CodecError(NOT_FINITE)

    def decode_into(self, buf: bytes, n: int, out: torch.Tensor, *, vetted: bool = False) -> None:
        if vetted:
            _check_length(buf, n, self.payload_bytes(n), self.name)
        else:
            self.check_payload(buf, n)
        np.copyto(out.numpy(), np.frombuffer(buf, dtype="<f4"))


class _Half16Codec(Codec):
    """Shared code of the 16-bit float codecs: cast, then ship the raw 16-bit patterns."""

    lossy = True
    shuffle_width = 2
    dtype: torch.dtype = torch.float16
    exponent_mask: int = 0x7C00  # all ones: Inf or NaN

    def payload_bytes(self, n: int) -> int:
        return 2 * n

    def _cast(self, x: torch.Tensor) -> torch.Tensor:
        # Saturate: finite input must not become Inf on the wire (receivers reject Inf).  Within
        # range this is exactly torch's round-to-nearest-even cast.  One min/max pass both
        # checks the input (NaN propagates, Inf is an extreme) and tells whether to clamp.
        limit = float(torch.finfo(self.dtype).max)
        if not x.numel():
            return x.to(self.dtype)
        lo, hi = (float(v) for v in torch.aminmax(x))
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise CodecError(NOT_FINITE)
        if lo < -limit or hi > limit:
            x = x.clamp(-limit, limit)
        return x.to(self.dtype)

    def encode(self, x: torch.Tensor) -> bytes:
        bits = self._cast(_check_input(x, finite=False)).view(torch.int16).numpy()
        return bits.astype("<i2", copy=False).tobytes()

    def decode(self, buf: bytes, n: int) -> torch.Tensor:
        _check_length(buf, n, self.payload_bytes(n), self.name)
        out = _ints_from(buf, "<i2", np.int16).view(self.dtype).to(torch.float32)
        check_finite(out)
        return out

    def check_payload(self, buf: bytes, n: int) -> None:
        _check_length(buf, n, self.payload_bytes(n), self.name)
        # Exponent all ones (Inf or NaN) exactly when the bits below the sign reach the mask.
        bits = np.frombuffer(buf, dtype="<u2")
        if bits.size and int((bits & np.uint16(0x7FFF)).max()) >= self.exponent_mask:
            raise CodecError(NOT_FINITE)

    # Widening to float32 is exact, and torch computes a mixed add in float32: both fast paths
    # give the same bits as decode() followed by copy_ / add_ (tests/test_codec_quant.py).
    def decode_into(self, buf: bytes, n: int, out: torch.Tensor, *, vetted: bool = False) -> None:
        if sys.byteorder != "little":
            super().decode_into(buf, n, out, vetted=vetted)
            return
        _check_length(buf, n, self.payload_bytes(n), self.name)
        out.copy_(self._wire(buf))
        if not vetted:
            check_finite(out)


class Fp16Codec(_Half16Codec):
    """IEEE half; saturates at +-65504."""

    name = "fp16"
    dtype = wire_dtype = torch.float16


class Bf16Codec(_Half16Codec):
    """bfloat16: float32's range, 8 bits of mantissa; saturates at +-3.39e38."""

    name = "bf16"
    dtype = wire_dtype = torch.bfloat16
    exponent_mask = 0x7F80


class _BlockIntCodec(Codec):
    """Symmetric per-block integer quantization with float32 scales = absmax / qmax."""

    lossy = True
    block_elems = BLOCK_ELEMS
    qmax: int = 127

    def n_blocks(self, n: int) -> int:
        return -(-n // self.block_elems)

    def code_bytes(self, n: int) -> int:
        raise NotImplementedError

    def payload_bytes(self, n: int) -> int:
        return 4 * self.n_blocks(n) + self.code_bytes(n)

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (scales (nb,), codes (n,) int8 in [-qmax, qmax])."""
        n, nb = x.numel(), self.n_blocks(x.numel())
        if n % self.block_elems == 0:  # every chunk but a vector's last: no padded copy
            blocks = x.view(nb, self.block_elems)  # (nb, B)
        else:
            padded = torch.zeros(nb * self.block_elems, dtype=torch.float32)
            padded[:n] = x
            blocks = padded.view(nb, self.block_elems)
        # max(|x|) per block from the block maxima and minima: no |x| copy, and NaN/Inf show in
        # them, so this also checks the input. (amax + amin beat abs().amax() and aminmax here.)
        absmax = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_()).abs_()  # abs_: -0 -> 0
        if not bool(torch.isfinite(absmax).all()):
            raise CodecError(NOT_FINITE)
        scales = absmax / self.qmax  # (nb,)
        # Near float32 max, absmax/qmax may round up so that qmax * scale overflows to Inf on
        # decode; step such scales down one ulp (codes then clamp, error stays ~1 ulp).
        overflow = torch.isinf(scales * self.qmax)
        if bool(overflow.any()):
            scales = torch.where(
                overflow, torch.nextafter(scales, torch.zeros_like(scales)), scales
            )
        # An all-zero block has scale 0; divide by 1 instead so its codes are 0, not NaN.
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.div(blocks, safe[:, None]).round_().clamp_(-self.qmax, self.qmax)
        return scales, codes.to(torch.int8).view(-1)[:n]

    def _pack(self, codes: torch.Tensor) -> bytes:
        raise NotImplementedError

    def _scale_codes(self, codes: memoryview, scales: np.ndarray, target: np.ndarray) -> None:
        """``target`` (blocks, block_elems) = the codes in ``codes`` times their block's scale."""
        raise NotImplementedError

    def decode_into(self, buf: bytes, n: int, out: torch.Tensor, *, vetted: bool = False) -> None:
        if n % self.block_elems:  # a short last block: the generic path
            super().decode_into(buf, n, out)
            return
        _check_length(buf, n, self.payload_bytes(n), self.name)
        nb = self.n_blocks(n)
        scales = np.frombuffer(buf, dtype="<f4", count=nb).astype(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            self._scale_codes(memoryview(buf)[4 * nb:], scales, out.numpy().reshape(nb, self.block_elems))
        if not vetted:
            check_finite(out)

    def add_into(self, buf: bytes, n: int, acc: torch.Tensor, alpha: float, *, vetted: bool = False) -> None:
        decoded = torch.from_numpy(np.empty(n, dtype=np.float32))
        self.decode_into(buf, n, decoded, vetted=vetted)  # the codecs' fast path, not decode()
        acc.add_(decoded, alpha=alpha)

    def _unpack(self, buf: bytes, n: int) -> torch.Tensor:
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> bytes:
        # _quantize refuses NaN/Inf from the block extremes it computes anyway.
        scales, codes = self._quantize(_check_input(x, finite=False))
        return scales.numpy().astype("<f4", copy=False).tobytes() + self._pack(codes)

    def decode(self, buf: bytes, n: int) -> torch.Tensor:
        _check_length(buf, n, self.payload_bytes(n), self.name)
        nb = self.n_blocks(n)
        scales = torch.from_numpy(np.frombuffer(buf, dtype="<f4", count=nb).astype(np.float32))
        codes = self._unpack(buf[4 * nb :], n).to(torch.float32)
        padded = torch.zeros(nb * self.block_elems, dtype=torch.float32)
        padded[:n] = codes
        out = (padded.view(nb, self.block_elems) * scales[:, None]).view(-1)[:n].clone()
        # Honest payloads always decode finite; a hostile one (Inf/NaN scale, huge scale times
        # an out-of-range code) must not reach the average.
        check_finite(out)
        return out

    def check_payload(self, buf: bytes, n: int) -> None:
        _check_length(buf, n, self.payload_bytes(n), self.name)
        # Codes lie in [-(qmax + 1), qmax]: if every |scale| * (qmax + 1) is finite, so is every
        # decoded value. Only a scale within 1% of float32's max needs the full decode.
        scales = np.frombuffer(buf, dtype="<f4", count=self.n_blocks(n))
        with np.errstate(over="ignore", invalid="ignore"):
            bound = np.abs(scales) * np.float32(self.qmax + 1)
        if not bool(np.isfinite(bound).all()):
            self.decode(buf, n)


class Int8Codec(_BlockIntCodec):
    """One signed byte per element plus a float32 scale per block."""

    name = "int8"
    qmax = 127

    def code_bytes(self, n: int) -> int:
        return n

    def _pack(self, codes: torch.Tensor) -> bytes:
        return codes.numpy().tobytes()

    def _unpack(self, buf: bytes, n: int) -> torch.Tensor:
        return _ints_from(buf, "i1", np.int8)

    def _scale_codes(self, codes: memoryview, scales: np.ndarray, target: np.ndarray) -> None:
        # float32(code) * scale, rounded once: the same bits as decode()'s torch product.
        np.multiply(np.frombuffer(codes, dtype="i1").reshape(target.shape), scales[:, None],
                    out=target, dtype=np.float32)


class Int4Codec(_BlockIntCodec):
    """Two elements per byte (low nibble first), codes in [-7, 7] stored offset by 8."""

    name = "int4"
    qmax = 7

    def code_bytes(self, n: int) -> int:
        return -(-n // 2)

    def _pack(self, codes: torch.Tensor) -> bytes:
        nibbles = codes.numpy().view(np.uint8) + np.uint8(8)  # codes in [-7, 7]: nibbles 1..15
        if nibbles.size % 2:
            nibbles = np.append(nibbles, np.uint8(8))
        pairs = nibbles.view("<u2")  # element 2i in the low byte, 2i + 1 in the high byte
        return (pairs | (pairs >> 4)).astype(np.uint8).tobytes()  # low nibble first

    def _unpack(self, buf: bytes, n: int) -> torch.Tensor:
        packed = _ints_from(buf, "u1", np.uint8)
        # A hostile peer may send nibble 0 (code -8); it decodes to a finite -8 * scale.
        nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=1).view(-1)[:n]
        return nibbles.to(torch.int8) - 8

    def _scale_codes(self, codes: memoryview, scales: np.ndarray, target: np.ndarray) -> None:
        # Byte b holds the codes (b & 15) - 8 and (b >> 4) - 8, low nibble first. Spread each
        # byte's nibbles into the two bytes of a little-endian uint16, read those as int8 codes,
        # then float32(code) * scale rounded once: the same bits as decode(), in a few
        # vectorized passes (about 3x faster than a table lookup per byte).
        pairs = np.frombuffer(codes, dtype=np.uint8).astype("<u2")
        pairs |= pairs << 4
        pairs &= 0x0F0F
        ints = pairs.view(np.int8)
        ints -= 8
        np.multiply(ints.reshape(target.shape), scales[:, None], out=target, dtype=np.float32)


DENSE_CODECS: dict[str, Codec] = {
    c.name: c for c in (Fp32Codec(), Fp16Codec(), Bf16Codec(), Int8Codec(), Int4Codec())
}
