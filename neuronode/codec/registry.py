"""Codecs by name: the dense ones (the float codecs of ``neuronode.codec.quant``, the block
integer ones of ``neuronode.codec.blockint``) and the sparse one with its parameters
(``neuronode.codec.sparse``: "sparse", or "sparse:k=32,bits=4,block=4096")."""

from __future__ import annotations

import functools

from neuronode.codec.blockint import BLOCK_CODECS
from neuronode.codec.quant import FLOAT_CODECS, Codec, CodecError
from neuronode.codec.sparse import NAME as SPARSE
from neuronode.codec.sparse import SparseCodec, parse_spec, sparse_spec

__all__ = ["CODECS", "DENSE_CODECS", "SPARSE", "codec_spec", "get_codec"]

DENSE_CODECS: dict[str, Codec] = {c.name: c for c in (*FLOAT_CODECS, *BLOCK_CODECS)}

CODECS: tuple[str, ...] = (*DENSE_CODECS, SPARSE)


def get_codec(name: str) -> Codec:
    """The codec `name` names (one of CODECS, a sparse one with its parameters); raises
    CodecError otherwise."""
    codec = DENSE_CODECS.get(name)
    if codec is not None:
        return codec
    if name.partition(":")[0] == SPARSE:
        return _sparse(*parse_spec(name))
    raise CodecError(f"unknown codec {name!r}; choose one of {', '.join(CODECS)}")


@functools.lru_cache(maxsize=64)
def _sparse(k: int, bits: int, block: int) -> Codec:
    return SparseCodec(k, bits, block)


def codec_spec(codec: str, *, k: int, bits: int, block: int) -> str:
    """The name `get_codec` takes for `--codec` with the `--sparse-*` settings (which only
    the sparse codec reads)."""
    return sparse_spec(k, bits, block) if codec == SPARSE else codec
