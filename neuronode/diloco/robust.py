"""Byzantine-robust reductions of equal-length flat float32 vectors (pure torch, no I/O).

These are the kernels behind the ``trimmed-mean``, ``median``, ``norm-clip`` (its norms and
clip factor) and ``centered-clip`` aggregators and the cosine pre-filter
(:mod:`neuronode.diloco.aggregators` names them), which decode contributions, sort them by peer
id and validate options before calling in here. Every function takes the vectors in the
caller's (sorted) order, never modifies them, and returns a fresh float32 vector.

Determinism: every replica that reduces the same vectors in the same order must get the same
bits. Coordinate-wise order statistics use only ``minimum``/``maximum`` (or ``torch.sort``),
which are exact. Norms and dot products are not taken with ``Tensor.sum`` (its summation
order depends on the thread count and SIMD width); each float32 product is formed exactly
in float64 and summed by :func:`fixed_order_sum`, a pairwise tree of element-wise adds over
fixed column blocks, so the scalars that steer clipping and filtering are reproducible on
any machine. The one thing that may differ is the sign of a zero, which compares equal and
leaves every parameter update unchanged.

Memory: the order statistics work on column blocks of ``BLOCK_ELEMENTS`` coordinates, so
beyond the inputs and the output they hold about ``(n + 2) × block`` floats at a time.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

__all__ = [
    "BLOCK_ELEMENTS",
    "centered_clip",
    "clip_scale",
    "column_blocks",
    "coordinate_median",
    "cosine_similarities",
    "fixed_order_sum",
    "median_of_floats",
    "sorted_rows",
    "squared_norms",
    "trimmed_mean",
]

BLOCK_ELEMENTS = 1 << 20
"""Coordinates per column block (4 MiB of float32 per member). Changing it changes the bits
of the norm-based rules (their float64 partial sums are per block), so it is a constant."""

# Up to this many members an odd-even transposition network (n rounds of element-wise
# min/max) beats torch.sort along dim 0 by 2-6x; beyond it the network's O(n^2) loses.
_NETWORK_MAX_ROWS = 16


def column_blocks(size: int, block_elements: int = BLOCK_ELEMENTS) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of consecutive column blocks covering ``range(size)``."""
    for start in range(0, size, block_elements):
        yield start, min(start + block_elements, size)


def sorted_rows(rows: Sequence[Tensor]) -> list[Tensor]:
    """Sort equal-length 1-D tensors coordinate-wise: result[i] holds the i-th smallest values.

    Inputs must be NaN-free. Small ``n`` use a transposition network of ``torch.minimum`` /
    ``torch.maximum`` (exact, O(n^2) element-wise ops); larger ``n`` stack and ``torch.sort``
    along dim 0 (O(n log n) per coordinate). Both give the same values.
    """
    n = len(rows)
    if n > _NETWORK_MAX_ROWS:
        return list(torch.sort(torch.stack(list(rows)), dim=0).values.unbind(0))
    out = list(rows)
    for round_index in range(n):  # n rounds of alternating odd/even pairs sort any input
        for i in range(round_index % 2, n - 1, 2):
            low, high = torch.minimum(out[i], out[i + 1]), torch.maximum(out[i], out[i + 1])
            out[i], out[i + 1] = low, high
    return out


