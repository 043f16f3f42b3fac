"""The sparse codec (neuronode.codec.sparse): what it keeps, how close it decodes, its byte
budget, and a decoder that refuses every payload its encoder could not have made."""

from __future__ import annotations

import hashlib
import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from neuronode.codec import (
    Assembler,
    CodecError,
    ContributionEncoder,
    EncoderConfig,
    ErrorFeedback,
    VectorEncoder,
    chunk_elements,
    chunk_ranges,
    codec_spec,
    decode_frame,
    encode_frames,
    get_codec,
    receiving,
    roundtrip,
)
from neuronode.codec.sparse import SparseCodec, group_size, rice_parameter

torch.set_num_threads(1)

FAST = settings(max_examples=40, deadline=None)
DEFAULT = get_codec("sparse")
SMALL = get_codec("sparse:k=8,bits=2,block=64")  # 8 of 64: many blocks in few elements
CODECS = [DEFAULT, SMALL, get_codec("sparse:k=16,bits=4,block=256"), get_codec("sparse:k=5,bits=8,block=64")]


def heavy_tailed(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, generator=g)
    chi = torch.randn(n, 3, generator=g).pow(2).sum(dim=1)
    return z / torch.sqrt(chi / 3)


def layout(codec: SparseCodec, n: int) -> tuple[int, int]:
    """(bytes of scales, bytes of scales and fields): where the unary section starts."""
    scales, fields, _, _ = codec._sections(n)
    return scales, scales + fields


def refuses(codec: SparseCodec, buf: bytes, n: int, match: str = "") -> None:
    with pytest.raises(CodecError, match=match):
        codec.decode(buf, n)
    with pytest.raises(CodecError, match=match):
        codec.check_payload(buf, n)


# ---- what it keeps and how close -------------------------------------------------------------


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.spec)
@FAST
@given(blocks=st.integers(0, 3), tail=st.integers(0, 70), seed=st.integers(0, 2**16))
def test_keeps_the_k_largest_per_block_within_half_a_bin(codec: SparseCodec, blocks: int, tail: int,
                                                         seed: int) -> None:
    n = blocks * codec.block_elems + min(tail, codec.block_elems - 1)
    x = heavy_tailed(n, seed)
    buf = codec.encode(x)
    assert codec.min_payload_bytes(n) <= len(buf) <= codec.payload_bytes(n)
    y = codec.decode(buf, n)
    for start in range(0, n, codec.block_elems):
        xb, yb = x[start:start + codec.block_elems], y[start:start + codec.block_elems]
        kept = yb != 0
        assert int(kept.sum()) == min(codec.k, xb.numel())  # no kept value decodes to 0 here
        if not kept.all():
            assert xb[kept].abs().min() >= xb[~kept].abs().max()  # the largest magnitudes
        biggest = float(xb.abs().max())  # float32 rounding of a decoded value: an ulp of it
        assert float((yb[kept] - xb[kept]).abs().max()) <= biggest / (2 * codec.levels) + biggest * 2**-23
        assert torch.equal(yb[kept].sign(), xb[kept].sign())


def test_a_zero_block_decodes_to_zeros_and_the_defaults_are_the_issues() -> None:
    assert (DEFAULT.k, DEFAULT.bits, DEFAULT.block_elems, DEFAULT.rice) == (64, 2, 4096, 5)
    x = torch.zeros(5000)
    x[4500] = -2.0
    y = DEFAULT.decode(DEFAULT.encode(x), 5000)
    assert torch.equal(y[:4096], torch.zeros(4096))
    # 2 bits: bins of width max|x| / 2, each decoding to its middle; the 63 zeros kept beside
    # -2 decode to the middle of the lowest bin, 0.5 (half a bin off, as any kept value may be).
    assert float(y[4500]) == -1.5 and int((y != 0).sum()) == 64 and set(y[y > 0].tolist()) == {0.5}


def test_encode_is_deterministic_and_chunking_does_not_change_values() -> None:
    x = heavy_tailed(3 * 4096 + 100, seed=5)
    assert DEFAULT.encode(x) == DEFAULT.encode(x.clone())
    assert torch.equal(roundtrip(x, "sparse", chunk_elems=4096), roundtrip(x, "sparse"))


