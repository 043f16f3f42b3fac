"""Unit tests of error feedback (neuronode.codec.feedback)."""

from __future__ import annotations

import pytest
import torch

from neuronode.codec import CodecError, ErrorFeedback, roundtrip

torch.set_num_threads(1)


def test_compensate_and_update() -> None:
    ef = ErrorFeedback(n_elems=3)
    delta = torch.tensor([1.0, 2.0, 3.0])
    assert torch.equal(ef.compensate(delta), delta)
    ef.update(delta, torch.tensor([1.0, 1.5, 3.5]))
    assert torch.equal(ef.residual, torch.tensor([0.0, 0.5, -0.5]))
    assert torch.equal(ef.compensate(delta), torch.tensor([1.0, 2.5, 2.5]))
    assert torch.equal(delta, torch.tensor([1.0, 2.0, 3.0]))  # input untouched


@pytest.mark.parametrize("codec", ["int4", "int8", "bf16"])
def test_feedback_keeps_sent_sum_close_to_true_sum(codec: str) -> None:
    g = torch.Generator().manual_seed(0)
    ef = ErrorFeedback(n_elems=4096)
    true_sum = torch.zeros(4096)
    sent_sum = torch.zeros(4096)
    for _ in range(20):
        delta = torch.randn(4096, generator=g) * 1e-2 + 1e-4  # small bias quantization would drop
        c = ef.compensate(delta)
        wire = roundtrip(c, codec)
        ef.update(c, wire)
        true_sum += delta
        sent_sum += wire
    # With feedback the gap is exactly the last residual: one round's error, not twenty.
    assert torch.allclose(true_sum - sent_sum, ef.residual, atol=1e-5)
    one_round = (ef.compensate(torch.zeros(4096)) - 0).abs().max()
    assert (true_sum - sent_sum).abs().max() <= one_round + 1e-5


def test_state_dict_roundtrip_and_validation() -> None:
    ef = ErrorFeedback(4)
    ef.update(torch.ones(4), torch.zeros(4))
    state = ef.state_dict()
    ef.reset()
    assert torch.equal(ef.residual, torch.zeros(4))
    ef.load_state_dict(state)
    assert torch.equal(ef.residual, torch.ones(4))
    state["residual"].zero_()  # state_dict is a copy
    assert torch.equal(ef.residual, torch.ones(4))
    with pytest.raises(CodecError, match="shape"):
        ef.load_state_dict({"residual": torch.zeros(5)})
    with pytest.raises(CodecError, match="residual"):
        ef.load_state_dict({})
    with pytest.raises(CodecError, match="delta"):
        ef.compensate(torch.zeros(4, dtype=torch.float64))


@pytest.mark.parametrize("codec", ["int8", "int4", "bf16"])
def test_update_parts_gives_update_bit_for_bit(codec: str) -> None:
    """Decoding the parts straight into the residual leaves exactly what update() would."""
    from neuronode.codec import VectorEncoder, shard_ranges

    x = torch.randn(5000, generator=torch.Generator().manual_seed(3))
    enc = VectorEncoder(codec=codec, chunk_bytes=1024, zstd_level=0, byte_shuffle=False)
    ranges = shard_ranges(x.numel(), 3, codec)
    parts = [enc.encode(x[a:b], 0.0) for a, b in ranges]
    slow, fast = ErrorFeedback(x.numel()), ErrorFeedback(x.numel())
    slow.update(x, torch.cat([p.data.decode() for p in parts]))
    fast.update_parts(x, [(a, p.data) for (a, _), p in zip(ranges, parts, strict=True)])
    assert torch.equal(slow.residual.view(torch.int32), fast.residual.view(torch.int32))
    assert slow.residual.abs().sum() > 0
    with pytest.raises(CodecError):  # parts that do not cover the vector change nothing
        fast.update_parts(x, [(0, parts[0].data)])
    assert torch.equal(slow.residual, fast.residual)
