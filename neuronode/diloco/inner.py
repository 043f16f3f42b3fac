"""The built-in inner optimizer: AdamW under a warm-up + cosine schedule, with clipping and
gradient accumulation (what `neuronode start` trains with).

A person's own loop brings its own optimizer instead (neuronode.library); the outer step
(neuronode.diloco.engine) works with either, since it only reads and writes the model's
parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from neuronode.diloco.schedule import lr_at

__all__ = ["InnerConfig", "adamw", "inner_step"]


@dataclass(frozen=True, kw_only=True)
class InnerConfig:
    """Inner (local) optimiser: AdamW with warm-up + cosine schedule and clipping.

    ``total_steps`` is the schedule horizon in global inner steps and has no default on
    purpose: a silently wrong horizon decays the rate too early or never. ``grad_clip=0``
    turns clipping off. ``grad_accum`` is how many micro-batches a training loop should pass
    to :func:`inner_step`; the step itself averages over whatever it is given.
    """

    total_steps: int
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    grad_accum: int = 1

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"inner lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"inner weight_decay must be >= 0, got {self.weight_decay}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"inner betas must be two numbers in [0, 1), got {self.betas}")
        if self.total_steps < 1:
            raise ValueError(f"inner total_steps must be >= 1, got {self.total_steps}")
        if not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(
                f"inner warmup_steps must be in [0, total_steps={self.total_steps}], "
                f"got {self.warmup_steps}"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"inner min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.grad_clip < 0:
            raise ValueError(f"inner grad_clip must be >= 0 (0 = off), got {self.grad_clip}")
        if self.grad_accum < 1:
            raise ValueError(f"inner grad_accum must be >= 1, got {self.grad_accum}")

    def lr_at(self, step: int) -> float:
        """Learning rate for global inner step ``step`` under this config."""
        return lr_at(
            step,
            base_lr=self.lr,
            warmup_steps=self.warmup_steps,
            total_steps=self.total_steps,
            min_lr_ratio=self.min_lr_ratio,
        )


def adamw(params: list[nn.Parameter], config: InnerConfig) -> torch.optim.AdamW:
    """The built-in inner optimizer over ``params``."""
    return torch.optim.AdamW(params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)


def inner_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: InnerConfig,
    micro_batches: Sequence[Any],
    loss_fn: Callable[[nn.Module, Any], Tensor],
    *,
    step: int,
) -> float:
    """One step of ``optimizer`` over ``micro_batches`` with gradient accumulation; the mean loss.

    Each micro-batch's loss is divided by their count before ``backward`` so the step sees
    the mean gradient. Gradients are clipped (if ``grad_clip > 0``) and the rate is taken
    from the schedule at global inner step ``step``. The model's train/eval mode is the
    caller's business and is left as it is.
    """
    if not micro_batches:
        raise ValueError("inner_step needs at least one micro-batch")
    optimizer.zero_grad(set_to_none=True)
    loss_sum: Tensor | None = None
    for batch in micro_batches:
        loss = loss_fn(model, batch) / len(micro_batches)
        loss.backward()
        # Summed as a tensor so a GPU is synchronised once per step, not per micro-batch.
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    if config.grad_clip > 0:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
    lr = config.lr_at(step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    assert loss_sum is not None
    return float(loss_sum)
