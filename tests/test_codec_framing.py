"""Unit tests of chunking, zstd framing, digests and reassembly (neuronode.codec.framing)."""

from __future__ import annotations

import dataclasses
import time
import tracemalloc

import pytest
import torch
import zstandard as zstd
from hypothesis import given, settings
from hypothesis import strategies as st

from neuronode.codec import (
    CODECS,
    Assembler,
    CodecError,
    ContributionDigest,
    ContributionEncoder,
    EncoderConfig,
    Frame,
    Phase,
    chunk_ranges,
    contribution_digest,
    decode_frame,
    encode_frames,
    expected_raw_lens,
    get_codec,
    repack,
    roundtrip,
    shuffle_width,
)
from neuronode.diloco import get_aggregator

torch.set_num_threads(1)

FAST = settings(max_examples=40, deadline=None)
MiB = 1 << 20


def pseudo_grad(n: int, seed: int) -> torch.Tensor:
    """Gaussian with a run of zeros (frozen params) so some chunks compress and some do not."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 1e-3
    x[n // 3 : n // 2] = 0.0
    return x


def random_bits_f32(n: int, seed: int) -> torch.Tensor:
    """Finite float32 with (almost) uniformly random bytes: zstd cannot shrink these."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    inf_nan = ((bits >> 23) & 0xFF) == 0xFF
    bits = torch.where(inf_nan, bits ^ (1 << 23), bits)  # exponent 255 -> 254: finite
    return bits.view(torch.float32)


def assemble(
    frames: list[Frame], *, n: int, codec: str, chunk_bytes: int, shuffle: bool = False
) -> Assembler:
    asm = Assembler(n_elems=n, codec=codec, chunk_bytes=chunk_bytes, shuffle=shuffle)
    for f in frames:
        asm.add_frame(f)
    return asm


@FAST
@given(
    n=st.integers(0, 3000),
    chunk_bytes=st.integers(4, 5000),
    zstd_level=st.sampled_from([0, 1, 3]),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_fp32_chunk_reassemble_identity_any_order(
    n: int, chunk_bytes: int, zstd_level: int, shuffle: bool, seed: int, data: st.DataObject
) -> None:
    x = pseudo_grad(n, seed)
    frames = list(
        encode_frames(
            x, codec="fp32", chunk_bytes=chunk_bytes, zstd_level=zstd_level, shuffle=shuffle
        )
    )
    order = data.draw(st.permutations(frames))
    asm = assemble(order, n=n, codec="fp32", chunk_bytes=chunk_bytes, shuffle=shuffle)
    assert asm.complete
    assert torch.equal(asm.decode(), x)


@pytest.mark.parametrize("codec", CODECS)
@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 2000), chunk_bytes=st.integers(200, 3000), seed=st.integers(0, 2**16))
def test_assembled_equals_roundtrip_for_any_chunking(
    codec: str, n: int, chunk_bytes: int, seed: int
) -> None:
    x = pseudo_grad(n, seed)
    frames = list(
        encode_frames(x, codec=codec, chunk_bytes=chunk_bytes, zstd_level=1, shuffle=True)
    )
    asm = assemble(frames[::-1], n=n, codec=codec, chunk_bytes=chunk_bytes, shuffle=True)
    expected = get_codec(codec).decode(get_codec(codec).encode(x), n)
    assert torch.equal(asm.decode(), expected)
    assert torch.equal(roundtrip(x, codec, chunk_elems=100), expected)


@pytest.mark.parametrize("codec", CODECS)
@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 3000), chunk_bytes=st.integers(200, 3000), seed=st.integers(0, 2**16),
       alpha=st.floats(0.01, 1.0))
def test_add_into_equals_adding_the_decoded_vector(
    codec: str, n: int, chunk_bytes: int, seed: int, alpha: float
) -> None:
    """The reducer adds received chunks straight into the accumulator: bit for bit what adding
    the whole decoded vector gives, so replicas that average either way agree."""
    frames = list(encode_frames(pseudo_grad(n, seed), codec=codec, chunk_bytes=chunk_bytes, zstd_level=1))
    asm = assemble(frames, n=n, codec=codec, chunk_bytes=chunk_bytes)
    start = pseudo_grad(n, seed + 1)
    streamed, whole = start.clone(), start.clone()
    asm.add_into(streamed, alpha)
    whole.add_(asm.decode(), alpha=alpha)
    assert torch.equal(streamed, whole)


