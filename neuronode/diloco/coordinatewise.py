"""``trimmed-mean`` and ``median``: coordinate-wise order statistics over every member's vector,
unweighted (:mod:`neuronode.diloco.aggregate` has the contract every rule keeps)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from torch import Tensor

from neuronode.diloco import robust
from neuronode.diloco.aggregate import Weighted, decode_finite, finite_number

__all__ = ["CoordinateMedian", "TrimmedMean"]


@dataclass(frozen=True, kw_only=True)
class TrimmedMean:
    """``trimmed-mean``: per coordinate drop the ``⌊f·n⌋`` largest and smallest, then average.

    Tolerates up to ``⌊f·n⌋`` bad members, i.e. a fraction below ``f`` (``trim_fraction``,
    in [0, 0.5)); note that ``n < 1/f`` trims nothing (the default 0.2 needs 5 members).
    Unweighted: every kept value counts once. O(n²P) cheap element-wise min/max for up to
    16 members, an O(nP log n) sort beyond.
    """

    trim_fraction: float = 0.2

    def __post_init__(self) -> None:
        fraction = finite_number("trim_fraction", self.trim_fraction)
        if not 0.0 <= fraction < 0.5:
            raise ValueError(f"trim_fraction must be in [0, 0.5), got {fraction}")

    def __call__(self, contributions: Mapping[str, Weighted]) -> Tensor:
        _, vectors, _ = decode_finite(contributions)
        if len(vectors) == 1:
            return vectors[0].clone()
        trim_count = math.floor(self.trim_fraction * len(vectors))
        return robust.trimmed_mean(vectors, trim_count=trim_count)


@dataclass(frozen=True, kw_only=True)
class CoordinateMedian:
    """``median``: coordinate-wise median, the mean of the two middle values for even ``n``.

    Tolerates fewer than ``n/2`` bad members (per coordinate the result lies between honest
    values). Unweighted. Equals the mean for ``n = 2``. O(n²P) cheap element-wise min/max
    for up to 16 members, an O(nP log n) sort beyond.
    """

    def __call__(self, contributions: Mapping[str, Weighted]) -> Tensor:
        _, vectors, _ = decode_finite(contributions)
        if len(vectors) == 1:
            return vectors[0].clone()
        return robust.coordinate_median(vectors)
