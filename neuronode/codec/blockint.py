"""Block integer codecs: ``int8`` and ``int4``, symmetric per-block quantization.

They quantize symmetric, round-to-nearest-even, with one float32 scale per block of
``BLOCK_ELEMS`` elements.  A payload is ``[scales][codes]``: all scales of the vector first,
then the codes.  Chunking (``neuronode.codec.geometry``) cuts at block boundaries, so a chunk's
payload is itself a valid payload of its elements, and the decoded values do not depend on how
the vector was chunked.  The contract they keep is ``neuronode.codec.quant.Codec``.
"""

from __future__ import annotations

import numpy as np
import torch

from neuronode.codec.quant import (
    NOT_FINITE,
    Codec,
    CodecError,
    check_finite,
    check_input,
    check_length,
    ints_from,
)

__all__ = ["BLOCK_ELEMS", "BLOCK_CODECS", "Int4Codec", "Int8Codec"]

# 64 keeps one outlier from flattening many neighbours; with a float32 scale the overhead is
# 4/64 = 0.0625 bytes/param (int8: 1.0625 B/param, int4: 0.5625 B/param).
BLOCK_ELEMS = 64


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
        check_length(buf, n, self.payload_bytes(n), self.name)
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
        scales, codes = self._quantize(check_input(x, finite=False))
        return scales.numpy().astype("<f4", copy=False).tobytes() + self._pack(codes)

    def decode(self, buf: bytes, n: int) -> torch.Tensor:
        check_length(buf, n, self.payload_bytes(n), self.name)
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
        check_length(buf, n, self.payload_bytes(n), self.name)
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
        return ints_from(buf, "i1", np.int8)

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
        packed = ints_from(buf, "u1", np.uint8)
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


BLOCK_CODECS: tuple[Codec, ...] = (Int8Codec(), Int4Codec())
