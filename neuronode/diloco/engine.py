"""The DiLoCo engine: the global parameters and their outer Nesterov SGD step, around a model
trained by an inner optimizer (the built-in AdamW of neuronode.diloco.inner, or any other).

Pure torch, no networking: how pseudo-gradients travel between peers is someone else's job.
The engine is also meant for a person's own training loop::

    from neuronode.diloco import DiLoCo, InnerConfig, OuterConfig, average

    engine = DiLoCo(model, inner=InnerConfig(total_steps=10_000), outer=OuterConfig())
    loss_fn = lambda m, batch: torch.nn.functional.cross_entropy(m(batch[0]), batch[1])
    for round_id in range(num_rounds):
        for _ in range(steps_per_round):          # H inner steps, no communication
            engine.inner_step([next(batches)], loss_fn)
        delta = engine.pseudo_gradient()           # flat float32 CPU vector
        contributions = exchange(round_id, delta, engine.samples_this_round)  # your transport
        engine.outer_step(average(contributions))  # every peer applies the same vector

With an optimizer of one's own, ``DiLoCo(model, inner_optimizer=opt, outer=...)``: step it as
usual and call ``engine.count(samples)`` after each step instead of ``inner_step``. After
``outer_step`` the model holds the new global parameters and the next round starts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from neuronode.diloco.inner import InnerConfig, adamw, inner_step
from neuronode.diloco.saved import capture_rng, cpu_copy, restore_rng
from neuronode.errors import NeuronodeError
from neuronode.memory import empty_floats

__all__ = ["DiLoCo", "InnerConfig", "OuterConfig", "StateMismatchError"]

STATE_VERSION = 1


class StateMismatchError(NeuronodeError, ValueError):
    """A state dict or flat vector does not fit this engine's model."""


@dataclass(frozen=True, kw_only=True)
class OuterConfig:
    """Outer optimiser: SGD with (Nesterov) momentum on the global parameters.

    Nesterov is applied only when ``momentum > 0`` (torch rejects it otherwise), so
    ``OuterConfig(lr=1.0, momentum=0.0)`` is plain averaging of the peers' weights.
    """

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"outer lr must be > 0, got {self.lr}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"outer momentum must be in [0, 1), got {self.momentum}")

    @property
    def effective_nesterov(self) -> bool:
        """Whether the SGD step really uses Nesterov momentum."""
        return self.nesterov and self.momentum > 0


