"""Combining peers' pseudo-gradients into the one vector every node applies: the contract every
aggregator keeps, the checks the rules share, and the two rules that weigh members and stream
(hold one decoded vector at a time): the weighted mean (``average``, the ``mean`` rule) and
``norm-clip`` (``NormClip``, the default). Every contribution of a round passes through here.

Every node must compute a bit-identical result from the same contributions, or the
replicas' global parameters drift apart. So aggregation iterates in sorted peer-id order
(never in arrival or dict order) and the arithmetic is fixed: float32 accumulation into a
fresh zero vector, with weights normalised in Python float.

Contributions map ``peer_id -> (vector_or_loader, weight)``. A loader is a zero-argument
callable returning the vector, so a caller can decode one contribution at a time and hold
only the accumulator plus one vector in memory.

The rules by name, with what each tolerates, costs and holds in memory, are listed in
:mod:`neuronode.diloco.aggregators` (``get_aggregator``). The rules that count members and hold
every vector at once live in modules of their own (``coordinatewise``, ``centeredclip``, the
``cosine`` pre-filter); the kernels of all robust rules in :mod:`neuronode.diloco.robust`.

Weights: the robust rules other than ``norm-clip`` count members, not weights. A weight is
the sender's own claim (its sample or step count), and a rule that let one member claim a
huge weight would not be robust: a node refuses a claim above the swarm's ``--max-weight``
before it reaches an aggregator. Weights are still validated exactly as for ``mean``.

Members are hosts: a node runs every rule over one contribution per host, the ids of one host
combined first (:mod:`neuronode.diloco.hosts`), so "members" and ``n`` in every rule count hosts.

Non-finite contributions: a vector holding NaN or ±inf is certainly not honest and would
poison norms and means, so every robust aggregator (and the cosine filter) drops it with a
warning before doing anything else; the fractions a rule tolerates refer to the remaining
members. Plain ``mean`` keeps its historic behaviour and does not look.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeAlias, runtime_checkable

import torch
from torch import Tensor

from neuronode.diloco import robust
from neuronode.events import fields
from neuronode.memory import empty_floats

__all__ = [
    "Aggregator",
    "NormClip",
    "Streamed",
    "Weighted",
    "all_finite",
    "average",
    "decode_finite",
    "finite_number",
    "resolve",
    "sorted_ids_and_total",
]

logger = logging.getLogger(__name__)

Weighted: TypeAlias = tuple[Tensor | Callable[[], Tensor], float]
"""``(flat float32 vector, or a callable returning it, weight > 0)``."""


@runtime_checkable
class Streamed(Protocol):
    """A lazy contribution that ``average`` can add chunk by chunk, never building the whole
    decoded vector (``neuronode.codec.Assembler``); the robust rules call it for the vector."""

    @property
    def n_elems(self) -> int: ...

    def __call__(self) -> Tensor: ...

    def add_into(self, acc: Tensor, alpha: float) -> None: ...

Aggregator: TypeAlias = Callable[[Mapping[str, Weighted]], Tensor]
"""A rule: contributions in, the vector every replica applies out (bit-identical everywhere)."""


def average(contributions: Mapping[str, Weighted], *, alphas: Mapping[str, float] | None = None) -> Tensor:
    """Weighted mean of flat float32 vectors, deterministic regardless of mapping order.

    Weights are normalised by their sum ``W`` (a Python float summed in sorted key order);
    each vector is added as ``acc.add_(t, alpha=w / W)`` (a ``Streamed`` source adds itself the
    same way, chunk by chunk), or with the factor ``alphas`` gives it (``NormClip``). A single
    contributor therefore comes back exactly (``alpha == 1.0``). Raises ``ValueError`` for an
    empty mapping, a non-positive or non-finite weight, or vectors that are not 1-D float32 of
    equal length.
    """
    peer_ids, total_weight = sorted_ids_and_total(contributions)
    acc: Tensor | None = None
    for peer_id in peer_ids:
        source, weight = contributions[peer_id]
        alpha = weight / total_weight if alphas is None else alphas[peer_id]
        if isinstance(source, Streamed):
            if acc is None:
                acc = empty_floats(source.n_elems).zero_()
            _check_size(peer_id, source.n_elems, acc)
            source.add_into(acc, alpha)
            continue
        vector = resolve(peer_id, source)
        if acc is None:
            acc = (empty_floats(vector.numel()).zero_() if vector.device.type == "cpu"
                   else torch.zeros_like(vector))
        _check_size(peer_id, vector.numel(), acc)
        acc.add_(vector, alpha=alpha)
        del vector  # let a lazily decoded vector be freed before the next one is built
    assert acc is not None  # sorted_ids_and_total rejects an empty mapping
    return acc


def _check_size(peer_id: str, n: int, acc: Tensor) -> None:
    if n != acc.numel():
        raise ValueError(f"contribution from {peer_id!r} has {n} elements, expected {acc.numel()}")


def sorted_ids_and_total(contributions: Mapping[str, Weighted]) -> tuple[list[str], float]:
    """Validate weights up front (before decoding anything) and sum them in sorted order."""
    if not contributions:
        raise ValueError("cannot aggregate zero contributions")
    peer_ids = sorted(contributions)
    total_weight = 0.0
    for peer_id in peer_ids:
        weight = contributions[peer_id][1]
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"weight of {peer_id!r} must be finite and > 0, got {weight}")
        total_weight += float(weight)
    return peer_ids, total_weight


def resolve(peer_id: str, source: Tensor | Callable[[], Tensor]) -> Tensor:
    """`source` as a vector (a loader called), checked to be 1-D float32."""
    vector = source if isinstance(source, Tensor) else source()
    if not isinstance(vector, Tensor) or vector.dim() != 1 or vector.dtype != torch.float32:
        detail = (
            f"dim={vector.dim()} dtype={vector.dtype}"
            if isinstance(vector, Tensor)
            else type(vector).__name__
        )
        raise ValueError(f"contribution from {peer_id!r} must be a 1-D float32 tensor ({detail})")
    return vector


def decode_finite(
    contributions: Mapping[str, Weighted],
) -> tuple[list[str], list[Tensor], list[float]]:
    """Decode every contribution once, in sorted peer-id order, and drop non-finite ones.

    Returns ``(peer_ids, vectors, weights)`` of the kept members, all three in that order.
    Weights are validated before anything is decoded, lengths after.
    """
    peer_ids, _ = sorted_ids_and_total(contributions)
    kept_ids: list[str] = []
    vectors: list[Tensor] = []
    weights: list[float] = []
    dropped: list[str] = []
    size: int | None = None
    for peer_id in peer_ids:
        source, weight = contributions[peer_id]
        vector = resolve(peer_id, source)
        if size is None:
            size = vector.numel()
        elif vector.numel() != size:
            raise ValueError(
                f"contribution from {peer_id!r} has {vector.numel()} elements, expected {size}"
            )
        if not all_finite(vector):
            dropped.append(peer_id)
            continue
        kept_ids.append(peer_id)
        vectors.append(vector)
        weights.append(float(weight))
    if dropped:
        logger.warning("dropped contributions with NaN or inf values from %s", dropped)
    if not kept_ids:
        raise ValueError(
            f"every contribution holds NaN or inf values ({dropped}); nothing to aggregate"
        )
    return kept_ids, vectors, weights


def all_finite(vector: Tensor) -> bool:
    """No NaN or ±inf in `vector`."""
    # aminmax propagates NaN and is one allocation-free pass; isfinite().all() is ~10x slower.
    if vector.numel() == 0:
        return True
    low, high = torch.aminmax(vector)
    return math.isfinite(float(low)) and math.isfinite(float(high))


def finite_number(option: str, value: object) -> float:
    """`value` of a rule's `option` as a float; ValueError unless a finite number."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{option} must be a finite number, got {value!r}")
    return float(value)


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
