"""Aggregation of pseudo-gradients: deterministic, weighted, lazily decoded, strict."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from neuronode.diloco import Weighted, available_aggregators, average, get_aggregator


def _vec(seed: int, n: int = 257) -> Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def test_mapping_order_does_not_change_bits() -> None:
    items = [(f"peer-{i}", (_vec(i), float(i + 1) * 0.37)) for i in range(6)]
    forward = average(dict(items))
    backward = average(dict(reversed(items)))
    shuffled = average(dict(items[3:] + items[:3]))
    assert torch.equal(forward, backward)
    assert torch.equal(forward, shuffled)


def test_single_contributor_returned_exactly() -> None:
    vector = _vec(7) * 1e-3
    result = average({"only": (vector, 123.456)})
    assert torch.equal(result, vector)
    assert result.data_ptr() != vector.data_ptr()  # a fresh tensor, never the input


def test_weights_are_honoured() -> None:
    a, b = _vec(1), _vec(2)
    result = average({"a": (a, 1.0), "b": (b, 3.0)})
    torch.testing.assert_close(result, (a + 3 * b) / 4)


def test_equal_weights_give_plain_mean() -> None:
    vectors = [_vec(i) for i in range(4)]
    result = average({str(i): (v, 5.0) for i, v in enumerate(vectors)})
    torch.testing.assert_close(result, torch.stack(vectors).mean(0))


def test_lazy_callables_are_called_once_and_match_eager() -> None:
    calls: list[str] = []

    def loader(name: str, seed: int) -> Callable[[], Tensor]:
        def load() -> Tensor:
            calls.append(name)
            return _vec(seed)

        return load

    lazy: dict[str, Weighted] = {"b": (loader("b", 2), 2.0), "a": (loader("a", 1), 1.0)}
    eager: dict[str, Weighted] = {"b": (_vec(2), 2.0), "a": (_vec(1), 1.0)}
    mixed: dict[str, Weighted] = {"b": (_vec(2), 2.0), "a": (loader("a", 1), 1.0)}
    assert torch.equal(average(lazy), average(eager))
    assert calls == ["a", "b"]  # sorted order, one decode each
    assert torch.equal(average(mixed), average(eager))


def test_input_vectors_are_not_modified() -> None:
    a, b = _vec(1), _vec(2)
    a_copy, b_copy = a.clone(), b.clone()
    average({"a": (a, 1.0), "b": (b, 2.0)})
    assert torch.equal(a, a_copy) and torch.equal(b, b_copy)


@pytest.mark.parametrize(
    "contributions",
    [
        {},
        {"a": (torch.zeros(3), 1.0), "b": (torch.zeros(4), 1.0)},
        {"a": (torch.zeros(3), 0.0)},
        {"a": (torch.zeros(3), -1.0)},
        {"a": (torch.zeros(3), float("nan"))},
        {"a": (torch.zeros(3), float("inf"))},
        {"a": (torch.zeros(3, dtype=torch.float64), 1.0)},
        {"a": (torch.zeros(3, 2), 1.0)},
        {"a": (lambda: "not a tensor", 1.0)},
    ],
)
def test_bad_input_raises(contributions: dict[str, Weighted]) -> None:
    with pytest.raises(ValueError):
        average(contributions)


def test_bad_weight_is_rejected_before_any_decode() -> None:
    def never() -> Tensor:
        raise AssertionError("decoded a contribution despite a bad weight")

    with pytest.raises(ValueError, match="weight"):
        average({"a": (never, 1.0), "z": (torch.zeros(3), 0.0)})


def test_registry() -> None:
    assert "mean" in available_aggregators()
    assert get_aggregator("mean") is average
    with pytest.raises(ValueError, match="unknown aggregator"):
        get_aggregator("median-of-nonsense")
    with pytest.raises(ValueError, match="bad options"):
        get_aggregator("mean", trim_ratio=0.1)


_contributions = st.lists(
    st.tuples(
        st.lists(st.floats(-1e3, 1e3, width=32), min_size=5, max_size=5),
        st.floats(1e-3, 1e3),
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=60, deadline=None)
@given(rows=_contributions, data=st.data())
def test_property_weighted_mean(rows: list[tuple[list[float], float]], data: st.DataObject) -> None:
    contributions: dict[str, Weighted] = {
        f"peer-{i:02d}": (torch.tensor(values, dtype=torch.float32), weight)
        for i, (values, weight) in enumerate(rows)
    }
    result = average(contributions)

    # Bit-identical whatever order the mapping was built in.
    keys = data.draw(st.permutations(list(contributions)))
    assert torch.equal(result, average({k: contributions[k] for k in keys}))

    # Close to the float64 weighted mean, and inside the per-coordinate hull.
    values = np.array([v for v, _ in rows], dtype=np.float64)
    weights = np.array([w for _, w in rows], dtype=np.float64)
    expected = (values * weights[:, None]).sum(0) / weights.sum()
    np.testing.assert_allclose(result.numpy(), expected, rtol=1e-4, atol=1e-3)
    slack = 1e-3 + 1e-5 * np.abs(values).max()
    assert np.all(result.numpy() >= values.min(0) - slack)
    assert np.all(result.numpy() <= values.max(0) + slack)