def test_average_of_assemblers_matches_average_of_vectors() -> None:
    """diloco.average takes Assemblers (added chunk by chunk, the mean) and the robust rules
    call them for whole vectors; both give what the decoded vectors give."""
    n, senders = 5000, ["c", "a", "b"]
    parts = {s: assemble(list(encode_frames(pseudo_grad(n, i), codec="int8", chunk_bytes=700, zstd_level=0)),
                         n=n, codec="int8", chunk_bytes=700) for i, s in enumerate(senders)}
    weights = {"a": 1.0, "b": 3.0, "c": 2.0}
    for name in ("mean", "median", "norm-clip"):  # norm-clip streams too: decoded into one buffer, then added
        aggregate = get_aggregator(name)
        streamed = aggregate({s: (parts[s], weights[s]) for s in senders})
        decoded = aggregate({s: (parts[s].decode(), weights[s]) for s in senders})
        assert torch.equal(streamed, decoded), name
    with pytest.raises(CodecError, match="add_into needs"):
        parts["a"].add_into(torch.zeros(n + 1), 1.0)
    short = Assembler(n_elems=n, codec="int8", chunk_bytes=700)
    with pytest.raises(CodecError, match="incomplete"):
        short.add_into(torch.zeros(n), 1.0)


@pytest.mark.parametrize("codec", CODECS)
@FAST
@given(n=st.integers(0, 5000), chunk_bytes=st.integers(1, 4000))
def test_chunk_ranges_cover_align_and_bound(codec: str, n: int, chunk_bytes: int) -> None:
    c = get_codec(codec)
    if chunk_bytes < c.payload_bytes(c.block_elems):
        with pytest.raises(CodecError, match="chunk_bytes"):
            chunk_ranges(n, codec, chunk_bytes)
        return
    ranges = chunk_ranges(n, codec, chunk_bytes)
    bounds = [0] + [b for _, b in ranges]
    assert [a for a, _ in ranges] == bounds[:-1] and bounds[-1] == n  # contiguous, covering
    assert all(a % c.block_elems == 0 and b > a for a, b in ranges)
    assert all(c.payload_bytes(b - a) <= chunk_bytes for a, b in ranges)
    assert expected_raw_lens(n, codec, chunk_bytes) == [c.payload_bytes(b - a) for a, b in ranges]


def test_default_chunk_is_about_one_mib() -> None:
    for codec in CODECS:
        ranges = chunk_ranges(100_000_000, codec, MiB)
        full = get_codec(codec).payload_bytes(ranges[0][1])
        assert MiB - 100 <= full <= MiB, codec


def test_frames_fields_and_compression_only_when_smaller() -> None:
    x = torch.cat([torch.zeros(1024), random_bits_f32(2048, seed=0)])  # compressible, then not
    frames = list(encode_frames(x, codec="fp32", chunk_bytes=2048, zstd_level=3))
    lens = expected_raw_lens(3072, "fp32", 2048)
    assert [f.index for f in frames] == list(range(len(lens)))
    assert all(f.count == len(lens) and f.raw_len == lens[f.index] for f in frames)
    assert [f.compressed for f in frames] == [True, True, False, False, False, False]
    assert all(len(f.data) < f.raw_len for f in frames if f.compressed)
    assert all(len(f.data) == f.raw_len for f in frames if not f.compressed)
    assert not any(
        f.compressed for f in encode_frames(x, codec="fp32", chunk_bytes=2048, zstd_level=0)
    )


@pytest.mark.parametrize("codec", CODECS)
def test_frames_are_deterministic(codec: str) -> None:
    x = pseudo_grad(5000, seed=1)
    kw = {"codec": codec, "chunk_bytes": 3000, "zstd_level": 3, "shuffle": True}
    assert list(encode_frames(x, **kw)) == list(encode_frames(x.clone(), **kw))  # type: ignore[arg-type]


