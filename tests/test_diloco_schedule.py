"""The inner learning-rate schedule: warm-up from above zero, cosine to a floor, flat after."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from neuronode.diloco import lr_at

BASE: dict[str, Any] = {
    "base_lr": 1e-3,
    "warmup_steps": 10,
    "total_steps": 100,
    "min_lr_ratio": 0.1,
}


def test_warmup_starts_above_zero() -> None:
    assert lr_at(0, **BASE) == pytest.approx(1e-3 / 10)
    assert lr_at(0, **BASE) > 0


def test_warmup_is_linear_and_increasing() -> None:
    rates = [lr_at(s, **BASE) for s in range(10)]
    assert rates == pytest.approx([1e-3 * (s + 1) / 10 for s in range(10)])
    assert all(a < b for a, b in zip(rates, rates[1:], strict=False))


def test_peak_at_warmup_end() -> None:
    assert lr_at(9, **BASE) == pytest.approx(1e-3)
    assert lr_at(10, **BASE) == pytest.approx(1e-3)
    assert max(lr_at(s, **BASE) for s in range(200)) == pytest.approx(1e-3)


def test_min_at_end_and_flat_after() -> None:
    assert lr_at(100, **BASE) == pytest.approx(1e-4)
    assert lr_at(99, **BASE) > 1e-4
    assert lr_at(10_000, **BASE) == pytest.approx(1e-4)


def test_cosine_midpoint() -> None:
    # Halfway through the decay the cosine factor is exactly 0.5.
    assert lr_at(55, **BASE) == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4))


def test_decay_is_non_increasing() -> None:
    rates = [lr_at(s, **BASE) for s in range(10, 120)]
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))


def test_no_warmup_starts_at_base() -> None:
    assert lr_at(0, base_lr=0.5, warmup_steps=0, total_steps=10, min_lr_ratio=0.0) == 0.5
    assert lr_at(10, base_lr=0.5, warmup_steps=0, total_steps=10, min_lr_ratio=0.0) == 0.0


@pytest.mark.parametrize(
    "step, overrides",
    [
        (-1, {}),
        (0, {"base_lr": 0.0}),
        (0, {"warmup_steps": -1}),
        (0, {"total_steps": 5}),
        (0, {"min_lr_ratio": 1.5}),
        (0, {"min_lr_ratio": -0.1}),
    ],
)
def test_invalid_arguments_raise(step: int, overrides: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        lr_at(step, **{**BASE, **overrides})


@given(
    step=st.integers(0, 10_000),
    warmup=st.integers(0, 500),
    extra=st.integers(0, 5_000),
    ratio=st.floats(0.0, 1.0),
)
def test_rate_stays_between_floor_and_peak(
    step: int, warmup: int, extra: int, ratio: float
) -> None:
    base = 3e-3
    rate = lr_at(
        step, base_lr=base, warmup_steps=warmup, total_steps=warmup + extra, min_lr_ratio=ratio
    )
    assert math.isfinite(rate)
    assert 0 < rate or base * ratio < 1e-300  # only an underflowing floor may reach 0
    assert rate <= base * (1 + 1e-12)
    if step >= warmup:
        assert rate >= base * ratio * (1 - 1e-12)
