"""The cosine pre-filter (``cosine_threshold``, any rule): members pointing away from the
coordinate-wise median dropped first, while they are a minority."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from neuronode.diloco import robust
from neuronode.diloco.aggregate import Aggregator, Weighted, decode_finite, finite_number

__all__ = ["CosineFilter"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class CosineFilter:
    """Pre-filter: drop members whose cosine with the coordinate-wise median is < ``threshold``.

    The survivors go to ``base`` with their weights (extra call keywords are passed on).
    Never keeps fewer than ``⌈n/2⌉``: if more would go, the ``⌈n/2⌉`` most similar stay
    (ties by peer id). Removes direction-flipping members while they are a minority (the
    median they are compared with is then honest); it does nothing against members that
    point the right way with a huge norm, so pair it with a robust ``base``. Costs an
    O(nP) median (as ``median``) and one float64 dot-product pass.
    """

    base: Aggregator
    threshold: float

    def __post_init__(self) -> None:
        threshold = finite_number("cosine_threshold", self.threshold)
        if not -1.0 <= threshold <= 1.0:
            raise ValueError(f"cosine_threshold must be in [-1, 1], got {threshold}")

    def __call__(self, contributions: Mapping[str, Weighted], **call_options: Any) -> Tensor:
        peer_ids, vectors, weights = decode_finite(contributions)
        reference = robust.coordinate_median(vectors) if len(vectors) > 1 else vectors[0]
        cosines = robust.cosine_similarities(vectors, reference)
        kept = _most_similar(cosines, peer_ids, self.threshold)
        if len(kept) < len(peer_ids):
            dropped = sorted(set(range(len(peer_ids))) - set(kept))
            logger.info(
                "cosine filter dropped %s (cosines %s, threshold %s)",
                [peer_ids[i] for i in dropped],
                [round(cosines[i], 4) for i in dropped],
                self.threshold,
            )
        survivors: dict[str, Weighted] = {
            peer_ids[i]: (vectors[i], weights[i]) for i in sorted(kept)
        }
        return self.base(survivors, **call_options)


def _most_similar(cosines: list[float], peer_ids: list[str], threshold: float) -> list[int]:
    """Indices reaching ``threshold``, or else the ``⌈n/2⌉`` most similar (ties by peer id)."""
    ranked = sorted(range(len(peer_ids)), key=lambda i: (-cosines[i], peer_ids[i]))
    kept = [i for i in ranked if cosines[i] >= threshold]
    minimum = (len(peer_ids) + 1) // 2
    return kept if len(kept) >= minimum else ranked[:minimum]
