"""A Lightning `Callback` that makes a `lightning.Trainer` run a member of a swarm (extra
``lightning``). docs/library.md says what each of the Trainer's settings means here; in short:

- one inner step is one optimizer step (``trainer.global_step`` moved): with
  ``accumulate_grad_batches=k`` a step is k batches and weighs ``batch_size x k`` samples;
- learning-rate schedulers and mixed precision stay Lightning's (the swarm averages float32
  parameters; a bf16 or 16-mixed model is cast back on every outer step);
- ``max_steps`` counts inner steps (``rounds x inner_steps`` ends on a round); the Trainer stops
  when the swarm is done (``rounds``) and leaves the swarm when it ends;
- several devices (DDP strategy): every process runs the callback; rank 0 is the member
  (neuronode.library.ranks). One optimizer only (automatic optimization).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from neuronode.errors import ConfigError
from neuronode.library.extras import need
from neuronode.library.ranks import RankedSwarm

pl = need("lightning.pytorch", extra="lightning", what="neuronode.library.lightning")


class NeuronodeCallback(pl.Callback):  # type: ignore[misc,name-defined]
    """Runs the LightningModule and its optimizer as a member of a swarm.

    Keywords are neuronode.Swarm's (NodeConfig's fields). ``batch_size`` (the samples of one
    batch) weighs each step; without it the size of the first batch is taken.
    """

    def __init__(self, *, validate: Callable[[nn.Module], float] | None = None,
                 settings: Mapping[str, str] | None = None, files: Mapping[str, bytes] | None = None,
                 **options: Any) -> None:
        self.validate, self.settings, self.files, self.options = validate, settings, files, options
        self.swarm: RankedSwarm | None = None
        self.last_step = 0
        self.accumulate = 1

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if len(trainer.optimizers) != 1:
            raise ConfigError(f"neuronode: the swarm wraps one inner optimizer; this module has "
                              f"{len(trainer.optimizers)} (configure_optimizers)")
        self.accumulate = int(trainer.accumulate_grad_batches)
        self.last_step = int(trainer.global_step)
        options = {"grad_accum": self.accumulate, **self.options}
        self.swarm = RankedSwarm(pl_module, trainer.optimizers[0], validate=self.validate, settings=self.settings,
                                 files=self.files, **options)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        swarm = self.swarm
        if swarm is None or trainer.global_step == self.last_step:
            return  # a batch accumulated, no optimizer step yet
        self.last_step = int(trainer.global_step)
        batch_size = self.options.get("batch_size") or batch_samples(batch)
        swarm.step(int(batch_size) * self.accumulate)
        if swarm.finished:
            trainer.should_stop = True

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.swarm is not None:
            self.swarm.close()


def batch_samples(batch: Any) -> int:
    """The samples in a batch: Lightning's own reading of its size."""
    from lightning.pytorch.utilities.data import extract_batch_size

    return int(extract_batch_size(batch))