def coordinate_median(vectors: Sequence[Tensor], *, block_elements: int = BLOCK_ELEMENTS) -> Tensor:
    """Coordinate-wise median; for even ``n`` the mean of the two middle values.

    The even case is the float64 midpoint rounded once to float32: symmetric, always
    between the two middle values (a float32 ``0.5 * low + 0.5 * high`` can round outside
    for subnormals), and immune to the overflow of ``low + high`` near float32 max.
    """
    n = len(vectors)
    out = torch.empty_like(vectors[0])
    for start, stop in column_blocks(out.numel(), block_elements):
        rows = sorted_rows([v[start:stop] for v in vectors])
        low, high = rows[(n - 1) // 2], rows[n // 2]
        if n % 2:
            out[start:stop].copy_(low)
        else:
            out[start:stop].copy_(torch.add(low.double(), high.double()).mul_(0.5))
    return out


def trimmed_mean(
    vectors: Sequence[Tensor], *, trim_count: int, block_elements: int = BLOCK_ELEMENTS
) -> Tensor:
    """Per coordinate, drop the ``trim_count`` largest and smallest values and average the rest.

    The kept values are added in ascending order with weight ``1 / (n - 2 * trim_count)``.
    """
    n = len(vectors)
    if not 0 <= 2 * trim_count < n:
        raise ValueError(
            f"trim_count must be in [0, {(n - 1) // 2}] for {n} vectors, got {trim_count}"
        )
    alpha = 1.0 / (n - 2 * trim_count)
    out = torch.zeros_like(vectors[0])
    for start, stop in column_blocks(out.numel(), block_elements):
        rows = [v[start:stop] for v in vectors]
        if trim_count:
            rows = sorted_rows(rows)[trim_count : n - trim_count]
        acc = out[start:stop]
        for row in rows:
            acc.add_(row, alpha=alpha)
    return out


def fixed_order_sum(values: Tensor) -> float:
    """Sum a 1-D float64 tensor by pairwise folding, *destroying* its contents.

    Each fold adds the upper half onto the lower half element-wise, so the additions and
    their order depend only on the length: bit-identical on any thread count, SIMD width or
    device, and as accurate as pairwise summation. Costs about one pass over ``values``.
    """
    length = values.numel()
    if length == 0:
        return 0.0
    while length > 1:
        half = (length + 1) // 2
        values[: length - half].add_(values[half:length])
        length = half
    return float(values[0])


def squared_norms(
    vectors: Sequence[Tensor], *, block_elements: int = BLOCK_ELEMENTS
) -> list[float]:
    """``‖v‖²`` of each vector, in float64 (float32 squares are exact there; no overflow)."""
    totals = [0.0] * len(vectors)
    for start, stop in column_blocks(vectors[0].numel(), block_elements):
        for i, vector in enumerate(vectors):
            totals[i] += fixed_order_sum(vector[start:stop].double().square_())
    return totals


def dot(a: Tensor, b: Tensor, *, block_elements: int = BLOCK_ELEMENTS) -> float:
    """``a · b`` in float64, summed in a fixed order (``fixed_order_sum`` per column block)."""
    total = 0.0
    for start, stop in column_blocks(a.numel(), block_elements):
        total += fixed_order_sum(a[start:stop].double().mul_(b[start:stop]))
    return total


def median_of_floats(values: Sequence[float]) -> float:
    """Median of Python floats; the mean of the two middle ones for an even count."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return 0.5 * ordered[middle - 1] + 0.5 * ordered[middle]


def clip_scale(norm: float, radius: float) -> float:
    """Factor that shrinks a vector of ``norm`` to at most ``radius`` (1.0 when inside)."""
    return 1.0 if norm <= radius else radius / norm


def _distances(vectors: Sequence[Tensor], center: Tensor, block_elements: int) -> list[float]:
    """``‖v - center‖`` per vector; the float32 difference is the one the update uses."""
    totals = [0.0] * len(vectors)
    for start, stop in column_blocks(center.numel(), block_elements):
        for i, vector in enumerate(vectors):
            diff = (vector[start:stop] - center[start:stop]).double()
            totals[i] += fixed_order_sum(diff.square_())
    return [math.sqrt(total) for total in totals]


def centered_clip(
    vectors: Sequence[Tensor],
    *,
    iterations: int,
    clip_factor: float,
    center: Tensor | None = None,
    block_elements: int = BLOCK_ELEMENTS,
) -> Tensor:
    """Centered clipping (Karimireddy, He & Jaggi 2021), run for a fixed number of iterations.

    Start from ``center`` (default: the coordinate-wise median), fix the radius
    ``τ = clip_factor × median_i ‖x_i - start‖``, then repeat
    ``v ← v + (1/n) Σ_i min(1, τ / ‖x_i - v‖) (x_i - v)``. A fixed count (no tolerance
    test) keeps the result bit-reproducible. Each iteration is two passes over all vectors.
    """
    n = len(vectors)
    out = (
        coordinate_median(vectors, block_elements=block_elements)
        if center is None
        else center.clone()
    )
    distances = _distances(vectors, out, block_elements)
    radius = clip_factor * median_of_floats(distances)
    for iteration in range(iterations):
        if iteration:
            distances = _distances(vectors, out, block_elements)
        alphas = [clip_scale(d, radius) / n for d in distances]
        for start, stop in column_blocks(out.numel(), block_elements):
            current = out[start:stop]
            step = torch.zeros_like(current)
            for vector, alpha in zip(vectors, alphas, strict=True):
                step.add_(vector[start:stop] - current, alpha=alpha)
            current.add_(step)  # after the loop: every member's pull is measured from the same v
    return out


def cosine_similarities(
    vectors: Sequence[Tensor], reference: Tensor, *, block_elements: int = BLOCK_ELEMENTS
) -> list[float]:
    """Cosine similarity of each vector with ``reference``; 0.0 where either is all zeros."""
    dots = [0.0] * len(vectors)
    squares = [0.0] * len(vectors)
    reference_square = 0.0
    for start, stop in column_blocks(reference.numel(), block_elements):
        ref = reference[start:stop].double()
        for i, vector in enumerate(vectors):
            block = vector[start:stop].double()
            dots[i] += fixed_order_sum(block * ref)
            squares[i] += fixed_order_sum(block.square_())
        reference_square += fixed_order_sum(ref.square_())
    reference_norm = math.sqrt(reference_square)
    return [
        dot / (math.sqrt(square) * reference_norm) if square > 0 and reference_norm > 0 else 0.0
        for dot, square in zip(dots, squares, strict=True)
    ]
