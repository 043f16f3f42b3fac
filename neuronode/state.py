"""Plain data shared by the training side and the swarm side."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GlobalState:
    """What a node needs to continue with the swarm's model."""

    round: int
    param_digest: str
    params: torch.Tensor  # flat float32
    momentum: torch.Tensor | None  # flat float32, None before the first outer step
    inner_steps_total: int