@pytest.mark.parametrize("params", [1_000_000, 10_000_000])
def test_bytes_per_param_within_the_budget_at_the_defaults(params: int) -> None:
    """0.02 B/param: the issue's budget (81.9 bytes a 4096-block). The bound (every gap as
    long as it can be) is 84 bytes a block."""
    x = torch.randn(params, generator=torch.Generator().manual_seed(0))
    assert len(DEFAULT.encode(x)) / params <= 0.02
    assert len(DEFAULT.encode(heavy_tailed(1 << 20, seed=1))) / (1 << 20) <= 0.02
    assert DEFAULT.payload_bytes(params) / params <= 0.0206


@pytest.mark.parametrize(("k", "bits", "block"), [(1, 2, 64), (64, 8, 64), (1024, 8, 1024), (1024, 8, 65536),
                                                  (1, 2, 65536), (16, 2, 4096), (128, 4, 4096)])
def test_one_block_fits_the_smallest_chunk(k: int, bits: int, block: int) -> None:
    codec = SparseCodec(k, bits, block)
    assert codec.payload_bytes(block) <= 4096  # --chunk-bytes' least
    x = heavy_tailed(block + 3, seed=k)
    assert torch.equal(codec.decode(codec.encode(x), block + 3), roundtrip(x, codec.spec))


def test_the_flags_defaults_are_the_codecs() -> None:
    from neuronode.config import NodeConfig

    cfg = NodeConfig()
    assert (cfg.sparse_k, cfg.sparse_bits, cfg.sparse_block, cfg.sparse_decay) == (64, 2, 4096, 0.95)
    assert get_codec(codec_spec("sparse", k=cfg.sparse_k, bits=cfg.sparse_bits, block=cfg.sparse_block)) is DEFAULT


def test_rice_parameter_and_spec() -> None:
    assert [rice_parameter(4096, k) for k in (16, 32, 64, 128)] == [7, 6, 5, 4]
    assert rice_parameter(64, 64) == 0
    assert codec_spec("sparse", k=64, bits=2, block=4096) == "sparse"
    assert codec_spec("sparse", k=32, bits=4, block=4096) == "sparse:k=32,bits=4,block=4096"
    assert codec_spec("int8", k=32, bits=4, block=4096) == "int8"
    assert get_codec("sparse:k=32,bits=4,block=4096").k == 32
    assert get_codec("sparse:k=64,bits=2,block=4096") is get_codec("sparse")
    for bad, flag in [("sparse:k=0", "--sparse-k"), ("sparse:bits=3", "--sparse-bits"),
                      ("sparse:block=32", "--sparse-block"), ("sparse:k=100,block=64", "--sparse-k"),
                      ("sparse:k=-1", "options"), ("sparse:x=1", "options")]:
        with pytest.raises(CodecError, match=flag):
            get_codec(bad)


# ---- the bytes stay those of the first encoder -------------------------------------------------


