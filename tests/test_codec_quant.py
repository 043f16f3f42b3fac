"""Unit tests of every codec (neuronode.codec.quant, and what holds of the sparse codec too:\ntests/test_codec_sparse.py has its own)."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from neuronode.codec import BLOCK_ELEMS, CODECS, CodecError, check_finite, get_codec

torch.set_num_threads(1)

FAST = settings(max_examples=40, deadline=None)
f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


def heavy_tailed(n: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Student-t-like vector (df=3): mostly small values and a few large outliers."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, generator=g)
    chi = torch.randn(n, 3, generator=g).pow(2).sum(dim=1)
    return (z / torch.sqrt(chi / 3) * scale).to(torch.float32)


def block_scales(x: torch.Tensor, qmax: int) -> torch.Tensor:
    """Per-element scale of the block holding it, recomputed independently of the codec."""
    n = x.numel()
    nb = -(-n // BLOCK_ELEMS)
    padded = torch.zeros(nb * BLOCK_ELEMS)
    padded[:n] = x
    s = padded.view(nb, BLOCK_ELEMS).abs().amax(dim=1) / qmax
    return s.repeat_interleave(BLOCK_ELEMS)[:n]


@pytest.mark.parametrize("name", CODECS)
@FAST
@given(n=st.integers(0, 3 * BLOCK_ELEMS + 7), seed=st.integers(0, 2**16))
def test_payload_bytes_exact(name: str, n: int, seed: int) -> None:
    """Exact for fixed-size codecs; the sparse codec's size varies within its bounds."""
    codec = get_codec(name)
    buf = codec.encode(heavy_tailed(n, seed))
    if codec.exact_size:
        assert len(buf) == codec.payload_bytes(n)
    else:
        assert codec.min_payload_bytes(n) <= len(buf) <= codec.payload_bytes(n)  # type: ignore[attr-defined]
    assert codec.decode(buf, n).shape == (n,)


def test_bytes_per_param_targets() -> None:
    n = 1 << 20
    assert get_codec("int8").payload_bytes(n) / n <= 1.1
    assert get_codec("int4").payload_bytes(n) / n <= 0.6
    assert get_codec("fp32").payload_bytes(n) == 4 * n
    assert get_codec("bf16").payload_bytes(n) == get_codec("fp16").payload_bytes(n) == 2 * n


@pytest.mark.parametrize(("name", "qmax"), [("int8", 127), ("int4", 7)])
@FAST
@given(values=st.lists(f32, max_size=2 * BLOCK_ELEMS + 3))
@example(values=[3.4028234663852886e38, -1.0])  # scale must not overflow on decode
@example(values=[1e-44, -3e-45])  # absmax / qmax underflows to 0
def test_int_error_bound_arbitrary_floats(name: str, qmax: int, values: list[float]) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    y = get_codec(name).decode(get_codec(name).encode(x), x.numel())
    assert bool(torch.isfinite(y).all())
    err = (x.double() - y.double()).abs()
    # eps: relative for the float32 division, absolute for subnormal blocks whose absmax/qmax
    # underflows (their error is a few subnormal ulps).
    bound = block_scales(x, qmax).double() * (0.5 + 1e-5) + 1e-43
    assert bool((err <= bound).all())


@pytest.mark.parametrize(("name", "qmax"), [("int8", 127), ("int4", 7)])
@FAST
@given(
    n=st.integers(1, 1000),
    seed=st.integers(0, 2**16),
    scale=st.sampled_from([1e-30, 1e-6, 1.0, 1e20]),
)
def test_int_error_bound_heavy_tails(name: str, qmax: int, n: int, seed: int, scale: float) -> None:
    x = heavy_tailed(n, seed, scale)
    y = get_codec(name).decode(get_codec(name).encode(x), n)
    err = (x.double() - y.double()).abs()
    assert bool((err <= block_scales(x, qmax).double() * (0.5 + 1e-5)).all())


@FAST
@given(values=st.lists(st.floats(-65504, 65504, width=32), max_size=300))
def test_fp16_matches_torch_cast(values: list[float]) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    y = get_codec("fp16").decode(get_codec("fp16").encode(x), x.numel())
    assert torch.equal(y, x.to(torch.float16).to(torch.float32))


@FAST
@given(values=st.lists(f32, max_size=300))
def test_bf16_matches_torch_cast(values: list[float]) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    x = x[x.to(torch.bfloat16).isfinite()]  # the rest saturates, see below
    y = get_codec("bf16").decode(get_codec("bf16").encode(x), x.numel())
    assert torch.equal(y, x.to(torch.bfloat16).to(torch.float32))


def test_bf16_wire_layout_is_little_endian_bits() -> None:
    buf = get_codec("bf16").encode(torch.tensor([1.0, -2.0]))
    assert buf == struct.pack("<HH", 0x3F80, 0xC000)


