"""``norm-clip``, the default aggregator: every member clipped to a multiple of the median norm,
a minority pointing against the others left out, weighted like the mean and streamed
(:mod:`neuronode.diloco.aggregate` has the contract every rule keeps)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

from torch import Tensor

from neuronode.diloco import robust
from neuronode.diloco.aggregate import (
    Streamed,
    Weighted,
    all_finite,
    average,
    finite_number,
    resolve,
    sorted_ids_and_total,
)
from neuronode.events import fields
from neuronode.memory import empty_floats

__all__ = ["NormClip"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class NormClip:
    """``norm-clip`` (the default): shrink each vector to ``clip_factor ×`` the median L2 norm,
    then take the weighted mean.

    Weighted like ``mean`` (alpha ``w_i / W``), so a member's influence is at most
    ``clip_factor × median_norm × w_i / W``: with weights bounded (a node refuses a claim above
    the swarm's ``--max-weight``), one member sending its pseudo-gradient × −10 moves the
    result by no more than an honest member does. The median norm it clips to stays honest
    while fewer than ``n/2`` are bad.

    A flipped update clipped to the median norm still cancels an honest member's share (a
    volunteer on two hosts among six: ``(4h − 2h) / 6``). So a member whose clipped vector points
    against the sum of the others' (``x_i · (S − α_i x_i) < 0``, S the clipped mean) is left
    out, the most opposed first, as long as those left out stay a minority (at most
    ``⌊(n−1)/2⌋``: of two members nobody is); the result is then norm-clip over the others,
    their median norm included, as if the left-out had never sent. Honest updates share a
    descent direction, so each points toward the sum of the rest. While those pointing against
    the others are a minority, a kept member's update cannot pull against their sum: an attacker
    within the bound is left with noise of the median norm or an update that adds little (it
    dilutes the step by its weight share at most, as a member sending zeros would). A left-out
    member is logged (event ``opposed_left_out``). It scales and drops whole vectors, so a
    sparse contribution keeps its entries (a coordinate-wise rule would erase them), and under
    reduce-scatter each reducer applies it to the slices of its shard.

    It streams like ``mean``: each contribution is decoded for its norm (one at a time, then
    dropped), once more as it is added, and once more for its dot product with the mean, so it
    holds the output and one vector, never all of them. ``clip_factor`` must be ≥ 1: clipping
    below the median would shrink honest updates, which is the outer learning rate's job.
    """

    clip_factor: float = 1.0

    def __post_init__(self) -> None:
        factor = finite_number("clip_factor", self.clip_factor)
        if factor < 1.0:
            raise ValueError(f"clip_factor of norm-clip must be >= 1, got {factor}")

    def __call__(self, contributions: Mapping[str, Weighted]) -> Tensor:
        peer_ids, _ = sorted_ids_and_total(contributions)
        kept: list[str] = []
        norms: list[float] = []
        dropped: list[str] = []
        size: int | None = None
        decoded = OneAtATime(contributions)
        for peer_id in peer_ids:  # pass 1: every norm, one decoded vector at a time
            vector = decoded(peer_id)
            if size is None:
                size = vector.numel()
            elif vector.numel() != size:
                raise ValueError(f"contribution from {peer_id!r} has {vector.numel()} elements, expected {size}")
            if not all_finite(vector):
                dropped.append(peer_id)
                continue
            kept.append(peer_id)
            norms.append(math.sqrt(robust.squared_norms([vector])[0]))
            del vector
        if dropped:
            logger.warning("dropped contributions with NaN or inf values from %s", dropped)
        if not kept:
            raise ValueError(f"every contribution holds NaN or inf values ({dropped}); nothing to aggregate")
        norm_of = dict(zip(kept, norms, strict=True))
        alphas = self._alphas(contributions, norm_of)
        result = average({peer_id: contributions[peer_id] for peer_id in alphas}, alphas=alphas)
        # Pass 3: a member pointing against the sum of the others (its flipped update, clipped to
        # the median norm, would still cancel an honest member's) is left out, as long as the
        # ones left out stay a minority: the most opposed first.
        against: list[tuple[float, str]] = []
        for peer_id, alpha in alphas.items():
            toward_rest = robust.dot(decoded(peer_id), result) - alpha * norm_of[peer_id] ** 2
            if toward_rest < 0:
                against.append((toward_rest, peer_id))
        left_out = sorted(peer_id for _, peer_id in sorted(against)[: (len(kept) - 1) // 2])
        if not left_out:
            return result
        logger.warning("left out %s: each pointed against the sum of the others", ", ".join(left_out),
                       extra=fields("opposed_left_out", peers=left_out))
        # As if they never came: the median norm too is the kept members'.
        alphas = self._alphas(contributions, {p: n for p, n in norm_of.items() if p not in left_out})
        return average({peer_id: contributions[peer_id] for peer_id in alphas}, alphas=alphas)

    def _alphas(self, contributions: Mapping[str, Weighted], norm_of: Mapping[str, float]) -> dict[str, float]:
        """Each member's factor in the clipped mean: its weight's share, times its clip scale."""
        radius = self.clip_factor * robust.median_of_floats(list(norm_of.values()))
        total = 0.0
        for peer_id in norm_of:
            total += float(contributions[peer_id][1])
        return {peer_id: float(contributions[peer_id][1]) / total * robust.clip_scale(norm, radius)
                for peer_id, norm in norm_of.items()}


class OneAtATime:
    """Each contribution decoded on demand into one reused buffer (a streamed source), so a rule
    that passes over the members several times holds one decoded vector, never all of them."""

    def __init__(self, contributions: Mapping[str, Weighted]) -> None:
        self.contributions = contributions
        self.scratch: Tensor | None = None

    def __call__(self, peer_id: str) -> Tensor:
        source = self.contributions[peer_id][0]
        if isinstance(source, Streamed) and hasattr(source, "decode_into"):
            if self.scratch is None or self.scratch.numel() != source.n_elems:
                self.scratch = empty_floats(source.n_elems)
            source.decode_into(self.scratch)
            return self.scratch
        return resolve(peer_id, source)
