"""Every aggregator by its name (``--aggregator``'s values): :func:`get_aggregator`, and what each
rule tolerates and costs (the contract they all keep: :mod:`neuronode.diloco.aggregate`).
The mean and ``NormClip`` (the default) are in ``aggregate`` (every contribution passes there);
each other rule is a class of its own module: ``TrimmedMean`` and ``CoordinateMedian``
(``coordinatewise``), ``CenteredClip`` (``centeredclip``), the pre-filter ``CosineFilter``
(``cosine``). A new rule is a module like those, and one line below.

=================  =====================================  ======================  ===============
name               options (defaults)                     bad members tolerated   time (× mean)§
=================  =====================================  ======================  ===============
``mean``           none                                   none                    O(nP)     (1)
``trimmed-mean``   ``trim_fraction=0.2``, in [0, 0.5)     ⌊f·n⌋ (a fraction < f)  O(nP)†    (~5)
``median``         none                                   fewer than n/2          O(nP)†    (~5)
``norm-clip``¶     ``clip_factor=1.0``, ≥ 1               bounded influence‡      O(nP)     (~7)
``centered-clip``  ``clip_factor=1.0`` > 0,               fewer than n/2,         O(k·nP)   (~20)
                   ``iterations=3`` (k) ≥ 1               bounded influence
=================  =====================================  ======================  ===============

Any of them also takes ``cosine_threshold`` (in [-1, 1]; ``None``, the default, is off),
which puts a :class:`CosineFilter` in front: members pointing away from the coordinate-wise
median are dropped first, as long as they are a minority. ``get_aggregator("median",
cosine_threshold=0.0)`` is the median of the members the filter kept. It adds a median and
a dot-product pass (~10–15× mean). Each class's docstring says exactly what it tolerates.

§ measured with n = 5, P = 10M on one thread of a busy machine (±30 %). † per coordinate a
sort of n values: a min/max network, O(n²) cheap element-wise ops, up to 16 members;
``torch.sort``, O(nP log n), beyond. ‡ a member moves the result by at most ``clip_factor ×
median norm × w/W``; the median norm is honest while fewer than n/2 are bad; a minority
pointing against the others (flipped updates) is left out. ¶ the default of ``neuronode start
--aggregator``: it works under all-to-all and reduce-scatter (per shard) and with any codec,
sparse ones included.

Memory: ``mean`` and ``norm-clip`` stream (``norm-clip`` decodes each contribution twice, one
at a time: for its norm, then as it is added). The other robust rules need every vector at
once: each contribution is decoded exactly once, in sorted peer-id order, and all are held, so with
loaders that return whole vectors they cost ``n × P × 4`` bytes, plus the output, plus one
more P-vector for ``centered-clip`` and for the cosine filter's median, plus about
``(n + 2) × 4 MiB`` of column-block scratch (see :mod:`neuronode.diloco.robust`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from neuronode.diloco.aggregate import Aggregator, NormClip, average
from neuronode.diloco.centeredclip import CenteredClip
from neuronode.diloco.coordinatewise import CoordinateMedian, TrimmedMean
from neuronode.diloco.cosine import CosineFilter

__all__ = ["available_aggregators", "get_aggregator"]


def _mean_factory() -> Aggregator:
    return average


# name -> factory taking the aggregator's options as keywords (validated on construction).
_REGISTRY: dict[str, Callable[..., Aggregator]] = {
    "mean": _mean_factory,
    "trimmed-mean": TrimmedMean,
    "median": CoordinateMedian,
    "norm-clip": NormClip,
    "centered-clip": CenteredClip,
}


def available_aggregators() -> list[str]:
    """Names accepted by :func:`get_aggregator`, sorted."""
    return sorted(_REGISTRY)


def get_aggregator(name: str, **options: Any) -> Aggregator:
    """Return the aggregator registered as ``name``, configured with ``options``.

    ``cosine_threshold`` (any aggregator; ``None`` means off) wraps the result in a
    :class:`CosineFilter`. Raises ``ValueError`` for an unknown name, options the
    aggregator does not take, or option values out of range.
    """
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown aggregator {name!r}; choose one of {available_aggregators()}"
        ) from None
    cosine_threshold = options.pop("cosine_threshold", None)
    try:
        aggregator = factory(**options)
    except TypeError as exc:
        raise ValueError(f"bad options for aggregator {name!r}: {exc}") from None
    if cosine_threshold is None:
        return aggregator
    return CosineFilter(base=aggregator, threshold=cosine_threshold)