def test_encode_frames_is_lazy_and_validates() -> None:
    x = pseudo_grad(1000, seed=2)
    x[900] = float("nan")
    gen = encode_frames(x, codec="int8", chunk_bytes=340, zstd_level=1)
    assert next(gen).index == 0  # the NaN chunk is not encoded yet
    with pytest.raises(CodecError, match="NaN"):
        list(gen)
    with pytest.raises(CodecError, match="zstd_level"):
        next(encode_frames(x, codec="int8", chunk_bytes=340, zstd_level=23))
    with pytest.raises(CodecError, match="unknown codec"):
        next(encode_frames(x, codec="fp8", chunk_bytes=340, zstd_level=1))


def test_empty_contribution() -> None:
    assert list(encode_frames(torch.zeros(0), codec="int8", chunk_bytes=MiB, zstd_level=3)) == []
    asm = Assembler(n_elems=0, codec="int8", chunk_bytes=MiB)
    assert asm.complete and asm.count == 0 and asm.decode().shape == (0,)


# --- Assembler rejections -------------------------------------------------------------------


@pytest.fixture
def int8_frames() -> list[Frame]:
    return list(
        encode_frames(pseudo_grad(1000, seed=4), codec="int8", chunk_bytes=340, zstd_level=1)
    )


def new_asm() -> Assembler:
    return Assembler(n_elems=1000, codec="int8", chunk_bytes=340)


def raw(f: Frame) -> bytes:
    return decode_frame(f.data, f.compressed, expected_raw_len=f.raw_len)


def test_assembler_rejects_duplicates(int8_frames: list[Frame]) -> None:
    asm = new_asm()
    asm.add(1, raw(int8_frames[1]))
    with pytest.raises(CodecError, match="duplicate chunk 1"):
        asm.add(1, raw(int8_frames[1]))
    with pytest.raises(CodecError, match="duplicate chunk 1"):
        asm.add_frame(int8_frames[1])


@pytest.mark.parametrize("index", [-1, 4, 10**9])
def test_assembler_rejects_out_of_range(int8_frames: list[Frame], index: int) -> None:
    asm = new_asm()
    assert asm.count == 4
    with pytest.raises(CodecError, match="out of range"):
        asm.add(index, raw(int8_frames[0]))
    with pytest.raises(CodecError, match="out of range"):
        asm.add_frame(dataclasses.replace(int8_frames[0], index=index))


def test_assembler_rejects_wrong_lengths(int8_frames: list[Frame]) -> None:
    asm = new_asm()
    good = raw(int8_frames[0])
    for bad in (good[:-1], good + b"\0", b"", raw(int8_frames[3])):  # last chunk is shorter
        with pytest.raises(CodecError, match="chunk 0 has"):
            asm.add(0, bad)
    with pytest.raises(CodecError, match="raw_len"):
        asm.add_frame(dataclasses.replace(int8_frames[0], raw_len=good.__len__() + 1))
    with pytest.raises(CodecError, match="chunks"):
        asm.add_frame(dataclasses.replace(int8_frames[0], count=5))
    truncated = int8_frames[0].data[:-3]
    with pytest.raises(CodecError):
        asm.add_frame(dataclasses.replace(int8_frames[0], data=truncated))
    assert asm.missing() == [0, 1, 2, 3] and asm.held_bytes == 0  # nothing bad was kept


def test_assembler_incomplete_cannot_decode(int8_frames: list[Frame]) -> None:
    asm = new_asm()
    for f in int8_frames[:3]:
        asm.add_frame(f)
    assert not asm.complete and asm.missing() == [3]
    with pytest.raises(CodecError, match="1 chunks missing"):
        asm.decode()
    with pytest.raises(CodecError, match="incomplete"):
        asm.digest()


def test_assembler_holds_quantized_bytes(int8_frames: list[Frame]) -> None:
    asm = assemble(int8_frames, n=1000, codec="int8", chunk_bytes=340)
    assert asm.held_bytes == get_codec("int8").payload_bytes(1000) < 1.1 * 1000


