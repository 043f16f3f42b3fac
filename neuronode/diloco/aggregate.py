"""Combining peers' pseudo-gradients into the one vector every node applies.

Every node must compute a bit-identical result from the same contributions, or the
replicas' global parameters drift apart. So aggregation iterates in sorted peer-id order
(never in arrival or dict order) and the arithmetic is fixed: float32 accumulation into a
fresh zero vector, with weights normalised in Python float.

Contributions map ``peer_id -> (vector_or_loader, weight)``. A loader is a zero-argument
callable returning the vector, so a caller can decode one contribution at a time and hold
only the accumulator plus one vector in memory.

Aggregators are looked up by name with :func:`get_aggregator`; robust ones (trimmed mean,
coordinate median, norm clipping) belong in this module under the same registry.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import torch
from torch import Tensor

__all__ = ["Aggregator", "Contribution", "average", "available_aggregators", "get_aggregator"]

Contribution: TypeAlias = tuple[Tensor | Callable[[], Tensor], float]
"""``(flat float32 vector, or a callable returning it, weight > 0)``."""

Aggregator: TypeAlias = Callable[[Mapping[str, Contribution]], Tensor]


def average(contributions: Mapping[str, Contribution]) -> Tensor:
    """Weighted mean of flat float32 vectors, deterministic regardless of mapping order.

    Weights are normalised by their sum ``W`` (a Python float summed in sorted key order);
    each vector is added as ``acc.add_(t, alpha=w / W)``. A single contributor therefore
    comes back exactly (``alpha == 1.0``). Raises ``ValueError`` for an empty mapping, a
    non-positive or non-finite weight, or vectors that are not 1-D float32 of equal length.
    """
    peer_ids, total_weight = _sorted_ids_and_total(contributions)
    acc: Tensor | None = None
    for peer_id in peer_ids:
        source, weight = contributions[peer_id]
        vector = _resolve(peer_id, source)
        if acc is None:
            acc = torch.zeros_like(vector)
        elif vector.numel() != acc.numel():
            raise ValueError(
                f"contribution from {peer_id!r} has {vector.numel()} elements, "
                f"expected {acc.numel()}"
            )
        acc.add_(vector, alpha=weight / total_weight)
        del vector  # let a lazily decoded vector be freed before the next one is built
    assert acc is not None  # _sorted_ids_and_total rejects an empty mapping
    return acc


def _sorted_ids_and_total(contributions: Mapping[str, Contribution]) -> tuple[list[str], float]:
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


def _resolve(peer_id: str, source: Tensor | Callable[[], Tensor]) -> Tensor:
    vector = source if isinstance(source, Tensor) else source()
    if not isinstance(vector, Tensor) or vector.dim() != 1 or vector.dtype != torch.float32:
        detail = (
            f"dim={vector.dim()} dtype={vector.dtype}"
            if isinstance(vector, Tensor)
            else type(vector).__name__
        )
        raise ValueError(f"contribution from {peer_id!r} must be a 1-D float32 tensor ({detail})")
    return vector


def _mean_factory() -> Aggregator:
    return average


# name -> factory taking the aggregator's options (e.g. a future trim ratio) as keywords.
_REGISTRY: dict[str, Callable[..., Aggregator]] = {"mean": _mean_factory}


def available_aggregators() -> list[str]:
    """Names accepted by :func:`get_aggregator`, sorted."""
    return sorted(_REGISTRY)


def get_aggregator(name: str, **options: Any) -> Aggregator:
    """Return the aggregator registered as ``name``, configured with ``options``.

    Raises ``ValueError`` for an unknown name or options the aggregator does not take.
    """
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown aggregator {name!r}; choose one of {available_aggregators()}"
        ) from None
    try:
        return factory(**options)
    except TypeError as exc:
        raise ValueError(f"bad options for aggregator {name!r}: {exc}") from None
