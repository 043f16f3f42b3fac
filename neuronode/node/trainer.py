"""The training side of a node: the task and the DiLoCo engine, all synchronous.

The daemon runs every method here in its single training thread, never on the event loop
(`snapshot` excepted: a donor reads the global state under `global_lock` from another thread).
The pseudo-gradient leaves through `pseudo_gradient()` and its average comes back through
`apply_average()`; encoding and error feedback belong to the node's encoder
(neuronode.codec.ContributionEncoder), on a thread of its own.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.utils import parameters_to_vector

from neuronode.config import NodeConfig
from neuronode.diloco import DiLoCo, InnerConfig, OuterConfig, get_aggregator
from neuronode.errors import ConfigError
from neuronode.node.member import Member
from neuronode.state import GlobalState, state_digest
from neuronode.training import TaskConfig, TaskError, create_task

logger = logging.getLogger(__name__)


def model_seed(swarm_id: str, seed: int) -> int:
    """Every node of a swarm builds the same initial weights from (swarm id, --seed)."""
    return zlib.crc32(f"{swarm_id}/{seed}".encode()) + (seed << 32)


def data_seed(node_id: str, rank: int = 0) -> int:
    """Each node, and each rank of a member (neuronode.node.member), draws its own stream of
    training windows; rank 0's is the stream the node would draw alone."""
    name = node_id if rank == 0 else f"{node_id}/rank-{rank}"
    return zlib.crc32(name.encode()) | (zlib.adler32(name.encode()) << 32)