def seeded(n: int, seed: int) -> torch.Tensor:
    """Heavy-tailed float32 values from numpy's seeded generator (no ties among magnitudes)."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal(n, dtype=np.float32)
    chi = (rng.standard_normal((n, 3), dtype=np.float32) ** 2).sum(axis=1, dtype=np.float32)
    return torch.from_numpy(z / np.sqrt(chi / np.float32(3)))


# SHA-256 of the payloads the first encoder (torch.topk over every block, then a sort) made of
# these vectors, and of the float32 values the first decoder made of them, computed with that
# code before the encoder moved to numpy's partition: the wire bytes and the decoded values did
# not change. Several slabs of blocks (neuronode.codec.sparse.SLAB_ELEMENTS) in the last two.
FIRST_ENCODER = [
    ("sparse", 13288, 1, "2c48bc569ca68870240a3382678a9637d66382e00d10fe5733e78645add7383c",
     "ce40ea150744d42230363d3c6acac54fe4278b81c2254ca1a345066cbb4c655b"),
    ("sparse", 200000, 2, "c31b581fb2c9f8b971a0949f9a12823befb4f468a9add766d7d02a5725cad242",
     "4d89e71103c0e6dcc03803efaf115c000fbd2a49f2e49d33e41e08db27b8650d"),
    ("sparse:k=16,bits=2,block=4096", 50000, 3, "8900fc6dd5f91285eb786e35c228780787fcc39b2be674921fc70d6360f9991d",
     "7ead1c0174ebab92b3f0dd6b0876d488f4e4d8d1a15c4ebad43ce36a18e61f26"),
    ("sparse:k=128,bits=4,block=4096", 50000, 4, "b80df0eefcd53863ec48cf263cd79f20314b656dae49569a6f8481a85ed8d1a1",
     "ec34543c975914168dbf1d9b94d4a04e8a51cd7d9f844ba632110818f6f9ca55"),
    ("sparse:k=8,bits=8,block=64", 10037, 5, "3417418378e00a68ccf6287fb43a0ab5cb0bc17f2fb8c659b44e63c054e1eb02",
     "4e7dd8ff8bda47b6b3c112e3f26558c2cf9cea39d5db89055da4d7dbeff92962"),
    ("sparse:k=5,bits=2,block=64", 3, 6, "7fa84763ab20c5565f69a96609a21df242592a3cc167c8a1d93e736d2fdce0f7",
     "0a7b7c02434c5b17104f881f5f0e1f04f40b9e4a2aa985e8e9cf532fb8606f5e"),
    ("sparse", 300000, 7, "77e4b47e8741a9b78dc01f587448c893feb1f440a0f714486ab1e3b30d253bdf",
     "2cf9ed4fae680dc0da9244298b74e77040a635e26b9ae28c8d182c7f0b6219e5"),
    ("sparse:k=1,bits=2,block=64", 5000003, 8, "cd663b6ca9952bccee2af9f10aa568fc35a24f86a8a71fc888768b52b37caa8c",
     "837dccc27bf6736fe8670d2690ceed25525c0ebb875f4ba59e04a6b8184722f2"),
]


@pytest.mark.parametrize(("spec", "n", "seed", "digest", "decoded"), FIRST_ENCODER, ids=lambda v: str(v)[:32])
def test_the_bytes_and_values_are_the_first_codecs(spec: str, n: int, seed: int, digest: str, decoded: str) -> None:
    codec = get_codec(spec)
    buf = codec.encode(seeded(n, seed))
    assert hashlib.sha256(buf).hexdigest() == digest
    assert hashlib.sha256(codec.decode(buf, n).numpy().tobytes()).hexdigest() == decoded


def topk_positions(codec: SparseCodec, x: torch.Tensor) -> np.ndarray:
    """The first encoder's choice: torch.topk of each block's magnitudes, ascending."""
    out = []
    for start in range(0, x.numel(), codec.block_elems):
        block = x[start:start + codec.block_elems].abs()
        keep = min(codec.k, block.numel())
        out.append(block.topk(keep, sorted=False).indices.sort().values.numpy() + start)
    return np.concatenate(out)


def tied(n: int, seed: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    sparse_ones = np.zeros(n, dtype=np.float32)
    sparse_ones[::97] = rng.standard_normal(sparse_ones[::97].size)
    mixed = rng.standard_normal(n).astype(np.float32)
    mixed[n // 2:n // 2 + 3000] = 0.5
    mixed[n - 5000:] = -0.0
    return [torch.zeros(n), torch.from_numpy(sparse_ones),
            torch.from_numpy(np.round(rng.standard_normal(n) * 3).astype(np.float32)),  # few values, signed
            torch.from_numpy(rng.choice([-2.0, -1.0, 1.0, 2.0], n).astype(np.float32)), torch.from_numpy(mixed)]


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.spec)
def test_tied_magnitudes_keep_torch_topks_choice(codec: SparseCodec) -> None:
    """Where magnitudes tie at the k-th largest, the encoder keeps the entries torch.topk kept
    (as the first encoder did), in blocks of every slab."""
    n = 70 * 4096 + 1234  # two slabs of 4096-blocks
    for x in tied(n, seed=codec.k):
        positions, _ = codec.parse(codec.encode(x), n)
        assert np.array_equal(positions, topk_positions(codec, x))


@pytest.mark.parametrize("codec", [*CODECS, SparseCodec(64, 8, 64), SparseCodec(300, 2, 1024)], ids=lambda c: c.spec)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_encode_refuses_non_finite_input_in_any_block_of_any_slab(codec: SparseCodec, bad: float) -> None:
    """The encoder checks finiteness in its selection pass (group maxima, or the magnitudes
    where a block has no groups: the last two), whole blocks and the tail, with and without ties."""
    n = 70 * 4096 + 1234
    for x in (seeded(n, 9), torch.zeros(n)):
        for where in (0, codec.block_elems - 1, 69 * 4096 + 5, n - 1):
            y = x.clone()
            y[where] = bad
            with pytest.raises(CodecError, match="NaN or Inf"):
                codec.encode(y)


def test_the_prefilters_groups() -> None:
    assert [group_size(4096, k) for k in (16, 64, 128, 256, 512, 1024, 2048)] == [16, 16, 8, 4, 2, 0, 0]
    assert (group_size(64, 8), group_size(64, 5), group_size(64, 64), group_size(1024, 300)) == (2, 2, 0, 0)
    assert group_size(4100, 16) == 4 and group_size(4097, 1) == 0  # a divisor of the block, or none


# ---- hostile payloads --------------------------------------------------------------------------


N = 4096 + 5  # a full block and one of 5: padding bits in both bit sections (K = 69 entries)


@pytest.fixture
def honest() -> bytes:
    return DEFAULT.encode(heavy_tailed(N, seed=3))


def test_truncated_or_trailing_bytes_are_refused(honest: bytes) -> None:
    DEFAULT.check_payload(honest, N)
    refuses(DEFAULT, honest[:-1], N, "entries|bytes")
    refuses(DEFAULT, honest + b"\x00", N, "trailing bytes|bytes")
    refuses(DEFAULT, honest + b"\x80", N, "entries|bytes")
    refuses(DEFAULT, honest[:layout(DEFAULT, N)[1]], N, "bytes")  # no index stream at all
    refuses(DEFAULT, b"", N, "bytes")


@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf, -1.0, 3.0e38])
def test_a_scale_that_is_not_finite_or_decodes_past_float32_is_refused(honest: bytes, scale: float) -> None:
    bad = struct.pack("<f", scale) + honest[4:]
    refuses(DEFAULT, bad, N, "scale")
    assert DEFAULT.decode(struct.pack("<f", 1.0e38) + honest[4:], N).isfinite().all()


def test_set_padding_bits_in_the_value_fields_are_refused(honest: bytes) -> None:
    _, unary_at = layout(DEFAULT, N)
    assert (69 * (DEFAULT.bits + DEFAULT.rice)) % 8  # the last field byte has padding
    bad = bytearray(honest)
    bad[unary_at - 1] |= 0x80
    refuses(DEFAULT, bytes(bad), N, "trailing bits")


def test_more_entries_than_k_or_fewer_are_refused(honest: bytes) -> None:
    _, unary_at = layout(DEFAULT, N)
    bits = np.unpackbits(np.frombuffer(honest[unary_at:], dtype=np.uint8), bitorder="little")
    ends = np.flatnonzero(bits)
    extra = bits.copy()
    extra[ends[-1] + 1:] = 1  # every padding bit after the last entry another entry
    if ends[-1] % 8 == 7:
        extra = np.concatenate([extra, np.ones(8, dtype=np.uint8)])
    refuses(DEFAULT, honest[:unary_at] + np.packbits(extra, bitorder="little").tobytes(), N, "more than k")
    fewer = bits.copy()
    fewer[ends[-1]] = 0  # the last entry never ends: the stream is truncated
    refuses(DEFAULT, honest[:unary_at] + np.packbits(fewer, bitorder="little").tobytes(), N, "truncated|trailing")


def test_an_index_past_its_block_is_refused() -> None:
    """Every kept index in the last positions of a block, then the first gap one quotient
    longer (a zero bit more in front, a padding bit less at the end): past the block's end."""
    codec = SMALL  # 8 of 64, r = 2: kept 56..63, the first gap 56 = 14 << 2
    x = torch.zeros(64)
    x[56:] = torch.arange(1.0, 9.0)
    buf = codec.encode(x)
    assert int(codec.parse(buf, 64)[0][0]) == 56
    _, unary_at = layout(codec, 64)
    bits = np.unpackbits(np.frombuffer(buf[unary_at:], dtype=np.uint8), bitorder="little")
    assert bits.size == 24 and bits[-1] == 0  # 14 + 1 + 7 bits, two of padding
    longer = np.concatenate([[0], bits[:-1]])
    refuses(codec, buf[:unary_at] + np.packbits(longer, bitorder="little").tobytes(), 64, "past the end")


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_no_bytes_crash_the_decoder_or_decode_to_bad_indices(data: st.DataObject) -> None:
    """Random payloads of every plausible length, and honest ones with a byte changed: each is
    refused with a CodecError, or decodes to finite values at strictly increasing in-range
    positions, never more than k per block, and check_payload agrees with decode."""
    codec = data.draw(st.sampled_from(CODECS))
    n = data.draw(st.integers(0, 3 * codec.block_elems))
    if data.draw(st.booleans()) and n:
        buf = bytearray(codec.encode(heavy_tailed(n, seed=n)))
        at = data.draw(st.integers(0, len(buf) - 1))
        buf[at] = data.draw(st.integers(0, 255))
    else:
        size = data.draw(st.integers(codec.min_payload_bytes(n), codec.payload_bytes(n) + 2))
        buf = bytearray(data.draw(st.binary(min_size=size, max_size=size)))
    try:
        positions, values = codec.parse(bytes(buf), n)
    except CodecError:
        with pytest.raises(CodecError):
            codec.decode(bytes(buf), n)
        return
    codec.check_payload(bytes(buf), n)
    assert positions.size == codec.entries(n) and bool(np.isfinite(values).all())
    assert bool((np.diff(positions) > 0).all()) and (positions.size == 0 or 0 <= positions[0] <= positions[-1] < n)
    blocks = np.bincount(positions // codec.block_elems) if positions.size else np.zeros(0)
    assert int(blocks.max(initial=0)) <= codec.k
    y = codec.decode(bytes(buf), n)
    assert torch.equal(y[torch.from_numpy(positions)], torch.from_numpy(values))


@FAST
@given(data=st.data())
def test_decode_into_and_add_into_give_decode_bit_for_bit(data: st.DataObject) -> None:
    codec = data.draw(st.sampled_from(CODECS))
    n = data.draw(st.sampled_from([1, 63, 64, 200, codec.block_elems + 5]))
    buf = codec.encode(heavy_tailed(n, seed=n) * data.draw(st.sampled_from([1e-30, 1e-3, 1e30])))
    expected = codec.decode(buf, n)
    out = torch.full((n,), 7.0)
    codec.decode_into(buf, n, out)
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32))
    acc = torch.randn(n)
    fast, slow = acc.clone(), acc.clone()
    codec.add_into(buf, n, fast, 1 / 3)
    slow.add_(expected, alpha=1 / 3)
    assert torch.equal(fast.view(torch.int32), slow.view(torch.int32))


