"""One contribution, encoded: frames for the wire plus the sender's own decoded (wire) form.

`VectorEncoder` is what the daemon's Trainer and `neuronode bench sync` both use, so the
benchmark measures exactly the daemon's encoding. Pure CPU work; callers run it in a thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from neuronode.codec.framing import Assembler, ContributionDigest, Frame, encode_frames
from neuronode.codec.quant import get_codec

AUTO_ZSTD = -1  # --zstd-level -1
SLOW_LINK_BYTES_PER_S = 10e6  # 80 Mbit/s: below this, every byte saved counts


def auto_zstd_level(link_bytes_per_s: float, compress_bytes_per_s: float, *, capped: bool = False,
                    saved_fraction: float = 1.0) -> int:
    """--zstd-level auto. zstd costs 1/compress seconds per raw byte and saves saved_fraction/link
    seconds of sending: skip it unless it saves more than it costs (compress x saved > link); level 1
    when it pays or nothing is measured yet; level 3 only on a known slow link (an upload cap
    under 80 Mbit/s), since a measured push rate also reflects a busy receiver.
    `link_bytes_per_s` is the rate at which this encoding leaves (the upload rate divided by the
    number of peers it is sent to)."""
    if link_bytes_per_s <= 0 or compress_bytes_per_s <= 0:
        return 1
    if compress_bytes_per_s * saved_fraction <= link_bytes_per_s:
        return 0
    return 3 if capped and link_bytes_per_s < SLOW_LINK_BYTES_PER_S else 1


@dataclass
class Encoded:
    """Our contribution, encoded: frames for the wire and its raw payloads for ourselves."""

    frames: list[Frame]
    digest: str
    chunk_elements: int
    own: Assembler
    weight: float
    shuffled: bool
    zstd_level: int


@dataclass
class VectorEncoder:
    """Encodes flat float32 vectors with one codec: the zstd level (auto included), the
    byte-shuffle rule, frames, digest, and an Assembler of the raw payloads (a node averages the
    decoded wire form of its own contribution too, so lossy codecs leave every replica with the
    same result). One thread at a time: it keeps the last measured zstd rate."""

    codec: str
    chunk_bytes: int
    zstd_level: int  # AUTO_ZSTD: auto_zstd_level(link rate, our last zstd rate)
    byte_shuffle: bool
    capped: bool = False  # an upload cap is set (auto may then compress harder)
    compress_rate: float = 0.0  # bytes/s our last zstd pass managed (0: not measured)
    saved_fraction: float = 1.0  # share of the raw bytes our last zstd pass saved

    def encode(self, vector: torch.Tensor, link_bytes_per_s: float, *, weight: float = 1.0) -> Encoded:
        c = get_codec(self.codec)
        level = self.zstd_level
        if level == AUTO_ZSTD:
            level = auto_zstd_level(link_bytes_per_s, self.compress_rate, capped=self.capped,
                                    saved_fraction=self.saved_fraction)
        # Byte planes compress better for float codecs (measured: fp32 1.11x -> 1.27x, bf16
        # 1.29x -> 1.47x with zstd 1); int codecs have one-byte elements, nothing to split.
        shuffle = self.byte_shuffle and c.shuffle_width > 1 and level > 0
        digest = ContributionDigest()
        own = Assembler(n_elems=vector.numel(), codec=self.codec, chunk_bytes=self.chunk_bytes, shuffle=shuffle)
        started = time.perf_counter()
        frames = list(encode_frames(vector, codec=self.codec, chunk_bytes=self.chunk_bytes,
                                    zstd_level=level, shuffle=shuffle, digest=digest, own=own))
        if level > 0 and vector.numel():
            elapsed_s = max(time.perf_counter() - started, 1e-9)
            raw_bytes = c.payload_bytes(vector.numel())
            self.compress_rate = raw_bytes / elapsed_s
            self.saved_fraction = max(0.0, 1.0 - sum(len(f.data) for f in frames) / raw_bytes)
        chunk_elements = (self.chunk_bytes // c.payload_bytes(c.block_elems)) * c.block_elems
        return Encoded(frames=frames, digest=digest.hexdigest(), chunk_elements=chunk_elements,
                       own=own, weight=weight, shuffled=shuffle, zstd_level=level)