def default_threads() -> int:
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def pick_device(name: str) -> str:
    if name != "auto":
        if name == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA GPU is visible; use --device auto or cpu")
        if name == "mps" and not torch.backends.mps.is_available():
            raise ConfigError("--device mps: MPS is not available here; use --device auto or cpu")
        return name
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def schedule(cfg: NodeConfig) -> tuple[int, int]:
    """(warm-up steps, schedule length): proportional to the run, not a fixed 1000 steps."""
    total = cfg.schedule_steps or (cfg.rounds * cfg.inner_steps if cfg.rounds else 10_000)
    warmup = cfg.warmup_steps if cfg.warmup_steps >= 0 else max(1, total // 20)
    return warmup, max(total, warmup + 1)


def make_aggregator(cfg: NodeConfig) -> Any:
    """--aggregator with its --aggregator-option values (numbers; 'none' turns an option off)."""
    options: dict[str, Any] = {}
    for kv in cfg.aggregator_option:
        key, value = kv.split("=", 1)
        try:
            options[key] = None if value.lower() == "none" else (int(value) if value.isdigit() else float(value))
        except ValueError:
            raise ConfigError(f"--aggregator-option: {kv!r} needs a number") from None
    try:
        return get_aggregator(cfg.aggregator, **options)
    except ValueError as exc:
        raise ConfigError(f"--aggregator-option: {exc}") from None



class Trainer:
    """Owns the task and the DiLoCo engine. Not thread-safe: one thread only.

    In a member of several processes (`member`), every rank has one; rank 0's leads the others'
    through each round (neuronode.node.member says how)."""

    def __init__(self, cfg: NodeConfig, *, node_id: str, member: Member | None = None) -> None:
        self.cfg = cfg
        self.member = member
        self.rank = member.rank if member is not None else 0
        torch.set_num_threads(cfg.threads or default_threads())
        self.device = member.device if member is not None else pick_device(cfg.device)
        task_cfg = TaskConfig(
            seed=model_seed(cfg.swarm_id, cfg.seed), data_seed=data_seed(node_id, self.rank),
            batch_size=cfg.batch_size, seq_len=cfg.seq_len, d_model=cfg.d_model,
            n_layers=cfg.n_layers, n_heads=cfg.n_heads, device=self.device,
            options=dict(kv.split("=", 1) for kv in cfg.task_option),
        )
        try:
            self.task = create_task(cfg.task, task_cfg)
        except TaskError as exc:
            msg = str(exc)
            raise ConfigError(msg if msg.startswith("--task") else f"--task: {msg}") from None
        warmup, total = schedule(cfg)
        inner = InnerConfig(lr=cfg.inner_lr, weight_decay=cfg.weight_decay, warmup_steps=warmup,
                            total_steps=total, min_lr_ratio=cfg.min_lr_ratio, grad_clip=cfg.grad_clip,
                            grad_accum=cfg.grad_accum)
        lr, momentum = cfg.outer()
        outer = OuterConfig(lr=lr, momentum=momentum)
        self.engine = DiLoCo(self.task.model, inner=inner, outer=outer)
        self.loss_fn = self.task.loss_fn if member is None else member.data_parallel(
            self.task.model, self.task.loss_fn, grad_accum=cfg.grad_accum)
        self.moved = False  # rank 0 of a member: our state changed since the other ranks got it
        self.rank_digests: list[str] = []  # a member's ranks' param_digests at the last report
        self.loss = math.nan
        self.val_loss = math.nan
        self.tokens_per_s = 0.0
        # Guards the global parameters and momentum: the outer step and adopting a downloaded
        # state change them; a donor snapshots them from another thread while we train.
        self.global_lock = threading.Lock()
        self.param_digest = self.state_digest = self.momentum_digest = ""
        with self.global_lock:
            self.digests()

    @property
    def n_params(self) -> int:
        return self.engine.num_elements

    def train_round(self, stop: threading.Event, on_step: Any = None) -> int:
        """Run this round's remaining inner steps (resumes mid-round); returns steps done now.

        A round ends after --inner-steps steps, or after --round-seconds when that is set, so
        a slow node contributes what it computed (weighted by its samples)."""
        self.lead("train")
        self.task.model.train()
        done = 0
        t0 = time.perf_counter()
        tokens = 0
        self.time_limited = False
        while self.engine.steps_this_round < self.cfg.inner_steps:
            time_up = bool(self.cfg.round_seconds and done and time.perf_counter() - t0 >= self.cfg.round_seconds)
            halt, time_up = self.agree(stop.is_set(), time_up)
            if halt:
                stop.set()  # one rank's stop is every rank's, at this same step
                break
            if time_up:
                self.time_limited = True
                break
            try:
                batches = [next(self.task.batches) for _ in range(self.cfg.grad_accum)]
            except TaskError as exc:  # a shard that became unreadable: one line, a clean stop
                raise ConfigError(f"--task: {exc}") from None
            with self.collective():
                self.loss = self.engine.inner_step(
                    batches, self.loss_fn, samples=self.task.samples_per_batch * len(batches))
            done += 1
            tokens += self.task.tokens_per_batch * len(batches)
            self.tokens_per_s = tokens / max(time.perf_counter() - t0, 1e-9)
            if on_step is not None:
                on_step(self)
        if self.member is not None and done:
            with torch.no_grad():
                total = torch.stack([p.detach().double().sum() for p in self.engine.model.parameters()]).sum()
            self.member.check_equal(float(total), what="working weights")
        return done

    def agree(self, stop: bool, time_up: bool) -> tuple[bool, bool]:
        """Whether to stop, or to end the round, before the next step: alone as we see it; in
        a member as any rank sees it (so all ranks take the same number of steps)."""
        if self.member is None:
            return stop, time_up
        return self.member.agree(stop=stop, time_up=time_up, tokens_per_s=self.tokens_per_s)

    def collective(self) -> Any:
        """Where the ranks of a member wait for each other (an inner step's all-reduce)."""
        return self.member.guarded() if self.member is not None else contextlib.nullcontext()

    @property
    def local_workers(self) -> int:
        return self.member.world if self.member is not None else 1

    @property
    def rank_tokens_per_s(self) -> list[float]:
        """Each rank's tokens/s (ours alone outside a member); their sum is the member's."""
        return list(self.member.rates) if self.member is not None else [self.tokens_per_s]

    def round_complete(self) -> bool:
        return self.engine.steps_this_round >= self.cfg.inner_steps or (
            self.time_limited and self.engine.steps_this_round > 0)

    def pseudo_gradient(self, drill: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """This round's pseudo-gradient (start - local, flat float32, a new tensor: the model may
        move on). `drill` is a fault drill's hook on it (a Byzantine node's lie), never set in
        production."""
        delta = self.engine.pseudo_gradient()
        return drill(delta) if drill is not None else delta

    @property
    def max_weight(self) -> float:
        """The most samples a contribution may claim in this swarm (--max-weight resolved)."""
        return self.cfg.weight_bound(self.task.samples_per_batch)

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
        if not torch.isfinite(avg).all():
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
        if self.task.validate is not None:
            self.val_loss = float(self.task.validate(self.task.model))

    def data_progress(self) -> dict[str, int]:
        """Where the task's data stream stands (data_pass, data_documents), if it says."""
        progress = getattr(self.task.batches, "progress", None)
        return dict(progress) if isinstance(progress, dict) else {}

    def export_info(self) -> dict[str, Any]:
        """What `neuronode export` needs besides the global parameters: their names and the
        task's files (config, tokenizer)."""
        return {"task": self.cfg.task, "names": [name for name, _, _ in self.engine.manifest()],
                "files": dict(self.task.files)}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds; in a member, every rank's data-stream position too."""
        state: dict[str, Any] = {"engine": self.engine.state_dict(), "loss": self.loss,
                                 "val_loss": self.val_loss, "export": self.export_info()}
        if hasattr(self.task.batches, "state_dict"):
            state["batches"] = self.task.batches.state_dict()  # rank 0's, where a single process keeps it
        if self.member is not None:
            self.lead("report")
            reports = self.member.gather(self.report())
            state["rank_batches"] = [r["batches"] for r in reports]
            self.rank_digests = [r["param_digest"] for r in reports]
        return state

    def load_state_dict(self, state: dict[str, Any], *, path: str = "") -> None:
        """Continue from a checkpoint (`path`: where rank 0 read it, for the other ranks)."""
        with self.global_lock:
            self.engine.load_state_dict(state["engine"])
            self.digests()
        self.loss, self.val_loss = state.get("loss", math.nan), state.get("val_loss", math.nan)
        streams = state.get("rank_batches") or [state.get("batches")]
        mine = streams[self.rank] if self.rank < len(streams) else None
        if mine is not None and hasattr(self.task.batches, "load_state_dict"):
            self.task.batches.load_state_dict(mine)
        self.lead("restore", path=path)

    # --- a member of several processes (neuronode.node.member) -----------------------------

    def lead(self, op: str, **payload: Any) -> None:
        """Rank 0 of a member: send the other ranks command `op`, and our state first if it
        moved since they last got it. Nothing outside a member, or on the other ranks."""
        member = self.member
        if member is None or not member.leader:
            return
        eng = self.engine
        # The working weights are θ_g after an outer step or an adopted state; only the --overlap
        # look-ahead starts a round elsewhere, and only then do they travel too.
        counters = {"round": eng.round, "inner_steps_total": eng.inner_steps_total,
                    "steps_this_round": eng.steps_this_round, "samples_this_round": eng.samples_this_round,
                    "working": eng.start_offset is not None}
        member.command(op, {**payload, "state": counters if self.moved else None})
        if self.moved:  # (θ_g changes on this thread only: no lock to read it here)
            member.broadcast(eng.flat_global())
            if counters["working"]:
                member.broadcast(parameters_to_vector(eng.model.parameters()))
            self.moved = False

    def follow(self, payload: dict[str, Any]) -> None:
        """Another rank: take rank 0's state when a command brings it (see `lead`)."""
        counters = payload.get("state")
        if counters is None or self.member is None:
            return
        eng = self.engine
        flat = torch.empty(eng.num_elements, dtype=torch.float32)
        self.member.broadcast(flat)
        with self.global_lock:
            eng.load_flat_global(flat)  # the working weights too
        if counters["working"]:
            working = parameters_to_vector(eng.model.parameters()).detach()
            self.member.broadcast(working)
            with torch.no_grad():
                start = 0
                for param in eng.model.parameters():  # in place: DDP and AdamW hold these tensors
                    param.copy_(working[start:start + param.numel()].view_as(param))
                    start += param.numel()
        with self.global_lock:
            eng.round, eng.inner_steps_total = counters["round"], counters["inner_steps_total"]
            eng.steps_this_round, eng.samples_this_round = counters["steps_this_round"], counters["samples_this_round"]
            self.param_digest = eng.param_digest()

    def report(self) -> dict[str, Any]:
        """This rank's part of a member's checkpoint and status."""
        batches = self.task.batches.state_dict() if hasattr(self.task.batches, "state_dict") else None
        return {"rank": self.rank, "batches": batches, "param_digest": self.param_digest,
                "tokens_per_s": self.tokens_per_s}
