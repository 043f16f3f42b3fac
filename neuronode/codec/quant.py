"""The codec contract, the checks every codec makes, and the float codecs.

Every codec maps a 1-D float32 tensor of ``n`` elements to exactly ``payload_bytes(n)`` bytes
and back (at most that, for a codec whose sizes vary: ``exact_size`` False).  The byte layout is
fixed little-endian so that peers on any host agree, and encoding is deterministic (same input,
same bytes), which the contribution digest relies on.  A codec refuses NaN and Inf on both
sides: a sender's input, and a payload that would decode to them.

Here: ``Codec`` and ``CodecError``, the shared checks (``check_input``, ``check_length``,
``check_finite``), and the float codecs ``fp32``, ``fp16`` and ``bf16``, which ship (cast)
float bit patterns.  The block integer codecs ``int8`` and ``int4`` are in
``neuronode.codec.blockint``, the sparse one in ``neuronode.codec.sparse``; ``get_codec``
(``neuronode.codec.registry``) names them all.
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
    "FLOAT_CODECS",
    "NOT_FINITE",
    "Codec",
    "CodecError",
    "all_finite",
    "check_finite",
    "check_input",
    "check_length",
    "ints_from",
]


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
    if not is_finite(t):
        raise CodecError(NOT_FINITE)


def is_finite(t: torch.Tensor) -> bool:
    """True if no element of the float tensor ``t`` is NaN or Inf. numpy's one pass is ~20x
    faster than torch's isfinite on CPU float32 (measured on 1 MiB chunks), which also makes a
    temporary of the tensor's size: a reducer's 6M-element shard, checked so, was 8% of bench
    sync's reduce-scatter CPU. A tensor on an accelerator is checked there (no copy to the host)."""
    if t.device.type != "cpu":
        return bool(torch.isfinite(t).all())
    return not t.numel() or all_finite(t.detach().numpy())


def check_input(x: torch.Tensor, *, finite: bool = True) -> torch.Tensor:
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


def check_length(buf: bytes, n: int, expected: int, name: str) -> None:
    if n < 0:
        raise CodecError(f"element count must be >= 0, got {n}")
    if len(buf) != expected:
        raise CodecError(
            f"{name}: payload for {n} elements must be {expected} bytes, got {len(buf)}"
        )


def ints_from(buf: bytes, le_dtype: str, native: type[np.generic]) -> torch.Tensor:
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
            check_length(buf, n, self.payload_bytes(n), self.name)
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
        return check_input(x).numpy().astype("<f4", copy=False).tobytes()

    def decode(self, buf: bytes, n: int) -> torch.Tensor:
        check_length(buf, n, self.payload_bytes(n), self.name)
        out = torch.from_numpy(np.frombuffer(buf, dtype="<f4").astype(np.float32, copy=True))
        check_finite(out)
        return out

    def check_payload(self, buf: bytes, n: int) -> None:
        check_length(buf, n, self.payload_bytes(n), self.name)
        if not all_finite(np.frombuffer(buf, dtype="<f4")):
            raise CodecError(NOT_FINITE)

    def decode_into(self, buf: bytes, n: int, out: torch.Tensor, *, vetted: bool = False) -> None:
        if vetted:
            check_length(buf, n, self.payload_bytes(n), self.name)
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
        bits = self._cast(check_input(x, finite=False)).view(torch.int16).numpy()
        return bits.astype("<i2", copy=False).tobytes()

    def decode(self, buf: bytes, n: int) -> torch.Tensor:
        check_length(buf, n, self.payload_bytes(n), self.name)
        out = ints_from(buf, "<i2", np.int16).view(self.dtype).to(torch.float32)
        check_finite(out)
        return out

    def check_payload(self, buf: bytes, n: int) -> None:
        check_length(buf, n, self.payload_bytes(n), self.name)
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
        check_length(buf, n, self.payload_bytes(n), self.name)
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


FLOAT_CODECS: tuple[Codec, ...] = (Fp32Codec(), Fp16Codec(), Bf16Codec())
