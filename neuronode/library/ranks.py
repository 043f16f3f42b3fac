"""A member of several processes for a loop of one's own: `torchrun` with DistributedDataParallel
(the Hugging Face Trainer and Lightning run so on several GPUs), under `--local-workers`' rules.

The processes (ranks) of one machine are one member of the swarm. DistributedDataParallel
averages their gradients at every inner step, so their working weights stay equal; rank 0 alone
runs the node (neuronode.Swarm: the exchange, the outer step, checkpoints, status), and at every
round's end (and once at the start, after rank 0 resumed and joined) it hands its parameters to
the others (`torch.distributed.broadcast`, in the loop's own process group), with a flag saying
whether the swarm is done. A member of K processes weighs K times one process's samples, at most
``max_local_workers`` (the swarm's setting, alike on every member). Rounds end after
``inner_steps`` steps on every rank: ``round_seconds`` and ``end_round`` (one rank's clock) are
refused here. The other ranks' inner optimizer states are their own: after a restart only rank
0 resumes its moments; the others' converge to them as the steps go (DDP gives every rank the
same gradients).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from neuronode.errors import ConfigError
from neuronode.library.swarm import Swarm, SwarmError, library_config


def process_group() -> tuple[int, int]:
    """(rank, world size) of the loop's process group; (0, 1) without one."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class RankedSwarm:
    """neuronode.Swarm on rank 0, its followers on the other ranks; alone, a Swarm."""

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer, *,
                 validate: Callable[[nn.Module], float] | None = None,
                 settings: Mapping[str, str] | None = None, files: Mapping[str, bytes] | None = None,
                 **options: Any) -> None:
        self.rank, self.world = process_group()
        self.model = model
        self.swarm: Swarm | None = None
        self.closed = False
        self.done = False
        if self.world > 1:
            options = {**options, "local_workers": self.world}
            if options.get("round_seconds"):
                raise ConfigError("neuronode: round_seconds ends a round by one process's clock; a member of "
                                  "several processes ends rounds after inner_steps steps (leave it out)")
        cfg = library_config(options)  # every rank checks the options alike, and fails alike
        self.inner_steps = cfg.inner_steps
        self.steps_this_round = 0
        if self.rank == 0:
            self.swarm = Swarm(model, inner_optimizer, validate=validate, settings=settings, files=files, config=cfg)
            self.steps_this_round = self.swarm.steps_this_round
        self.sync()

    def step(self, samples: int = 1, *, loss: float | None = None, tokens: int = 0) -> bool:
        """Swarm.step on every rank: rank 0 runs the round, then every rank takes its parameters."""
        if self.closed:
            raise SwarmError("step() after close(): this swarm member has left")
        if self.swarm is not None:
            ended = self.swarm.step(samples, loss=loss, tokens=tokens)
        else:
            self.steps_this_round += 1
            ended = self.steps_this_round >= self.inner_steps
        if ended and self.world > 1:
            self.sync()
        return ended

    def sync(self) -> None:
        """Every rank takes rank 0's parameters, its place in the round and whether it is done."""
        if self.world == 1:
            return
        dist = torch.distributed
        device = next(self.model.parameters()).device
        swarm = self.swarm
        head = torch.tensor([swarm.steps_this_round if swarm else 0, float(swarm.finished) if swarm else 0.0],
                            dtype=torch.float64, device=device)
        dist.broadcast(head, src=0)
        self.steps_this_round, self.done = int(head[0]), bool(head[1])
        with torch.no_grad():
            for param in self.model.parameters():
                dist.broadcast(param.data, src=0)

    @property
    def finished(self) -> bool:
        return self.swarm.finished if self.swarm is not None else self.done

    def status(self) -> dict[str, Any]:
        """Rank 0's status; {"rank": k} on the others."""
        return self.swarm.status() if self.swarm is not None else {"rank": self.rank}

    def close(self, *, abandon: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        if self.swarm is not None:
            self.swarm.close(abandon=abandon)