def test_fp16_saturates_instead_of_overflowing() -> None:
    x = torch.tensor([1e6, -1e6, 65519.0, 1.0])
    y = get_codec("fp16").decode(get_codec("fp16").encode(x), 4)
    assert y.tolist() == [65504.0, -65504.0, 65504.0, 1.0]
    bf16_max = float(torch.finfo(torch.bfloat16).max)
    x = torch.tensor([3.4028234663852886e38, -3.4e38, 1.0])
    y = get_codec("bf16").decode(get_codec("bf16").encode(x), 3)
    assert y.tolist() == [bf16_max, -bf16_max, 1.0]


@FAST
@given(values=st.lists(f32, max_size=200))
def test_fp32_is_exact(values: list[float]) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    assert torch.equal(get_codec("fp32").decode(get_codec("fp32").encode(x), x.numel()), x)


@pytest.mark.parametrize("name", CODECS)
def test_encode_is_deterministic(name: str) -> None:
    x = heavy_tailed(777, seed=3)
    assert get_codec(name).encode(x) == get_codec(name).encode(x.clone())


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("delta", [-1, 1])
def test_wrong_length_raises(name: str, delta: int) -> None:
    codec = get_codec(name)
    buf = codec.encode(heavy_tailed(130, seed=1))
    bad = buf[:delta] if delta < 0 else buf + b"\0"
    with pytest.raises(CodecError, match="bytes"):
        codec.decode(bad, 130)
    # A sparse payload's length fixes its blocks, not n: 131 elements take the same sections.
    with pytest.raises(CodecError):
        codec.decode(buf, 131 if codec.exact_size else 130 + codec.block_elems)
    with pytest.raises(CodecError):
        codec.decode(buf, -1)


@pytest.mark.parametrize("name", CODECS)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_garbage_of_right_length_never_crashes(name: str, data: st.DataObject) -> None:
    codec = get_codec(name)
    n = data.draw(st.integers(0, 200))
    buf = data.draw(st.binary(min_size=codec.payload_bytes(n), max_size=codec.payload_bytes(n)))
    try:
        y = codec.decode(buf, n)
    except CodecError:
        return
    assert y.shape == (n,) and bool(torch.isfinite(y).all())


def _refuses(fn: object, *args: object) -> bool:
    try:
        fn(*args)  # type: ignore[operator]
    except CodecError:
        return True
    return False


# Payloads with values that decode to NaN/Inf or sit at the edges: an Inf/NaN float, a scale
# whose product with a large code overflows, one whose products stay just finite.
EDGE_WORDS = [struct.pack("<f", v) for v in (math.inf, -math.nan, 3.0e38, 2.6e36, 2.7e36, 1.0)]


