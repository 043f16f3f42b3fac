"""``centered-clip``: from a robust start, repeated clipped steps toward every member
(:mod:`neuronode.diloco.aggregate` has the contract every rule keeps)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from neuronode.diloco import robust
from neuronode.diloco.aggregate import Weighted, all_finite, decode_finite, finite_number

__all__ = ["CenteredClip"]


@dataclass(frozen=True, kw_only=True)
class CenteredClip:
    """``centered-clip`` (Karimireddy et al. 2021): repeat ``v ← v + mean_i clip(x_i - v, τ)``.

    Starts from the coordinate-wise median, or from ``center`` passed per call (e.g. last
    round's applied update; it must be the same tensor on every replica). The radius is
    ``τ = clip_factor × median_i ‖x_i - start‖``, fixed for ``iterations`` rounds.
    Tolerates fewer than ``n/2`` bad members, and each member moves the result by at most
    ``τ / n`` per iteration. Unweighted. O(nP) median plus ``iterations`` × two O(nP) passes.
    """

    clip_factor: float = 1.0
    iterations: int = 3

    def __post_init__(self) -> None:
        factor = finite_number("clip_factor", self.clip_factor)
        if factor <= 0.0:
            raise ValueError(f"clip_factor of centered-clip must be > 0, got {factor}")
        if isinstance(self.iterations, bool) or not isinstance(self.iterations, int):
            raise ValueError(f"iterations must be an integer, got {self.iterations!r}")
        if self.iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {self.iterations}")

    def __call__(
        self, contributions: Mapping[str, Weighted], *, center: Tensor | None = None
    ) -> Tensor:
        _, vectors, _ = decode_finite(contributions)
        if center is not None:
            _check_center(center, vectors[0].numel())
        if len(vectors) == 1:
            return vectors[0].clone()
        return robust.centered_clip(
            vectors, iterations=self.iterations, clip_factor=self.clip_factor, center=center
        )


def _check_center(center: Tensor, size: int) -> None:
    if not isinstance(center, Tensor) or center.dim() != 1 or center.dtype != torch.float32:
        raise ValueError("center must be a 1-D float32 tensor")
    if center.numel() != size:
        raise ValueError(f"center has {center.numel()} elements, contributions have {size}")
    if not all_finite(center):
        raise ValueError("center holds NaN or inf values")
