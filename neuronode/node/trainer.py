"""`neuronode start`'s training side: the task (model, data, loss), the built-in inner AdamW,
and the training loop that steps them and hands every step to the node (neuronode.library's
Swarm.step, as a person's own loop does), all synchronous on the training thread.

In a member of several processes every rank has a Trainer; rank 0's leads the others through
each round (neuronode.node.member says how). What the rounds need of a replica (pseudo-gradient,
outer step, adoption, checkpoints) is neuronode.node.replica's.
"""

from __future__ import annotations

import contextlib
import logging
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
from neuronode.diloco.inner import inner_step
from neuronode.errors import ConfigError
from neuronode.node.member import Member
from neuronode.node.replica import Replica
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



class Trainer(Replica):
    """Owns the task and the built-in inner optimizer. Not thread-safe: one thread only.

    In a member of several processes (`member`), every rank has one; rank 0's leads the others'
    through each round (neuronode.node.member says how)."""

    def __init__(self, cfg: NodeConfig, *, node_id: str, member: Member | None = None) -> None:
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
        task, self.inner = self.task, inner
        super().__init__(cfg, DiLoCo(task.model, inner=inner, outer=OuterConfig(lr=lr, momentum=momentum)),
                         task=cfg.task, settings=task.settings, samples_per_batch=task.samples_per_batch,
                         tokens_per_batch=task.tokens_per_batch, validate=task.validate, files=task.files)
        self.loss_fn = task.loss_fn if member is None else member.data_parallel(
            task.model, task.loss_fn, grad_accum=cfg.grad_accum)

    def train(self, step: Callable[..., bool], *, stop: threading.Event, finished: Callable[[], bool]) -> None:
        """`neuronode start`'s training loop: rounds of inner steps, each step handed to `step`
        (Swarm.step: after a round's last step it runs the round), until a stop or `finished`."""
        while not stop.is_set() and not finished():
            self.train_round(stop, step)

    def train_round(self, stop: threading.Event, step: Callable[..., bool] | None = None) -> int:
        """Run this round's remaining inner steps (resumes mid-round); returns steps done now.

        Each step goes to `step` (rank 0's Swarm.step, which runs the round after its last
        one); without one (the other ranks of a member) it is counted here. A round ends after
        --inner-steps steps, or after --round-seconds when that is set, so a slow node
        contributes what it computed (weighted by its samples); in a member the ranks agree
        after every step whether it ends or stops, so all take the same steps."""
        self.lead("train")
        self.task.model.train()
        self.resume()
        done = 0
        t0 = time.perf_counter()
        while self.engine.steps_this_round < self.cfg.inner_steps:
            try:
                batches = [next(self.task.batches) for _ in range(self.cfg.grad_accum)]
            except TaskError as exc:  # a shard that became unreadable: one line, a clean stop
                raise ConfigError(f"--task: {exc}") from None
            with self.collective():
                loss = inner_step(self.engine.model, self.engine.inner_optimizer, self.inner,
                                  batches, self.loss_fn, step=self.engine.inner_steps_total)
            done += 1
            time_up = bool(self.cfg.round_seconds and time.perf_counter() - t0 >= self.cfg.round_seconds)
            halt, time_up = self.agree(stop.is_set(), time_up)
            last = time_up or self.engine.steps_this_round + 1 >= self.cfg.inner_steps
            if self.member is not None and (last or halt):
                self.check_working_weights()
            samples, tokens = self.task.samples_per_batch * len(batches), self.task.tokens_per_batch * len(batches)
            if step is not None:
                step(samples, loss=loss, tokens=tokens, end_round=last)
            else:
                self.ended_early = time_up
                self.count(samples, loss=loss, tokens=tokens)
            if halt:
                stop.set()  # one rank's stop is every rank's, at this same step
            if halt or last:
                break
        return done

    def check_working_weights(self) -> None:
        """Every rank of a member ends a round with the same working weights."""
        assert self.member is not None
        with torch.no_grad():
            total = torch.stack([p.detach().double().sum() for p in self.engine.model.parameters()]).sum()
        self.member.check_equal(float(total), what="working weights")

    def agree(self, stop: bool, time_up: bool) -> tuple[bool, bool]:
        """Whether to stop, or to end the round, after a step: alone as we see it; in a member
        as any rank sees it (so all ranks take the same number of steps)."""
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

    def data_progress(self) -> dict[str, int]:
        """Where the task's data stream stands (data_pass, data_documents), if it says."""
        progress = getattr(self.task.batches, "progress", None)
        return dict(progress) if isinstance(progress, dict) else {}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds; in a member, every rank's data-stream position too."""
        state = super().state_dict()
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
        super().load_state_dict(state, path=path)
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