@pytest.mark.parametrize("name", CODECS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_check_payload_refuses_exactly_what_decode_refuses(name: str, data: st.DataObject) -> None:
    """Receivers vet chunks with check_payload and decode only later: the two must agree on
    every payload, honest, random or hostile."""
    codec = get_codec(name)
    n = data.draw(st.integers(0, 200))
    size = codec.payload_bytes(n)
    parts = data.draw(st.lists(st.one_of(st.sampled_from(EDGE_WORDS), st.binary(min_size=1, max_size=8),
                                         st.just(b"\x80" * 8), st.just(b"\x7f" * 8)), max_size=64))
    buf = (b"".join(parts) + data.draw(st.binary(min_size=size, max_size=size)))[:size]
    assert _refuses(codec.check_payload, buf, n) == _refuses(codec.decode, buf, n)


@pytest.mark.parametrize("name", CODECS)
def test_check_payload_accepts_honest_payloads_and_checks_length(name: str) -> None:
    codec = get_codec(name)
    x = torch.randn(300) * 1e-3
    x[7] = 3.0e38 if name in ("fp32", "bf16", "int8", "int4") else 6.0e4  # near the codec's range end
    buf = codec.encode(x)
    codec.check_payload(buf, 300)
    with pytest.raises(CodecError):
        codec.check_payload(buf[:-1], 300)


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_encode_rejects_non_finite(name: str, bad: float) -> None:
    with pytest.raises(CodecError, match="NaN or Inf"):
        get_codec(name).encode(torch.tensor([0.0, bad, 1.0]))


def test_decode_rejects_non_finite_payloads() -> None:
    with pytest.raises(CodecError):
        get_codec("fp32").decode(struct.pack("<ff", 1.0, math.nan), 2)
    with pytest.raises(CodecError):
        get_codec("bf16").decode(struct.pack("<H", 0x7F80), 1)  # bf16 +Inf
    bad_scale = struct.pack("<f", math.inf) + bytes(BLOCK_ELEMS)
    with pytest.raises(CodecError):
        get_codec("int8").decode(bad_scale, BLOCK_ELEMS)


@pytest.mark.parametrize("name", CODECS)
def test_encode_rejects_bad_shape_and_dtype(name: str) -> None:
    with pytest.raises(CodecError):
        get_codec(name).encode(torch.zeros(2, 3))
    with pytest.raises(CodecError):
        get_codec(name).encode(torch.zeros(4, dtype=torch.float64))


def test_zero_blocks_and_odd_int4_lengths() -> None:
    x = torch.zeros(2 * BLOCK_ELEMS + 1)
    x[-1] = 3.5
    for name in ("int8", "int4"):
        buf = get_codec(name).encode(x)
        assert buf[:4] == bytes(4)  # a zero block's scale is +0.0, never -0.0
        y = get_codec(name).decode(buf, x.numel())
        assert torch.equal(y, x)  # zero blocks stay exactly zero; absmax is exact
        assert not bool(torch.signbit(y).any())


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", [0, 130, 4 * BLOCK_ELEMS - 1])
def test_encode_rejects_non_finite_anywhere_in_whole_blocks(name: str, bad: float, where: int) -> None:
    """Whole blocks (no padding) and values beyond the 16-bit formats' range next to the bad one:
    the encoders check finiteness in the passes they make anyway, so every path must see it."""
    x = torch.linspace(-1.0, 1.0, 4 * BLOCK_ELEMS)
    x[1] = 1e38  # out of fp16/bf16 range: those encoders take the clamping path
    x[where] = bad
    with pytest.raises(CodecError, match="NaN or Inf"):
        get_codec(name).encode(x)


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_half_encoders_saturate_out_of_range_values(name: str) -> None:
    codec = get_codec(name)
    limit = torch.finfo(codec.dtype).max
    x = torch.tensor([3.0e38, -3.0e38, 1.0, -2.5])
    y = codec.decode(codec.encode(x), 4)
    expected = torch.tensor([min(3.0e38, limit), max(-3.0e38, -limit), 1.0, -2.5]).to(codec.dtype).float()
    assert torch.equal(y, expected)


def test_unknown_codec_and_check_finite() -> None:
    with pytest.raises(CodecError, match="choose one of"):
        get_codec("int3")
    check_finite(torch.tensor([1.0, -2.0]))
    check_finite(torch.tensor([]))
    with pytest.raises(CodecError):
        check_finite(torch.tensor([1.0, math.nan]))
    assert issubclass(CodecError, ValueError)


@pytest.mark.parametrize("name", CODECS)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_decode_into_gives_decode_bit_for_bit(name: str, data: st.DataObject) -> None:
    """decode_into is the receivers' fast path: same bits as decode, same refusals."""
    codec = get_codec(name)
    n = data.draw(st.sampled_from([0, 1, 63, 64, 128, 200, 640]))
    if data.draw(st.booleans()):
        scale = data.draw(st.sampled_from([1e-30, 1e-3, 1.0, 1e30]))
        buf = codec.encode(torch.randn(n, generator=torch.Generator().manual_seed(n)) * scale)
    else:
        buf = data.draw(st.binary(min_size=codec.payload_bytes(n), max_size=codec.payload_bytes(n)))
    out = torch.full((n,), 7.0)
    if _refuses(codec.decode, buf, n):
        assert _refuses(codec.decode_into, buf, n, out)
        return
    codec.decode_into(buf, n, out)
    assert torch.equal(out.view(torch.int32), codec.decode(buf, n).view(torch.int32))


@pytest.mark.parametrize("name", CODECS)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_add_into_gives_decode_then_add_bit_for_bit(name: str, data: st.DataObject) -> None:
    """add_into is the reducers' fast path (16-bit codecs add the wire values without a decoded
    copy): same bits as decode() then add_, same refusals, for any payload bytes."""
    codec = get_codec(name)
    n = data.draw(st.sampled_from([0, 1, 63, 64, 128, 200, 640]))
    buf = data.draw(st.binary(min_size=codec.payload_bytes(n), max_size=codec.payload_bytes(n)))
    alpha = data.draw(st.sampled_from([1.0, 0.5, 1 / 3, 0.1, 1e-7]))
    acc = torch.randn(n, generator=torch.Generator().manual_seed(n)) * data.draw(st.sampled_from([1e-30, 1.0, 1e30]))
    if _refuses(codec.decode, buf, n):
        assert _refuses(codec.add_into, buf, n, acc.clone(), alpha)
        return
    fast, expected = acc.clone(), acc.clone()
    codec.add_into(buf, n, fast, alpha)
    expected.add_(codec.decode(buf, n), alpha=alpha)
    assert torch.equal(fast.view(torch.int32), expected.view(torch.int32))


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), max_size=300))
def test_all_finite_agrees_with_isfinite(values: list[float]) -> None:
    """The sum shortcut never hides a NaN or Inf, and an overflowing sum of finite values is
    still finite element-wise."""
    import numpy as np

    from neuronode.codec.quant import all_finite

    a = np.array(values, dtype=np.float32)
    assert all_finite(a) == bool(np.isfinite(a).all())
    big = np.full(8, 3.0e38, dtype=np.float32)  # sums to Inf, every element finite
    assert all_finite(big)
