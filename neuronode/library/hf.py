"""A Hugging Face `TrainerCallback` that makes a `transformers.Trainer` run a member of a swarm
(extra ``hf-trainer``: transformers and accelerate). docs/library.md says what each of the
Trainer's settings means here; in short:

- one inner step is one optimizer step of the Trainer (``on_step_end``): gradient accumulation
  stays inside it, and a step weighs ``per_device_train_batch_size x
  gradient_accumulation_steps`` samples;
- your learning-rate schedule is the Trainer's, stepped per inner step as always (rounds do not
  touch it); mixed precision is the Trainer's too (the swarm averages float32 parameters);
- ``max_steps`` counts inner steps: ``max_steps = rounds x inner_steps`` ends on a round; steps
  after the last round stay local (checkpointed in the data dir, resumed by a restart);
- the Trainer stops when the swarm is done (``rounds``), and leaves the swarm when it ends;
- several processes (torchrun, DDP): every process runs the callback; rank 0 is the member
  (neuronode.library.ranks).

With ``tokenizer`` and ``seq_len`` the member declares what ``neuronode start --task hf``
declares (sizes, architecture, tokenizer, sequence length, initial weights) and exports alike,
so a Trainer and `neuronode start --task hf` members with the same model share one swarm.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from neuronode.library.extras import need
from neuronode.library.ranks import RankedSwarm
from neuronode.training.task import TaskError

transformers = need("transformers", extra="hf-trainer", what="neuronode.library.hf")
need("accelerate", extra="hf-trainer", what="transformers.Trainer")


class NeuronodeCallback(transformers.TrainerCallback):  # type: ignore[misc,name-defined]
    """Runs the Trainer's model and optimizer as a member of a swarm.

    Keywords are neuronode.Swarm's (NodeConfig's fields: ``peers``, ``swarm_id``,
    ``inner_steps``, ``data_dir``, ...). ``batch_size`` and ``grad_accum`` default to the
    Trainer's ``per_device_train_batch_size`` and ``gradient_accumulation_steps``.
    """

    def __init__(self, *, tokenizer: Any = None, seq_len: int | None = None,
                 validate: Callable[[nn.Module], float] | None = None,
                 settings: Mapping[str, str] | None = None, files: Mapping[str, bytes] | None = None,
                 **options: Any) -> None:
        if (tokenizer is None) != (seq_len is None):
            raise TaskError("NeuronodeCallback: give tokenizer and seq_len together (what --task hf declares), "
                            "or neither")
        self.tokenizer, self.seq_len = tokenizer, seq_len
        self.validate, self.settings, self.files = validate, settings, files
        self.options = options
        self.swarm: RankedSwarm | None = None
        self.samples_per_step = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model, optimizer = kwargs["model"], kwargs["optimizer"]
        options = {"batch_size": args.per_device_train_batch_size,
                   "grad_accum": args.gradient_accumulation_steps, "task": "hf", **self.options}
        settings, files = self.settings, self.files
        if self.tokenizer is not None and self.seq_len is not None:
            declared = hf_declaration(model, self.tokenizer, seq_len=self.seq_len)
            settings = {**declared[0], **(settings or {})}
            files = {**declared[1], **(files or {})}
        self.samples_per_step = int(options["batch_size"]) * int(options["grad_accum"])
        # accelerate wraps the optimizer; the swarm keeps the one that steps the parameters.
        inner = getattr(optimizer, "optimizer", optimizer)
        self.swarm = RankedSwarm(model, inner, validate=self.validate, settings=settings, files=files, **options)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        swarm = self.swarm
        if swarm is None:
            return
        loss = next((entry["loss"] for entry in reversed(state.log_history) if "loss" in entry), None)
        swarm.step(self.samples_per_step, loss=loss)
        if swarm.finished:
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.swarm is not None:
            self.swarm.close()


def hf_declaration(model: nn.Module, tokenizer: Any, *, seq_len: int) -> tuple[dict[str, str], dict[str, bytes]]:
    """What `--task hf` declares for this model, tokenizer and sequence length (its settings,
    compared at Hello) and exports next to the weights (config.json, tokenizer files)."""
    from neuronode.training import hf
    from neuronode.training.tokenizer import tokenizer_hash

    config = model.config
    settings = hf.settings(config, seq_len=seq_len, tok_hash=tokenizer_hash(tokenizer), init=hf.weights_digest(model))
    return settings, hf.export_files(config, tokenizer)