# ---- frames: a payload carries its own bounded length -------------------------------------------


def test_frames_of_varying_length_assemble_and_a_longer_one_is_refused() -> None:
    x = heavy_tailed(20 * 64 + 9, seed=2)
    frames = list(encode_frames(x, codec=SMALL.spec, chunk_bytes=SMALL.payload_bytes(64) * 4, zstd_level=3))
    bounds = [SMALL.payload_bytes(min(256, x.numel() - 256 * i)) for i in range(len(frames))]
    assert len(frames) == 6 and all(f.raw_len <= b for f, b in zip(frames, bounds, strict=True))
    assert len({f.raw_len for f in frames[:-1]}) > 1  # sizes vary with the gaps
    asm = Assembler(n_elems=x.numel(), codec=SMALL.spec, chunk_bytes=SMALL.payload_bytes(64) * 4)
    for f in frames:
        asm.add_frame(f)
    assert torch.equal(asm.decode(), roundtrip(x, SMALL.spec))
    raw = decode_frame(frames[0].data, frames[0].compressed, expected_raw_len=bounds[0], exact=False)
    with pytest.raises(CodecError, match="at most"):
        decode_frame(raw + bytes(bounds[0] - len(raw) + 1), False, expected_raw_len=bounds[0], exact=False)
    fresh = Assembler(n_elems=x.numel(), codec=SMALL.spec, chunk_bytes=SMALL.payload_bytes(64) * 4)
    with pytest.raises(CodecError, match="at most"):
        fresh.add(0, raw + bytes(bounds[0]))


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.spec)
@pytest.mark.parametrize("chunk_bytes", [4096, 10_000, 1 << 20])
def test_a_receiver_cuts_the_chunks_its_sender_cut(codec: SparseCodec, chunk_bytes: int) -> None:
    """A receiver knows a stream's chunk_elements, not the sender's --chunk-bytes: the bound of
    a chunk is its blocks' bounds, so both cut the same ranges."""
    n = 300_000 * codec.block_elems + 7  # several chunks of every size here
    sent = chunk_ranges(n, codec.spec, chunk_bytes)
    assert len(sent) > 2
    got = receiving(codec=codec.spec, n_elems=n, chunk_elements=chunk_elements(codec.spec, chunk_bytes),
                    chunk_count=len(sent), shuffled=False)
    assert [got.chunk_elems(i) for i in range(got.count)] == [b - a for a, b in sent]
    assert all(codec.payload_bytes(b - a) <= chunk_bytes for a, b in sent)