# --- digests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["fp32", "int4"])
def test_digest_independent_of_compression_and_order(codec: str) -> None:
    x = pseudo_grad(4000, seed=5)
    sent = ContributionDigest()
    frames = list(
        encode_frames(x, codec=codec, chunk_bytes=1000, zstd_level=3, shuffle=True, digest=sent)
    )
    asm = assemble(frames[::-1], n=4000, codec=codec, chunk_bytes=1000, shuffle=True)
    assert asm.digest() == sent.hexdigest() == contribution_digest(x, codec=codec, chunk_bytes=1000)


def test_digest_mismatch_is_detectable(int8_frames: list[Frame]) -> None:
    sent = contribution_digest(pseudo_grad(1000, seed=4), codec="int8", chunk_bytes=340)
    asm = new_asm()
    for f in int8_frames:
        payload = raw(f)
        if f.index == 2:  # one flipped bit in the codes of one chunk
            payload = payload[:-1] + bytes([payload[-1] ^ 1])
        asm.add(f.index, payload)
    assert asm.digest() != sent


# --- decode_frame and zstd bombs --------------------------------------------------------------


def zeros_frame(total_bytes: int, *, declare_size: bool) -> bytes:
    """A zstd frame of ``total_bytes`` zeros, built in 1 MiB pieces (never 100 MB in memory)."""
    cobj = zstd.ZstdCompressor(level=1).compressobj(size=total_bytes if declare_size else -1)
    piece = bytes(MiB)
    out = [cobj.compress(piece[: min(MiB, total_bytes - i)]) for i in range(0, total_bytes, MiB)]
    return b"".join(out) + cobj.flush()


@pytest.fixture(scope="module")
def bomb() -> bytes:
    return zeros_frame(100_000_000, declare_size=True)


def test_zstd_bomb_is_rejected_without_allocating(bomb: bytes) -> None:
    assert len(bomb) < 64_000 and zstd.frame_content_size(bomb) == 100_000_000
    tracemalloc.start()
    t0 = time.perf_counter()
    with pytest.raises(CodecError, match="declares 100000000 bytes"):
        decode_frame(bomb, True, expected_raw_len=MiB)
    elapsed = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert elapsed < 0.5 and peak < 4 * MiB


def test_zstd_bomb_with_lying_header_stays_bounded(bomb: bytes) -> None:
    # Patch the 4-byte content-size field (right after magic, descriptor, window byte) to 64 KiB.
    assert bomb[4] >> 6 == 2 and not bomb[4] & 0x20  # 4-byte FCS, window descriptor present
    lying = bomb[:6] + (64 * 1024).to_bytes(4, "little") + bomb[10:]
    assert zstd.frame_content_size(lying) == 64 * 1024
    tracemalloc.start()
    with pytest.raises(CodecError, match="corrupt"):
        decode_frame(lying, True, expected_raw_len=64 * 1024)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 4 * MiB


def test_frame_without_content_size_is_rejected() -> None:
    frame = zeros_frame(100_000, declare_size=False)
    with pytest.raises(CodecError, match="declares -1 bytes"):
        decode_frame(frame, True, expected_raw_len=100_000)


def test_decode_frame_rejects_malformed() -> None:
    payload = bytes(5000)
    frame = zstd.ZstdCompressor(level=3).compress(payload)
    assert decode_frame(frame, True, expected_raw_len=5000) == payload
    cases = [
        (frame + b"junk", 5000, "corrupt"),  # trailing data
        (frame[:-2], 5000, "corrupt"),  # truncated
        (frame, 4999, "declares 5000"),
        (b"\x00" * 10, 5000, "header"),
        (b"", 5000, "header"),
        (payload, 5000, "not smaller"),  # 'compressed' frame as large as its payload
    ]
    for data, expected, msg in cases:
        with pytest.raises(CodecError, match=msg):
            decode_frame(data, True, expected_raw_len=expected)
    with pytest.raises(CodecError, match="raw frame is 5000 bytes, expected 4999"):
        decode_frame(payload, False, expected_raw_len=4999)


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8"])
def test_shuffle_roundtrip_and_width(codec: str) -> None:
    x = pseudo_grad(2048, seed=6)
    width = shuffle_width(codec, True)
    assert shuffle_width(codec, False) == 1 and width == get_codec(codec).shuffle_width
    raw_payload = get_codec(codec).encode(x)
    for f in encode_frames(
        x, codec=codec, chunk_bytes=len(raw_payload), zstd_level=3, shuffle=True
    ):
        assert (
            decode_frame(f.data, f.compressed, expected_raw_len=f.raw_len, shuffle_width=width)
            == raw_payload
        )


