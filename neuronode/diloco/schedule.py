"""Inner learning-rate schedule: linear warm-up, then cosine decay to a floor.

A pure function of the global inner step, so a resumed run (or a person's own loop)
gets the same rate for the same step without carrying scheduler objects around.
"""

from __future__ import annotations

import math

__all__ = ["lr_at"]


def lr_at(
    step: int,
    *,
    base_lr: float,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float,
) -> float:
    """Return the learning rate for inner step ``step`` (0-based).

    Warm-up is linear and does not start at zero: step ``s < warmup_steps`` gets
    ``base_lr * (s + 1) / warmup_steps``, so the first step already moves the weights and
    the last warm-up step reaches ``base_lr``. From ``warmup_steps`` the rate follows a
    cosine from ``base_lr`` down to ``base_lr * min_lr_ratio`` at ``total_steps`` and stays
    there. ``warmup_steps=0`` means no warm-up.
    """
    _check_schedule(step, base_lr, warmup_steps, total_steps, min_lr_ratio)
    min_lr = base_lr * min_lr_ratio
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr
    # total_steps > step >= warmup_steps here, so the denominator is at least 1.
    progress = (step - warmup_steps) / (total_steps - warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr + cosine * (base_lr - min_lr)


def _check_schedule(
    step: int, base_lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float
) -> None:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if not base_lr > 0:
        raise ValueError(f"base_lr must be > 0, got {base_lr}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if total_steps < warmup_steps:
        raise ValueError(
            f"total_steps ({total_steps}) must be >= warmup_steps ({warmup_steps}); "
            "raise total_steps or shorten the warm-up"
        )
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