def test_a_compressed_frame_declaring_more_than_the_bound_is_refused_before_decompressing() -> None:
    import zstandard as zstd

    bound = DEFAULT.payload_bytes(4096)
    packed = zstd.ZstdCompressor(level=3, write_content_size=True).compress(bytes(bound + 1))
    with pytest.raises(CodecError, match="declares"):
        decode_frame(packed, True, expected_raw_len=bound, exact=False)


# ---- error feedback with a decay -------------------------------------------------------------


def test_feedback_decays_what_stays_unsent_and_survives_a_state_dict() -> None:
    ef = ErrorFeedback(8, decay=0.95)
    ef.residual.copy_(torch.arange(8.0))
    delta = torch.ones(8)
    assert torch.equal(ef.compensate(delta), torch.add(delta, torch.arange(8.0), alpha=0.95))
    restored = ErrorFeedback(8, decay=0.95)
    restored.load_state_dict(ef.state_dict())
    assert torch.equal(restored.residual, ef.residual)
    with pytest.raises(CodecError, match="decay"):
        ErrorFeedback(8, decay=0.0)


def test_the_encoder_sends_what_it_kept_back_in_later_rounds() -> None:
    """A constant pseudo-gradient: with decay 1 what the wire lost is sent later, so the sum
    sent over R rounds is R × Δ minus one residual; with 0.95 the residual stays bounded."""
    delta = heavy_tailed(4 * 4096, seed=9)
    for decay in (1.0, 0.95):
        enc = ContributionEncoder(EncoderConfig(codec="sparse", chunk_bytes=1 << 20, zstd_level=0,
                                                byte_shuffle=False, feedback_decay=decay),
                                  n_elements=delta.numel(), sender_id="a")
        sent = torch.zeros_like(delta)
        for round_id in range(40):
            sent += enc.contribution(delta, [(0, delta.numel())], 0.0, weight=1.0, round_id=round_id).parts[0].data.decode()
        residual = enc.feedback.residual  # type: ignore[union-attr]
        if decay == 1.0:
            assert torch.allclose(sent + residual, 40 * delta, rtol=1e-4, atol=1e-3)
        assert float(residual.norm()) < 40 * float(delta.norm()) * (0.6 if decay == 1.0 else 0.35)