@pytest.mark.parametrize(("link", "compress", "saved", "capped", "level"), [
    (0.0, 500e6, 0.2, False, 1),      # nothing measured yet: level 1, to measure
    (1e9, 500e6, 0.2, False, 0),      # loopback: zstd would cost 2 ns/B to save 0.2 ns/B
    (50e6, 500e6, 0.2, False, 1),     # 400 Mbit/s: 2 ns/B to save 4 ns/B
    (50e6, 500e6, 0.05, False, 0),    # saves too little to pay even there
    (2.5e6, 500e6, 0.2, True, 3),     # a 20 Mbit/s cap: compress harder
    (2.5e6, 500e6, 0.2, False, 1),    # slow but not capped: the rate may be a busy receiver
])
def test_auto_zstd_level_weighs_time_saved_against_time_spent(
        link: float, compress: float, saved: float, capped: bool, level: int) -> None:
    from neuronode.codec import auto_zstd_level

    assert auto_zstd_level(link, compress, capped=capped, saved_fraction=saved) == level


def test_encoder_learns_what_zstd_saves_and_stops_when_it_does_not_pay() -> None:
    from neuronode.codec import AUTO_ZSTD, VectorEncoder

    enc = VectorEncoder(codec="fp32", chunk_bytes=1 << 16, zstd_level=AUTO_ZSTD, byte_shuffle=True)
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(1))
    first = enc.encode(x, 0.0)
    assert first.zstd_level == 1 and enc.compress_rate > 0
    assert 0.0 <= enc.saved_fraction < 0.5  # random floats: the byte planes help a little
    fast_link = enc.compress_rate * enc.saved_fraction * 2 + 1.0
    assert enc.encode(x, fast_link).zstd_level == 0


@pytest.mark.parametrize("codec,shuffle", [("fp32", True), ("bf16", True), ("bf16", False), ("int8", True)])
def test_a_held_chunk_repacked_decodes_to_its_raw_payload(codec: str, shuffle: bool) -> None:
    """What a holder serves and a relay forwards: the raw payload compressed again (smaller for
    float codecs), which the receiver decodes back bit for bit."""
    x = torch.randn(20_000, generator=torch.Generator().manual_seed(3)) * 1e-3
    (frame,) = list(encode_frames(x, codec=codec, chunk_bytes=1 << 20, zstd_level=0))
    raw = frame.data
    data, compressed = repack(raw, width=shuffle_width(codec, shuffle), zstd_level=1)
    assert decode_frame(data, compressed, expected_raw_len=len(raw),
                        shuffle_width=shuffle_width(codec, shuffle)) == raw
    if codec in ("fp32", "bf16"):
        assert compressed and len(data) < len(raw)
    assert repack(raw, width=1, zstd_level=0) == (raw, False)


def test_a_reducer_whose_average_is_not_finite_sends_a_zero_shard() -> None:
    """An aggregate that overflows (finite pieces, an infinite average) never reaches the wire:
    the reducer sends a zero shard, with the round's weight and contributors."""
    n = 5000
    encoder = ContributionEncoder(EncoderConfig(codec="fp32", chunk_bytes=4096, zstd_level=0, byte_shuffle=False),
                                  n_elements=n, sender_id="a")
    pieces = {s: encoder.vector.encode(torch.full((n,), 3e38), 0.0, weight=1.0, sender_id=s) for s in ("a", "b")}

    def overflowing(got):  # noqa: ANN001, ANN202
        out = torch.zeros(n)
        for data, _ in got.values():
            out += data.decode()
        return out

    shard = encoder.reduce(overflowing, pieces, 0.0, round_id=4)
    assert torch.isinf(overflowing({s: (c.data, c.weight) for s, c in pieces.items()})).all()
    assert (shard.phase, shard.round_id, shard.weight, shard.contributors) == (Phase.AVERAGED, 4, 2.0, ("a", "b"))
    assert torch.equal(shard.data.decode(), torch.zeros(n))
