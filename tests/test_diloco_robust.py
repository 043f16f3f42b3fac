"""Byzantine-robust aggregators: resilience to one bad member, determinism, edge cases, options."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from neuronode.diloco import Weighted, available_aggregators, average, get_aggregator, robust
from neuronode.diloco.cosine import CosineFilter

torch.set_num_threads(1)

SIZE = 3000  # not a multiple of the small block sizes used below, so ragged blocks are hit
ROBUST = ["trimmed-mean", "median", "norm-clip", "centered-clip"]
# (name, options) of every configuration the daemon could be started with.
CONFIGS: list[tuple[str, dict[str, float]]] = [
    ("mean", {}),
    *[(name, {}) for name in ROBUST],
    *[(name, {"cosine_threshold": 0.0}) for name in ["mean", *ROBUST]],
]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _honest(count: int = 4, seed: int = 0) -> list[Tensor]:
    """A common direction plus 10 % per-member noise."""
    direction = torch.randn(SIZE, generator=_gen(seed))
    return [direction + 0.1 * torch.randn(SIZE, generator=_gen(seed + 1 + i)) for i in range(count)]


ATTACKS: dict[str, Callable[[list[Tensor]], Tensor]] = {
    "flip": lambda honest: -100.0 * honest[0],
    "noise": lambda honest: 100.0 * torch.randn(SIZE, generator=_gen(99)),
    "huge": lambda honest: 1e30 * torch.sign(torch.randn(SIZE, generator=_gen(98))),
}


def _with_attacker(honest: list[Tensor], bad: Tensor) -> dict[str, Weighted]:
    contributions: dict[str, Weighted] = {f"honest-{i}": (v, 1.0) for i, v in enumerate(honest)}
    contributions["byzantine"] = (bad, 1.0)
    return contributions


def _cosine_and_relative_error(result: Tensor, target: Tensor) -> tuple[float, float]:
    r, t = result.double(), target.double()
    cosine = float(r @ t / (r.norm() * t.norm()))
    return cosine, float((r - t).norm() / t.norm())


# Relative error bounds with one bad member in five. norm-clip bounds magnitude, and leaves out a
# member pointing against the sum of the others (the flip); noise of the median norm still moves
# the result.
ROBUST_CASES = [
    ("trimmed-mean", {}, ATTACKS, 0.1),
    ("median", {}, ATTACKS, 0.1),
    ("centered-clip", {}, ATTACKS, 0.1),
    ("norm-clip", {}, ATTACKS, 0.45),
    ("norm-clip", {}, {"flip": ATTACKS["flip"]}, 0.01),
    ("mean", {"cosine_threshold": 0.0}, {"flip": ATTACKS["flip"]}, 1e-6),
    ("norm-clip", {"cosine_threshold": 0.0}, {"flip": ATTACKS["flip"]}, 0.01),
    *[
        (name, {"cosine_threshold": 0.0}, ATTACKS, bound)
        for name, bound in [
            ("trimmed-mean", 0.1),
            ("median", 0.1),
            ("centered-clip", 0.1),
            ("norm-clip", 0.45),
        ]
    ],
]


@pytest.mark.parametrize(("name", "options", "attacks", "bound"), ROBUST_CASES)
def test_one_byzantine_in_five_is_contained(
    name: str,
    options: dict[str, float],
    attacks: dict[str, Callable[[list[Tensor]], Tensor]],
    bound: float,
) -> None:
    honest = _honest()
    honest_mean = average({str(i): (v, 1.0) for i, v in enumerate(honest)})
    aggregator = get_aggregator(name, **options)
    for attack_name, attack in attacks.items():
        result = aggregator(_with_attacker(honest, attack(honest)))
        cosine, relative_error = _cosine_and_relative_error(result, honest_mean)
        assert cosine > 0.9, (attack_name, cosine)
        assert relative_error < bound, (attack_name, relative_error)


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_plain_mean_breaks_under_the_same_attacks(attack: str) -> None:
    honest = _honest()
    honest_mean = average({str(i): (v, 1.0) for i, v in enumerate(honest)})
    result = average(_with_attacker(honest, ATTACKS[attack](honest)))
    cosine, relative_error = _cosine_and_relative_error(result, honest_mean)
    assert cosine < 0 or relative_error > 10


def test_cosine_filter_drops_exactly_the_flipped_member() -> None:
    honest = _honest()
    result = get_aggregator("mean", cosine_threshold=0.0)(_with_attacker(honest, -honest[0]))
    assert torch.equal(result, average({f"honest-{i}": (v, 1.0) for i, v in enumerate(honest)}))


def test_cosine_filter_keeps_the_most_similar_half() -> None:
    # Nobody reaches cosine 0.9999, so the 2 of 4 closest to the median must survive: the
    # least noisy, "c" (0.05) and "A" (0.2).
    direction = torch.randn(SIZE, generator=_gen(5))
    noise = [0.05, 0.3, 0.6, 0.2]
    vectors = {
        name: direction + scale * torch.randn(SIZE, generator=_gen(10 + i))
        for i, (name, scale) in enumerate(zip("cxyA", noise, strict=True))
    }
    contributions: dict[str, Weighted] = {k: (v, 1.0) for k, v in vectors.items()}
    result = get_aggregator("mean", cosine_threshold=0.9999)(contributions)
    expected = average({k: contributions[k] for k in ("A", "c")})
    assert torch.equal(result, expected)


def test_cosine_filter_passes_weights_and_call_options_on() -> None:
    seen: list[tuple[dict[str, float], dict[str, object]]] = []

    def spy(contributions: dict[str, Weighted], **options: object) -> Tensor:
        seen.append(({k: w for k, (_, w) in contributions.items()}, options))
        return torch.zeros(SIZE)

    honest = _honest(3)
    contributions: dict[str, Weighted] = {str(i): (v, i + 1.0) for i, v in enumerate(honest)}
    CosineFilter(base=spy, threshold=0.0)(contributions, center=None)
    assert seen == [({"0": 1.0, "1": 2.0, "2": 3.0}, {"center": None})]


@pytest.mark.parametrize(("name", "options"), CONFIGS)
def test_mapping_order_and_repeats_give_identical_bits(
    name: str, options: dict[str, float]
) -> None:
    honest = _honest()
    items = list(_with_attacker(honest, ATTACKS["noise"](honest)).items())
    aggregator = get_aggregator(name, **options)
    reference = aggregator(dict(items))
    for permutation in itertools.islice(itertools.permutations(items), 0, None, 17):
        assert torch.equal(aggregator(dict(permutation)), reference)
    assert torch.equal(aggregator(dict(items)), reference)


@pytest.mark.parametrize(("name", "options"), CONFIGS)
def test_single_member_is_returned_exactly(name: str, options: dict[str, float]) -> None:
    vector = torch.randn(SIZE, generator=_gen(3)) * 1e-3
    result = get_aggregator(name, **options)({"only": (vector, 7.5)})
    assert torch.equal(result, vector)
    assert result.data_ptr() != vector.data_ptr()


def test_two_members_median_is_the_mean() -> None:
    a, b = _honest(2)
    contributions: dict[str, Weighted] = {"a": (a, 1.0), "b": (b, 1.0)}
    assert torch.allclose(get_aggregator("median")(contributions), average(contributions))


@pytest.mark.parametrize(("name", "options"), CONFIGS)
def test_lazy_members_are_decoded_once_in_sorted_order(
    name: str, options: dict[str, float]
) -> None:
    honest = _honest(3)
    calls: list[str] = []

    def loader(key: str, vector: Tensor) -> Callable[[], Tensor]:
        def load() -> Tensor:
            calls.append(key)
            return vector

        return load

    eager: dict[str, Weighted] = {k: (v, 1.0) for k, v in zip("cab", honest, strict=True)}
    lazy: dict[str, Weighted] = {
        k: (loader(k, v), 1.0) for k, v in zip("cab", honest, strict=True)
    }
    aggregator = get_aggregator(name, **options)
    assert torch.equal(aggregator(lazy), aggregator(eager))
    if name == "norm-clip" and not options:  # it streams: passes for the norms, to add, to compare (one vector held)
        assert calls == ["a", "b", "c"] * 3
    else:
        assert calls == ["a", "b", "c"]


@pytest.mark.parametrize("name", ROBUST)
def test_non_finite_members_are_dropped(name: str) -> None:
    honest = _honest()
    poisoned = honest[0].clone()
    poisoned[17] = float("nan")
    infinite = honest[1].clone()
    infinite[-1] = -float("inf")
    clean: dict[str, Weighted] = {f"h{i}": (v, 1.0) for i, v in enumerate(honest)}
    aggregator = get_aggregator(name)
    result = aggregator({**clean, "nan": (poisoned, 1.0), "inf": (infinite, 1.0)})
    assert torch.equal(result, aggregator(clean))
    with pytest.raises(ValueError, match="NaN or inf"):
        aggregator({"nan": (poisoned, 1.0)})


@pytest.mark.parametrize("name", ROBUST)
def test_bad_inputs_raise_like_mean(name: str) -> None:
    aggregator = get_aggregator(name)
    with pytest.raises(ValueError, match="zero contributions"):
        aggregator({})
    with pytest.raises(ValueError, match="elements"):
        aggregator({"a": (torch.zeros(3), 1.0), "b": (torch.zeros(4), 1.0)})
    with pytest.raises(ValueError, match="weight"):
        aggregator({"a": (torch.zeros(3), 0.0)})
    with pytest.raises(ValueError, match="float32"):
        aggregator({"a": (torch.zeros(3, dtype=torch.float64), 1.0)})


def test_centered_clip_from_a_given_center() -> None:
    honest = _honest()
    honest_mean = average({str(i): (v, 1.0) for i, v in enumerate(honest)})
    aggregator = get_aggregator("centered-clip", iterations=5)
    contributions = _with_attacker(honest, ATTACKS["flip"](honest))
    # A good start (e.g. last round's update) keeps the radius, fixed from the start, small.
    result = aggregator(contributions, center=honest[1])  # type: ignore[call-arg]
    cosine, relative_error = _cosine_and_relative_error(result, honest_mean)
    assert cosine > 0.99 and relative_error < 0.1
    with pytest.raises(ValueError, match="center"):
        aggregator(contributions, center=torch.zeros(SIZE + 1))  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("trimmed-mean", {"trim_fraction": 0.5}, r"trim_fraction must be in \[0, 0.5\)"),
        ("trimmed-mean", {"trim_fraction": -0.1}, r"trim_fraction must be in \[0, 0.5\)"),
        ("trimmed-mean", {"trim_fraction": math.nan}, "trim_fraction must be a finite number"),
        ("trimmed-mean", {"trim_fraction": "0.2"}, "trim_fraction must be a finite number"),
        ("trimmed-mean", {"trim_fraction": True}, "trim_fraction must be a finite number"),
        ("norm-clip", {"clip_factor": 0.5}, "clip_factor of norm-clip must be >= 1"),
        ("norm-clip", {"clip_factor": math.inf}, "clip_factor must be a finite number"),
        ("centered-clip", {"clip_factor": 0.0}, "clip_factor of centered-clip must be > 0"),
        ("centered-clip", {"iterations": 0}, "iterations must be >= 1"),
        ("centered-clip", {"iterations": 2.5}, "iterations must be an integer"),
        ("median", {"cosine_threshold": 1.5}, r"cosine_threshold must be in \[-1, 1\]"),
        ("mean", {"cosine_threshold": math.nan}, "cosine_threshold must be a finite number"),
        ("median", {"trim_fraction": 0.1}, "bad options for aggregator 'median'"),
        ("norm-clip", {"iterations": 3}, "bad options for aggregator 'norm-clip'"),
    ],
)
def test_options_are_validated(name: str, options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_aggregator(name, **options)


def test_registry_lists_every_aggregator() -> None:
    assert available_aggregators() == sorted(["mean", *ROBUST])
    assert get_aggregator("mean") is average
    assert get_aggregator("mean", cosine_threshold=None) is average
    assert get_aggregator("trimmed-mean", trim_fraction=0.3) == get_aggregator(
        "trimmed-mean", trim_fraction=0.3
    )


def test_trimmed_mean_counts_members_not_weights() -> None:
    a, b, c = (torch.full((4,), x) for x in (1.0, 2.0, 30.0))
    contributions: dict[str, Weighted] = {"a": (a, 1.0), "b": (b, 1.0), "c": (c, 1e6)}
    assert torch.equal(get_aggregator("trimmed-mean", trim_fraction=0.34)(contributions), b)
    assert torch.equal(get_aggregator("median")(contributions), b)


def test_trimmed_mean_with_no_trim_is_the_plain_mean() -> None:
    honest = _honest()
    contributions: dict[str, Weighted] = {str(i): (v, 1.0) for i, v in enumerate(honest)}
    assert torch.allclose(
        get_aggregator("trimmed-mean", trim_fraction=0.0)(contributions), average(contributions)
    )


def test_norm_clip_scales_only_the_large_member() -> None:
    base = torch.tensor([3.0, 4.0])  # norm 5
    contributions: dict[str, Weighted] = {
        "a": (base, 1.0),
        "b": (base * 1.2, 1.0),
        "c": (base * 100.0, 2.0),
    }
    # median norm 6; clip_factor 2 -> c is scaled to norm 12, a and b untouched.
    result = get_aggregator("norm-clip", clip_factor=2.0)(contributions)
    assert torch.allclose(result, (base + 1.2 * base + 2 * 2.4 * base) / 4)


def test_norm_clip_leaves_out_flips_of_two_ids_among_six_as_if_they_never_came() -> None:
    """Two ids of one volunteer send their updates x -10 among four honest members (issue 26
    (a)): clipped to the median norm, each still cancelled an honest member's share ((4h - 2h) /
    6); now both point against the sum of the others and are left out, bit for bit as if only
    the honest members had sent."""
    honest = _honest(4)
    contributions: dict[str, Weighted] = {f"h{i}": (v, 1.0) for i, v in enumerate(honest)}
    alone = get_aggregator("norm-clip")(dict(contributions))
    contributions |= {"a-x1": (-10.0 * honest[0], 1.0), "a-x2": (-10.0 * honest[1], 1.0)}
    assert torch.equal(get_aggregator("norm-clip")(contributions), alone)


def test_norm_clip_leaves_out_a_minority_only_and_never_one_of_two() -> None:
    """However many point against the others, a strict majority is kept (the most opposed go
    first, ties by id); of two members (who point against each other alike) nobody is left out."""
    two: dict[str, Weighted] = {"a": (torch.tensor([1.0, 0.0]), 1.0), "b": (torch.tensor([-1.0, 0.1]), 1.0)}
    norms = [1.0, math.hypot(1.0, 0.1)]
    radius = sum(norms) / 2
    expected = average(two, alphas={"a": 0.5, "b": 0.5 * radius / norms[1]})
    assert torch.equal(get_aggregator("norm-clip")(two), expected)
    # a and b each point against the sum of the others (c is orthogonal to both): one of three
    # may be left out, a (the tie goes by id).
    three: dict[str, Weighted] = {"a": (torch.tensor([1.0, 0.0]), 1.0), "b": (torch.tensor([-1.0, 0.0]), 1.0),
                                  "c": (torch.tensor([0.0, 1.0]), 1.0)}
    assert torch.equal(get_aggregator("norm-clip")(three), torch.tensor([-0.5, 0.5]))


def test_norm_clip_keeps_honest_members_with_noisy_but_agreeing_updates() -> None:
    """Honest members whose updates share a direction under noise twice their size are all kept
    (each points toward the sum of the others): the result is the plain clipped mean."""
    direction = torch.randn(SIZE, generator=_gen(7))
    honest = {f"h{i}": (direction + 2.0 * torch.randn(SIZE, generator=_gen(20 + i)), 1.0) for i in range(5)}
    norms = [float(v.norm()) for v, _ in honest.values()]
    radius = sorted(norms)[2]
    expected = average(honest, alphas={k: min(1.0, radius / float(v.norm())) / 5 for k, (v, _) in honest.items()})
    assert torch.allclose(get_aggregator("norm-clip")(honest), expected, atol=1e-6)


def test_block_size_does_not_change_coordinate_rules() -> None:
    vectors = _honest(7)
    assert torch.equal(
        robust.coordinate_median(vectors, block_elements=64), robust.coordinate_median(vectors)
    )
    assert torch.equal(
        robust.trimmed_mean(vectors, trim_count=2, block_elements=100),
        robust.trimmed_mean(vectors, trim_count=2),
    )
    assert torch.allclose(
        robust.centered_clip(vectors, iterations=2, clip_factor=1.0, block_elements=128),
        robust.centered_clip(vectors, iterations=2, clip_factor=1.0),
    )


def test_fixed_order_sum_is_accurate_and_ignores_threads() -> None:
    values = torch.randn(100_003, generator=_gen(4), dtype=torch.float64)
    expected = math.fsum(values.tolist())
    assert abs(robust.fixed_order_sum(values.clone()) - expected) < 1e-9
    single = robust.fixed_order_sum(values.clone())
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert robust.fixed_order_sum(values.clone()) == single
    finally:
        torch.set_num_threads(previous)
    assert robust.fixed_order_sum(torch.zeros(0, dtype=torch.float64)) == 0.0


_rows = st.integers(1, 20).flatmap(
    lambda n: st.lists(
        st.lists(st.floats(-(2.0**100), 2.0**100, width=32), min_size=6, max_size=6),
        min_size=n,
        max_size=n,
    )
)


@settings(max_examples=80, deadline=None)
@given(rows=_rows)
def test_property_network_sort_matches_torch_sort(rows: list[list[float]]) -> None:
    stacked = torch.tensor(rows, dtype=torch.float32)
    ours = torch.stack(robust.sorted_rows(list(stacked.unbind(0))))
    assert torch.equal(ours, torch.sort(stacked, dim=0).values)


@settings(max_examples=80, deadline=None)
@given(rows=_rows, trim_fraction=st.floats(0.0, 0.49))
def test_property_order_statistics_stay_inside_the_hull(
    rows: list[list[float]], trim_fraction: float
) -> None:
    contributions: dict[str, Weighted] = {
        f"peer-{i:02d}": (torch.tensor(row, dtype=torch.float32), 1.0) for i, row in enumerate(rows)
    }
    values = np.array(rows, dtype=np.float64)
    low, high = values.min(0), values.max(0)
    median = get_aggregator("median")(contributions).double().numpy()
    assert np.all(median >= low) and np.all(median <= high)
    np.testing.assert_allclose(median, np.median(values, axis=0), rtol=1e-6, atol=1e-44)
    trimmed = get_aggregator("trimmed-mean", trim_fraction=trim_fraction)(contributions)
    # The mean of the kept band rounds in float32 (absolutely so among subnormals).
    slack = 1e-6 * np.abs(values).max(0) + 1e-42
    assert np.all(trimmed.double().numpy() >= low - slack)
    assert np.all(trimmed.double().numpy() <= high + slack)