class DiLoCo:
    """One replica's DiLoCo state: working model, global params and both optimisers.

    The model's own parameters are the working (local) weights, trained by the inner
    optimizer: the built-in AdamW (``inner=InnerConfig(...)``, stepped by :meth:`inner_step`)
    or one of the caller's (``inner_optimizer=``, stepped by the caller, who calls
    :meth:`count` after each step). The global parameters ``θ_g`` are a detached float32 copy
    on ``outer_device``, one tensor per parameter in ``model.named_parameters()`` order,
    stepped by ``torch.optim.SGD``.

    Counters: ``round`` (completed outer steps), ``inner_steps_total`` (drives the inner
    schedule, persists across rounds), ``steps_this_round`` and ``samples_this_round``.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        inner: InnerConfig | None = None,
        outer: OuterConfig,
        outer_device: str | torch.device = "cpu",
        inner_optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        if (inner is None) == (inner_optimizer is None):
            raise ValueError("give DiLoCo either inner=InnerConfig(...) (the built-in AdamW) or inner_optimizer=")
        self.model = model
        self.inner_config = inner
        self.outer_config = outer
        self.outer_device = torch.device(outer_device)
        named = list(model.named_parameters())
        if not named:
            raise ValueError("model has no parameters to train")
        self._names = [name for name, _ in named]
        self._params = [param for _, param in named]
        self.global_params = [
            p.detach().to(self.outer_device, torch.float32, copy=True) for p in self._params
        ]
        self._numels = [p.numel() for p in self._params]
        self.num_elements = sum(self._numels)
        # --overlap lookahead: this round started at θ_g − start_offset (None: at θ_g).
        self.start_offset: Tensor | None = None
        if inner_optimizer is not None:
            check_optimizer(inner_optimizer, named)
        self.inner_optimizer = inner_optimizer if inner_optimizer is not None else adamw(self._params, inner)  # type: ignore[arg-type]
        self.outer_optimizer = torch.optim.SGD(
            self.global_params,
            lr=outer.lr,
            momentum=outer.momentum,
            nesterov=outer.effective_nesterov,
        )
        self.round = 0
        self.inner_steps_total = 0
        self.steps_this_round = 0
        self.samples_this_round = 0

    # ----------------------------------------------------------------- inner loop

    def inner_step(
        self,
        micro_batches: Sequence[Any],
        loss_fn: Callable[[nn.Module, Any], Tensor],
        *,
        samples: int | None = None,
    ) -> float:
        """One step of the built-in AdamW over ``micro_batches`` (neuronode.diloco.inner.
        inner_step: accumulation, clipping, the schedule at ``inner_steps_total``), counted;
        the mean loss. ``samples`` (default: number of micro-batches) is added to
        ``samples_this_round``, the weight this replica's pseudo-gradient gets in the average.
        """
        if self.inner_config is None:
            raise ValueError("inner_step steps the built-in AdamW; with inner_optimizer= step "
                             "your optimizer and call count()")
        if samples is not None and samples < 0:
            raise ValueError(f"samples must be >= 0, got {samples}")
        loss = inner_step(self.model, self.inner_optimizer, self.inner_config, micro_batches, loss_fn,
                          step=self.inner_steps_total)
        self.count(len(micro_batches) if samples is None else samples)
        return loss

    def count(self, samples: int) -> None:
        """One inner step was taken, on ``samples`` samples (what the contribution weighs)."""
        self.inner_steps_total += 1
        self.steps_this_round += 1
        self.samples_this_round += samples

    # ----------------------------------------------------------------- outer step

    def pseudo_gradient(self) -> Tensor:
        """This round's pseudo-gradient as a flat float32 CPU vector.

        Sign convention (the one place it is stated): ``Δ = θ_g − θ_local``, i.e. the
        round's start minus the trained weights. Δ points like a gradient (uphill), so
        ``outer_step`` can hand it to SGD as ``.grad`` unchanged.
        """
        with torch.no_grad():
            parts = [
                (g - p.detach().to(self.outer_device, torch.float32)).reshape(-1)
                for g, p in zip(self.global_params, self._params, strict=True)
            ]
            on_cpu = self.outer_device.type == "cpu"
            delta = torch.cat(parts, out=empty_floats(self.num_elements)) if on_cpu else torch.cat(parts).cpu()
            if self.start_offset is not None:  # the round started at θ_g − offset, not θ_g
                delta.sub_(self.start_offset)
            return delta

    def outer_step_preview(self, delta: Tensor) -> Tensor:
        """The step ``outer_step(delta)`` would subtract from ``θ_g`` (flat, CPU), computed as
        torch.optim.SGD does (momentum buffer, Nesterov) without changing ``θ_g`` or the buffer."""
        self._check_flat(delta, "delta")
        cfg = self.outer_config
        step = delta.clone()
        if cfg.momentum > 0:
            buf = self.flat_momentum()
            buf = step.clone() if buf is None else buf.mul_(cfg.momentum).add_(step)
            step = step.add_(buf, alpha=cfg.momentum) if cfg.effective_nesterov else buf
        return step.mul_(cfg.lr)

    def look_ahead(self, delta: Tensor) -> None:
        """--overlap: start the next round where ``θ_g`` will be if the average still in flight
        equals ``delta`` (our own pseudo-gradient of that round): working weights = ``θ_g`` minus
        :meth:`outer_step_preview`. ``θ_g`` and the momentum stay as they are (replicas share
        them); :meth:`pseudo_gradient` measures from the shifted start. This compensates the
        one-round delay of the overlapped outer step, which alone diverges at momentum 0.9."""
        offset = self.outer_step_preview(delta)
        with torch.no_grad():
            for p, g, o in zip(self._params, self.global_params, self._split(offset.to(self.outer_device)),
                               strict=True):
                p.copy_(g - o.reshape(g.shape))
        self.start_offset = offset

    def outer_step(self, avg_delta: Tensor) -> None:
        """Apply the averaged pseudo-gradient to ``θ_g`` and restart the model from it.

        The SGD step moves the global parameters (the round's starting point), never the
        locally trained weights; those are overwritten with the new ``θ_g`` afterwards.
        """
        self._check_flat(avg_delta, "avg_delta")
        # On CUDA, SGD's foreach path adds momentum into .grad in place; copy so the
        # caller's vector is never modified. On CPU the single-tensor path leaves it alone.
        source = avg_delta.to(self.outer_device, copy=self.outer_device.type != "cpu")
        for g, view in zip(self.global_params, self._split(source), strict=True):
            g.grad = view.reshape(g.shape)
        self.outer_optimizer.step()
        for g in self.global_params:
            g.grad = None  # drop the references to the caller's vector
        self._copy_global_into_model()
        self.start_offset = None
        self.round += 1
        self.steps_this_round = 0
        self.samples_this_round = 0

    # --------------------------------------------------------- global parameters

    def flat_global(self) -> Tensor:
        """A flat float32 CPU copy of the global parameters."""
        return torch.cat([g.detach().reshape(-1) for g in self.global_params]).cpu()

    def load_flat_global(self, flat: Tensor) -> None:
        """Set ``θ_g`` and the model's weights from a flat vector (state transfer).

        Optimiser states and counters are left alone; see :meth:`load_flat_momentum`.
        """
        self._check_flat(flat, "flat")
        source = flat.to(self.outer_device)
        with torch.no_grad():
            for g, view in zip(self.global_params, self._split(source), strict=True):
                g.copy_(view.reshape(g.shape))
        self._copy_global_into_model()
        self.start_offset = None

    def flat_momentum(self) -> Tensor | None:
        """The outer momentum buffer as a flat float32 CPU vector, or ``None`` if unset.

        Every replica must hold the same buffer, or identical averages give different
        ``θ_g``; a joining peer needs it along with :meth:`flat_global`.
        """
        state = self.outer_optimizer.state
        buffers = [state.get(g, {}).get("momentum_buffer") for g in self.global_params]
        if any(b is None for b in buffers):
            return None
        return torch.cat([b.reshape(-1) for b in buffers if b is not None]).cpu()

    def load_flat_momentum(self, flat: Tensor | None) -> None:
        """Set the outer momentum buffer from a flat vector (``None`` clears it)."""
        if flat is None:
            for g in self.global_params:
                self.outer_optimizer.state.pop(g, None)
            return
        self._check_flat(flat, "flat momentum")
        source = flat.to(self.outer_device)
        for g, view in zip(self.global_params, self._split(source), strict=True):
            self.outer_optimizer.state[g]["momentum_buffer"] = view.reshape(g.shape).clone()

    def param_digest(self) -> str:
        """sha256 hex of ``θ_g``: float32 little-endian bytes in parameter order."""
        hasher = hashlib.sha256()
        for g in self.global_params:
            array = g.detach().cpu().contiguous().numpy()
            hasher.update(np.ascontiguousarray(array, dtype="<f4").data)
        return hasher.hexdigest()

    def manifest(self) -> list[tuple[str, tuple[int, ...], str]]:
        """``(name, shape, dtype)`` per parameter, in order.

        The dtype is that of what peers exchange (``θ_g`` and Δ, always float32), not the
        model's working dtype, so a bf16 replica and a float32 replica stay compatible.
        """
        return [
            (name, tuple(g.shape), str(g.dtype).removeprefix("torch."))
            for name, g in zip(self._names, self.global_params, strict=True)
        ]

    def manifest_hash(self) -> str:
        """sha256 hex of the manifest as compact JSON (peers must agree on it)."""
        canonical = json.dumps(
            [[name, list(shape), dtype] for name, shape, dtype in self.manifest()],
            separators=(",", ":"),
        )
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    # ---------------------------------------------------------------- state dict

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-exactly, as CPU copies.

        Holds only tensors, numbers, strings, lists, tuples and dicts, so it loads with
        ``torch.load(..., weights_only=True)``.
        """
        return {
            "version": STATE_VERSION,
            "manifest_hash": self.manifest_hash(),
            "global_params": [g.detach().cpu().clone() for g in self.global_params],
            "model": cpu_copy(self.model.state_dict()),
            "inner_optimizer": cpu_copy(self.inner_optimizer.state_dict()),
            "outer_optimizer": cpu_copy(self.outer_optimizer.state_dict()),
            "counters": {
                "round": self.round,
                "inner_steps_total": self.inner_steps_total,
                "steps_this_round": self.steps_this_round,
                "samples_this_round": self.samples_this_round,
            },
            "rng": capture_rng(),
            "start_offset": None if self.start_offset is None else self.start_offset.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`, including RNG states.

        Hyper-parameters come from this engine's configs, not the checkpoint, so a resumed
        run can change e.g. the outer lr; moments, momentum and counters come from ``state``.
        """
        if state.get("version") != STATE_VERSION:
            raise StateMismatchError(
                f"state version {state.get('version')!r} is not {STATE_VERSION}; "
                "it was written by an incompatible neuronode"
            )
        if state["manifest_hash"] != self.manifest_hash():
            raise StateMismatchError(
                "checkpoint was written for a different model (manifest hash differs); "
                "build the same model architecture before loading"
            )
        with torch.no_grad():
            for g, saved in zip(self.global_params, state["global_params"], strict=True):
                g.copy_(saved)
        self.model.load_state_dict(state["model"])
        self.inner_optimizer.load_state_dict(state["inner_optimizer"])
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self._apply_config_hyperparameters()
        counters = state["counters"]
        self.round = int(counters["round"])
        self.inner_steps_total = int(counters["inner_steps_total"])
        self.steps_this_round = int(counters["steps_this_round"])
        self.samples_this_round = int(counters["samples_this_round"])
        restore_rng(state["rng"])
        offset = state.get("start_offset")
        self.start_offset = None if offset is None else offset.clone()

    # ------------------------------------------------------------------- helpers

    def _apply_config_hyperparameters(self) -> None:
        if self.inner_config is not None:  # the built-in AdamW's; another optimizer's are its own
            for group in self.inner_optimizer.param_groups:
                group.update(betas=self.inner_config.betas, weight_decay=self.inner_config.weight_decay)
        for group in self.outer_optimizer.param_groups:
            group.update(
                lr=self.outer_config.lr,
                momentum=self.outer_config.momentum,
                nesterov=self.outer_config.effective_nesterov,
            )

    def _copy_global_into_model(self) -> None:
        with torch.no_grad():
            for p, g in zip(self._params, self.global_params, strict=True):
                p.copy_(g)  # copy_ casts dtype and moves device as needed

    def _split(self, flat: Tensor) -> tuple[Tensor, ...]:
        return torch.split(flat, self._numels)

    def _check_flat(self, flat: Tensor, what: str) -> None:
        if flat.dim() != 1 or flat.dtype != torch.float32 or flat.numel() != self.num_elements:
            raise StateMismatchError(
                f"{what} must be a 1-D float32 tensor of {self.num_elements} elements, "
                f"got shape {tuple(flat.shape)} dtype {flat.dtype}"
            )


def check_optimizer(optimizer: torch.optim.Optimizer, named: list[tuple[str, nn.Parameter]]) -> None:
    """An inner optimizer must step the model's own parameters (the working weights the outer
    step reads and overwrites), and nothing else."""
    ours = {id(p) for _, p in named}
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = [p for p in stepped if id(p) not in ours]
    if foreign:
        raise StateMismatchError(
            f"the inner optimizer steps {len(foreign)} of its {len(stepped)} tensors that are not "
            "parameters of the model (was it built over another model, or a copy?); build it from "
            "this model's parameters, e.g. torch.optim.AdamW(model.parameters())")
