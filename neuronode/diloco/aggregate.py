"""Combining peers' pseudo-gradients into the one vector every node applies: the
contract every aggregator keeps, the weighted mean (``average``, the ``mean`` rule), and the
checks the rules share.

Every node must compute a bit-identical result from the same contributions, or the
replicas' global parameters drift apart. So aggregation iterates in sorted peer-id order
(never in arrival or dict order) and the arithmetic is fixed: float32 accumulation into a
fresh zero vector, with weights normalised in Python float.

Contributions map ``peer_id -> (vector_or_loader, weight)``. A loader is a zero-argument
callable returning the vector, so a caller can decode one contribution at a time and hold
only the accumulator plus one vector in memory.

The rules by name, with what each tolerates, costs and holds in memory, are listed in
:mod:`neuronode.diloco.aggregators` (``get_aggregator``); each lives in its own module
(``normclip``, ``coordinatewise``, ``centeredclip``, the ``cosine`` pre-filter), their kernels
in :mod:`neuronode.diloco.robust`.

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
from typing import Protocol, TypeAlias, runtime_checkable

import torch
from torch import Tensor

from neuronode.memory import empty_floats

__all__ = [
    "Aggregator",
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
