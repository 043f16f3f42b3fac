"""The training side of a node: task + DiLoCo engine + codec, all synchronous.

The daemon runs every method here in its single training thread, never on the event loop.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import zlib
from typing import Any

import torch

from neuronode.codec import (
    Assembler,
    Encoded,
    ErrorFeedback,
    VectorEncoder,
    auto_zstd_level,
    get_codec,
)
from neuronode.config import NodeConfig
from neuronode.diloco import DiLoCo, InnerConfig, OuterConfig, get_aggregator
from neuronode.errors import ConfigError
from neuronode.state import GlobalState
from neuronode.training import TaskConfig, TaskError, create_task

logger = logging.getLogger(__name__)


def model_seed(swarm_id: str, seed: int) -> int:
    """Every node of a swarm builds the same initial weights from (swarm id, --seed)."""
    return zlib.crc32(f"{swarm_id}/{seed}".encode()) + (seed << 32)


def data_seed(node_id: str) -> int:
    """Each node draws its own stream of training windows."""
    return zlib.crc32(node_id.encode()) | (zlib.adler32(node_id.encode()) << 32)


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


__all__ = ["Encoded", "Trainer", "auto_zstd_level"]  # Encoded and auto_zstd_level live in codec


class Trainer:
    """Owns the task, the DiLoCo engine and error feedback. Not thread-safe: one thread only."""

    def __init__(self, cfg: NodeConfig, *, node_id: str) -> None:
        self.cfg = cfg
        torch.set_num_threads(cfg.threads or default_threads())
        self.device = pick_device(cfg.device)
        task_cfg = TaskConfig(
            seed=model_seed(cfg.swarm_id, cfg.seed), data_seed=data_seed(node_id),
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
        outer = OuterConfig(lr=cfg.outer_lr, momentum=cfg.outer_momentum)
        self.engine = DiLoCo(self.task.model, inner=inner, outer=outer)
        self.codec = get_codec(cfg.codec)
        self.feedback = ErrorFeedback(self.engine.num_elements) if self.codec.lossy else None
        self.aggregate = make_aggregator(cfg)
        self.loss = math.nan
        self.val_loss = math.nan
        self.tokens_per_s = 0.0
        # Guards the global parameters and momentum: the outer step and adopting a downloaded
        # state change them; a donor snapshots them from another thread while we train.
        self.global_lock = threading.Lock()
        self.lie: tuple[float, float] = (1.0, 0.0)  # fault drills only: (scale, noise) of a Byzantine node
        self.sent_delta: torch.Tensor | None = None  # --overlap: the pseudo-gradient in flight
        self.encoder = VectorEncoder(codec=cfg.codec, chunk_bytes=cfg.chunk_bytes, zstd_level=cfg.zstd_level,
                                     byte_shuffle=cfg.byte_shuffle, capped=cfg.max_upload_mbps > 0)
        self.param_digest = self.engine.param_digest()

    @property
    def n_params(self) -> int:
        return self.engine.num_elements

    def train_round(self, stop: threading.Event, on_step: Any = None) -> int:
        """Run this round's remaining inner steps (resumes mid-round); returns steps done now.

        A round ends after --inner-steps steps, or after --round-seconds when that is set, so
        a slow node contributes what it computed (weighted by its samples)."""
        self.task.model.train()
        done = 0
        t0 = time.perf_counter()
        tokens = 0
        self.time_limited = False
        while self.engine.steps_this_round < self.cfg.inner_steps and not stop.is_set():
            if self.cfg.round_seconds and done and time.perf_counter() - t0 >= self.cfg.round_seconds:
                self.time_limited = True
                break
            batches = [next(self.task.batches) for _ in range(self.cfg.grad_accum)]
            self.loss = self.engine.inner_step(
                batches, self.task.loss_fn, samples=self.task.samples_per_batch * len(batches))
            done += 1
            tokens += self.task.tokens_per_batch * len(batches)
            self.tokens_per_s = tokens / max(time.perf_counter() - t0, 1e-9)
            if on_step is not None:
                on_step(self)
        return done

    def round_complete(self) -> bool:
        return self.engine.steps_this_round >= self.cfg.inner_steps or (
            self.time_limited and self.engine.steps_this_round > 0)

    def compensated_delta(self) -> torch.Tensor:
        """This round's pseudo-gradient plus the error feedback carried from the last round."""
        delta = self.engine.pseudo_gradient()
        if self.lie != (1.0, 0.0):
            scale, noise = self.lie
            delta = delta * scale + noise * torch.randn_like(delta)
        if self.feedback is not None:
            delta = self.feedback.compensate(delta)
        if self.cfg.overlap:
            self.sent_delta = delta  # for look_ahead, once this round's sync is in flight
        return delta

    def look_ahead(self) -> None:
        """--overlap: the next round starts where the global parameters will be if the average
        in flight equals our own contribution (DiLoCo.look_ahead)."""
        if self.sent_delta is not None:
            with self.global_lock:
                self.engine.look_ahead(self.sent_delta)
            self.sent_delta = None

    def encode_vector(self, vector: torch.Tensor, link_bytes_per_s: float) -> Encoded:
        """Frames for the wire and our own decoded (wire) form, weighted by this round's samples."""
        return self.encoder.encode(vector, link_bytes_per_s, weight=float(max(self.engine.samples_this_round, 1)))

    def encode(self, link_bytes_per_s: float = 0.0) -> Encoded:
        """Our whole contribution (all-to-all averaging)."""
        delta = self.compensated_delta()
        enc = self.encode_vector(delta, link_bytes_per_s)
        if self.feedback is not None:
            self.feedback.update_parts(delta, [(0, enc.own)])
        return enc

    def encode_shards(self, ranges: list[tuple[int, int]], link_bytes_per_s: float = 0.0) -> list[Encoded]:
        """Our contribution cut into reduce-scatter shards, each encoded on its own."""
        delta = self.compensated_delta()
        shards = [self.encode_vector(delta[a:b], link_bytes_per_s) for a, b in ranges]
        if self.feedback is not None:
            self.feedback.update_parts(delta, [(a, e.own) for (a, _), e in zip(ranges, shards, strict=True)])
        return shards

    def reduce_shard(self, pieces: dict[str, tuple[Assembler, float]], link_bytes_per_s: float = 0.0) -> Encoded:
        """The reducer's job: aggregate every member's slice of our shard (sorted by node id),
        then encode the result for the all-gather. Its weight is the total of the pieces'."""
        avg = self.aggregate(dict(pieces))  # Assemblers: decoded lazily, or added chunk by chunk
        if not torch.isfinite(avg).all():
            logger.error("averaged shard is not finite; sending a zero update for it")
            avg = torch.zeros_like(avg)
        enc = self.encode_vector(avg, link_bytes_per_s)
        enc.weight = float(sum(weight for _, weight in pieces.values()))
        return enc

    def apply(self, contributions: dict[str, tuple[Assembler, float]]) -> str:
        """Average the round's contributions (decoded one at a time, sorted by node id), take the
        outer step, evaluate; returns the new param_digest."""
        return self.apply_average(self.aggregate(dict(contributions)))

    def apply_average(self, avg: torch.Tensor) -> str:
        """Outer step with an averaged pseudo-gradient; returns the new param_digest."""
        if not torch.isfinite(avg).all():
            logger.error("averaged pseudo-gradient is not finite; skipping the outer update")
            avg = torch.zeros_like(avg)
        with self.global_lock:
            self.engine.outer_step(avg)
            self.param_digest = self.engine.param_digest()
        self.validate()
        return self.param_digest

    def restart_from_global(self) -> None:
        """Working weights back to the global parameters (overlap's first round)."""
        with self.global_lock:
            self.engine.load_flat_global(self.engine.flat_global())
            self.engine.steps_this_round = self.engine.samples_this_round = 0

    def snapshot(self) -> GlobalState:
        """The global state for a joiner (called from a worker thread while we may train)."""
        with self.global_lock:
            return GlobalState(round=self.engine.round, param_digest=self.param_digest,
                               params=self.engine.flat_global(), momentum=self.engine.flat_momentum(),
                               inner_steps_total=self.engine.inner_steps_total)

    def adopt(self, state: GlobalState) -> str:
        """Continue from a downloaded global state: parameters, momentum, round, schedule.
        Our inner optimizer state and data stream stay ours; error feedback restarts at zero."""
        with self.global_lock:
            eng = self.engine
            eng.load_flat_global(state.params)
            eng.load_flat_momentum(state.momentum)
            eng.round, eng.inner_steps_total = state.round, state.inner_steps_total
            eng.steps_this_round = eng.samples_this_round = 0
            self.param_digest = eng.param_digest()
        if self.param_digest != state.param_digest:
            raise ValueError("adopted parameters do not hash to the donor's digest")
        if self.feedback is not None:
            self.feedback.reset()
        self.validate()
        return self.param_digest

    def validate(self) -> None:
        if self.task.validate is not None:
            self.val_loss = float(self.task.validate(self.task.model))

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"engine": self.engine.state_dict(), "loss": self.loss,
                                 "val_loss": self.val_loss}
        if hasattr(self.task.batches, "state_dict"):
            state["batches"] = self.task.batches.state_dict()
        if self.feedback is not None:
            state["feedback"] = self.feedback.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.global_lock:
            self.engine.load_state_dict(state["engine"])
            self.param_digest = self.engine.param_digest()
        self.loss, self.val_loss = state.get("loss", math.nan), state.get("val_loss", math.nan)
        if "batches" in state and hasattr(self.task.batches, "load_state_dict"):
            self.task.batches.load_state_dict(state["batches"])
        if self.feedback is not None and "feedback" in state:
            self.feedback.load_state_dict(state["feedback"])