# ---- aggregation -----------------------------------------------------------------------------------


def test_the_default_aggregation_keeps_sparse_contributions() -> None:
    """The node's default aggregator over sparse contributions (decoded into dense float32
    vectors, zeros where a member kept nothing): every entry any member kept stays in the
    average, with that member's sign where it alone kept it. A coordinate-wise rule such as the
    median would erase them (the median of one value and two zeros is zero). The members share
    a direction under their own noise, as pseudo-gradients of one model do (one pointing against
    the sum of the others would be left out: tests/test_diloco_robust.py)."""
    from neuronode.config import NodeConfig
    from neuronode.node.trainer import make_aggregator

    aggregate = make_aggregator(NodeConfig(codec="sparse"))
    shared = heavy_tailed(3 * 4096, seed=100)
    members = {name: VectorEncoder(codec="sparse", chunk_bytes=1 << 20, zstd_level=0, byte_shuffle=False).encode(
        shared + heavy_tailed(3 * 4096, seed=i), 0.0, sender_id=name) for i, name in enumerate("abc")}
    decoded = {name: c.data.decode() for name, c in members.items()}
    result = aggregate({name: (c.data, 1.0 + i) for i, (name, c) in enumerate(members.items())})
    kept = [d != 0 for d in decoded.values()]
    union = kept[0] | kept[1] | kept[2]
    assert torch.equal(result != 0, union)
    alone = union & (torch.stack(kept).sum(dim=0) == 1)
    for d, k in zip(decoded.values(), kept, strict=True):
        assert torch.equal(result[alone & k].sign(), d[alone & k].sign())
