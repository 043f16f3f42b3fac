"""What a node trains, as its rounds see it: a model, its inner optimizer and the DiLoCo engine
around them (neuronode.diloco.DiLoCo), all synchronous.

Every method runs on the training thread (the thread of the loop that steps the model: a
person's own loop through neuronode.library, or `neuronode start`'s in neuronode.node.trainer),
never on the event loop; `snapshot` excepted: a donor reads the global state under
`global_lock` from another thread. The pseudo-gradient leaves through `pseudo_gradient()` and
its average comes back through `apply_average()`; encoding and error feedback belong to the
node's encoder (neuronode.codec.ContributionEncoder), on a thread of its own.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from neuronode.codec import is_finite
from neuronode.config import NodeConfig
from neuronode.diloco import DiLoCo
from neuronode.state import GlobalState, state_digest

logger = logging.getLogger(__name__)


class Replica:
    """One replica of the swarm's model and the counters of its round. Not thread-safe: one
    thread only (`snapshot` and the digests excepted, under `global_lock`).

    `settings` are what every member must run alike beyond the parameter shapes, by name (a
    member with another value is refused at Hello naming it); `validate` gives the validation
    loss of a model (in eval mode, no grad); `files` are written next to the weights by
    `neuronode export` (a config, a tokenizer)."""

    def __init__(self, cfg: NodeConfig, engine: DiLoCo, *, task: str, settings: Mapping[str, str],
                 samples_per_batch: int, tokens_per_batch: int = 0,
                 validate: Callable[[nn.Module], float] | None = None,
                 files: Mapping[str, bytes] | None = None) -> None:
        self.cfg = cfg
        self.engine = engine
        self.task_name = task
        self.settings = dict(settings)
        self.samples_per_batch = samples_per_batch
        self.tokens_per_batch = tokens_per_batch
        self.validate_fn = validate
        self.files = dict(files or {})
        self.moved = False  # rank 0 of a member: our state changed since the other ranks got it
        self.rank_digests: list[str] = []  # a member's ranks' param_digests at the last report
        self.loss = math.nan
        self.val_loss = math.nan
        self.tokens_per_s = 0.0
        self.ended_early = False  # this round ends before --inner-steps (--round-seconds, or its loop said so)
        self.stretch_started = time.perf_counter()  # when training last resumed (tokens/s counts from there)
        self.stretch_tokens = 0
        # Guards the global parameters and momentum: the outer step and adopting a downloaded
        # state change them; a donor snapshots them from another thread while we train.
        self.global_lock = threading.Lock()
        self.param_digest = self.state_digest = self.momentum_digest = ""
        with self.global_lock:
            self.digests()

    @property
    def n_params(self) -> int:
        return self.engine.num_elements

    @property
    def model(self) -> nn.Module:
        return self.engine.model

    # --- between rounds: the inner steps -------------------------------------------------------

    def resume(self) -> None:
        """Training (re)starts now: tokens/s counts from here."""
        self.stretch_started, self.stretch_tokens = time.perf_counter(), 0

    def count(self, samples: int, *, loss: float | None = None, tokens: int = 0) -> None:
        """One inner step was taken on `samples` samples (what the contribution weighs)."""
        self.engine.count(samples)
        if loss is not None:
            self.loss = loss
        if tokens:
            self.stretch_tokens += tokens
            self.tokens_per_s = self.stretch_tokens / max(time.perf_counter() - self.stretch_started, 1e-9)

    def round_complete(self) -> bool:
        return self.engine.steps_this_round >= self.cfg.inner_steps or (
            self.ended_early and self.engine.steps_this_round > 0)

    @property
    def local_workers(self) -> int:
        """Processes this member trains with (data-parallel; --local-workers)."""
        return self.cfg.local_workers

    @property
    def rank_tokens_per_s(self) -> list[float]:
        """Each rank's tokens/s (ours alone outside a member); their sum is the member's."""
        return [self.tokens_per_s]

    def lead(self, op: str, **payload: Any) -> None:
        """A member of several processes leads its other ranks here (neuronode.node.trainer)."""

    # --- at a round's end ----------------------------------------------------------------------

    def pseudo_gradient(self, drill: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """This round's pseudo-gradient (start - local, flat float32, a new tensor: the model may
        move on). `drill` is a fault drill's hook on it (a Byzantine node's lie), never set in
        production."""
        delta = self.engine.pseudo_gradient()
        return drill(delta) if drill is not None else delta

    @property
    def max_weight(self) -> float:
        """The most samples a contribution may claim in this swarm (--max-weight resolved)."""
        return self.cfg.weight_bound(self.samples_per_batch)

    def weight(self) -> float:
        """What this round's contribution weighs: the samples it trained on (every rank of a
        member trains as many as rank 0), at most the swarm's --max-weight (a member with a
        larger batch counts as much as the bound)."""
        return min(float(max(self.engine.samples_this_round, 1) * self.local_workers), self.max_weight)

    def look_ahead(self, delta: torch.Tensor) -> None:
        """--overlap: the next round starts where the global parameters will be if the average
        in flight equals our own contribution `delta` (DiLoCo.look_ahead)."""
        with self.global_lock:
            self.engine.look_ahead(delta)
        self.moved = True

    def apply_average(self, avg: torch.Tensor) -> str:
        """Outer step with an averaged pseudo-gradient; returns the new param_digest."""
        if not is_finite(avg):
            logger.error("averaged pseudo-gradient is not finite; skipping the outer update")
            avg = torch.zeros_like(avg)
        with self.global_lock:
            self.engine.outer_step(avg)
            self.digests()
        self.moved = True
        self.validate()
        return self.param_digest

    def digests(self) -> None:
        """param_digest, state_digest and momentum_digest of the global state (under
        global_lock): the round's start, which every replica of the swarm holds alike."""
        self.param_digest = self.engine.param_digest()
        self.state_digest, self.momentum_digest = state_digest(self.global_state())

    def restart_from_global(self) -> None:
        """Working weights back to the global parameters (overlap's first round)."""
        with self.global_lock:
            self.engine.load_flat_global(self.engine.flat_global())
            self.engine.steps_this_round = self.engine.samples_this_round = 0
        self.moved = True

    def global_norm(self) -> float:
        """L2 norm of the global parameters (what a donated state is judged against)."""
        with self.global_lock:
            return float(self.engine.flat_global().norm())

    def snapshot(self) -> GlobalState:
        """The global state for a joiner (called from a worker thread while we may train)."""
        with self.global_lock:
            return self.global_state()

    def global_state(self) -> GlobalState:
        """The global state as at the start of this round (inner steps before it); under global_lock."""
        eng = self.engine
        return GlobalState(round=eng.round, param_digest=self.param_digest, params=eng.flat_global(),
                           momentum=eng.flat_momentum(), inner_steps_total=eng.inner_steps_total - eng.steps_this_round)

    def adopt(self, state: GlobalState) -> str:
        """Continue from a downloaded global state: parameters, momentum, round, schedule.
        Our inner optimizer state and data stream stay ours (the node resets error feedback)."""
        with self.global_lock:
            eng = self.engine
            eng.load_flat_global(state.params)
            eng.load_flat_momentum(state.momentum)
            eng.round, eng.inner_steps_total = state.round, state.inner_steps_total
            eng.steps_this_round = eng.samples_this_round = 0
            self.digests()
        self.moved = True
        if self.param_digest != state.param_digest:
            raise ValueError("adopted parameters do not hash to the donor's digest")
        self.validate()
        return self.param_digest

    def validate(self) -> None:
        if self.validate_fn is not None:
            self.val_loss = float(self.validate_fn(self.engine.model))

    # --- what checkpoints hold -----------------------------------------------------------------

    def data_progress(self) -> dict[str, int]:
        """Where the data stream stands (data_pass, data_documents), where the trainer knows."""
        return {}

    def export_info(self) -> dict[str, Any]:
        """What `neuronode export` needs besides the global parameters: their names and the
        files that describe the model (config, tokenizer)."""
        return {"task": self.task_name, "names": [name for name, _, _ in self.engine.manifest()],
                "files": dict(self.files)}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds: the engine (model, inner optimizer, global parameters and
        outer momentum, counters), the last losses, what export needs."""
        return {"engine": self.engine.state_dict(), "loss": self.loss, "val_loss": self.val_loss,
                "export": self.export_info()}

    def load_state_dict(self, state: dict[str, Any], *, path: str = "") -> None:
        """Continue from a checkpoint (`path`: where it was read)."""
        with self.global_lock:
            self.engine.load_state_dict(state["engine"])
            self.digests()
        self.loss, self.val_loss = state.get("loss", math.nan), state.get("val_loss", math.nan)
