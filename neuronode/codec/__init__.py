"""Pure encoding of pseudo-gradients for the wire: quantization, chunk geometry, framing, digests,
feedback.

No network and no asyncio here; callers run these (CPU-bound) functions in a thread.
"""

from neuronode.codec.blockint import BLOCK_ELEMS
from neuronode.codec.contribution import (
    AUTO_ZSTD,
    Contribution,
    ContributionEncoder,
    Encoded,
    EncoderConfig,
    Phase,
    VectorEncoder,
    auto_zstd_level,
)
from neuronode.codec.feedback import ErrorFeedback
from neuronode.codec.framing import (
    Assembler,
    ContributionDigest,
    Frame,
    contribution_digest,
    decode_frame,
    encode_frames,
    receiving,
    repack,
    roundtrip,
)
from neuronode.codec.geometry import (
    MAX_CHUNK_PAYLOAD,
    chunk_elements,
    chunk_ranges,
    expected_raw_lens,
    shard_ranges,
    shuffle_width,
)
from neuronode.codec.quant import Codec, CodecError, check_finite, is_finite
from neuronode.codec.registry import CODECS, SPARSE, codec_spec, get_codec

Digest = ContributionDigest

__all__ = [
    "AUTO_ZSTD",
    "Contribution",
    "ContributionEncoder",
    "Encoded",
    "EncoderConfig",
    "Phase",
    "VectorEncoder",
    "auto_zstd_level",
    "BLOCK_ELEMS",
    "CODECS",
    "Assembler",
    "Codec",
    "CodecError",
    "ContributionDigest",
    "Digest",
    "ErrorFeedback",
    "Frame",
    "check_finite",
    "is_finite",
    "codec_spec",
    "SPARSE",
    "shard_ranges",
    "MAX_CHUNK_PAYLOAD",
    "chunk_elements",
    "chunk_ranges",
    "receiving",
    "contribution_digest",
    "decode_frame",
    "encode_frames",
    "expected_raw_lens",
    "get_codec",
    "repack",
    "roundtrip",
    "shuffle_width",
]
