"""The task plug-in interface: what a model, its data and its loss look like to the daemon.

A *task factory* is any callable ``TaskConfig -> Task``. The daemon picks one with
``--task SPEC`` where SPEC is a built-in name (see ``BUILTIN_TASKS``) or
``package.module:factory``, resolved by :func:`load_task`.

Contract a factory must keep, because every node of a swarm runs it independently:

- ``cfg.seed`` is the same on every node: the initial weights must be a pure function of it
  (bit-identical everywhere), so the first outer round starts from one model.
- ``cfg.data_seed`` differs per node: the batch stream should depend on it, so nodes see
  different data.
- ``loss_fn(model, batch)`` calls the ``model`` it is given, not the one it built: in a member
  of several processes (``--local-workers``, torchrun) that is the DistributedDataParallel
  wrapper, whose forward makes the backward average the gradients of all processes; each
  process gets its own ``cfg.data_seed``.
- if ``Task.batches`` has ``state_dict()`` / ``load_state_dict()`` (see
  :class:`StatefulIterator`), the daemon checkpoints it and a restarted node resumes the
  same stream instead of replaying it.
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "BUILTIN_TASKS",
    "StatefulIterator",
    "Task",
    "TaskConfig",
    "TaskError",
    "TaskFactory",
    "create_task",
    "load_task",
    "task_device",
]

_MAX_SEED = 2**64  # torch.Generator.manual_seed takes 64-bit seeds


class TaskError(ValueError):
    """A task spec, option or config the user can fix; the message says how."""


@dataclass(frozen=True)
class TaskConfig:
    """What the daemon passes to a task factory."""

    seed: int  # model-init seed: the same on every node of a swarm
    data_seed: int  # data-stream seed: different per node
    batch_size: int = 16
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    device: str = "cpu"
    options: Mapping[str, str] = field(default_factory=dict)  # from --task-option k=v

    def __post_init__(self) -> None:
        for name in ("seed", "data_seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value < _MAX_SEED:
                raise TaskError(f"task {name} must be an integer in [0, 2**64), got {value!r}")
        for name in ("batch_size", "seq_len", "d_model", "n_layers", "n_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise TaskError(f"task {name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise TaskError(
                f"task d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        # A read-only copy: a factory must not be able to change what the caller passed.
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))


@dataclass
class Task:
    """One training task: a model, an endless batch stream and a loss."""

    model: nn.Module
    batches: Iterator[Any]  # infinite; batches already on the task's device
    loss_fn: Callable[[nn.Module, Any], Tensor]  # (model, batch) -> scalar loss
    # Deterministic validation loss: no grad, model.eval(), then the previous mode restored.
    validate: Callable[[nn.Module], float] | None = None
    samples_per_batch: int = 1
    tokens_per_batch: int = 0  # for tokens/s display; 0 = unknown
    # What every node of a swarm must run alike beyond the parameter shapes (sizes, tokenizer,
    # sequence length), by name, in the order they are compared at Hello: a member with another
    # value is refused with a message naming the setting and both values.
    settings: Mapping[str, str] = field(default_factory=dict)
    # Files that describe the model, written next to its weights by `neuronode export`
    # (config.json, tokenizer files), by file name.
    files: Mapping[str, bytes] = field(default_factory=dict)


TaskFactory = Callable[[TaskConfig], Task]


def next_token_objective(
    logits_of: Callable[[nn.Module, Tensor], Tensor], val: Tensor, *, bf16: bool, batch_size: int | None = None,
) -> tuple[Callable[[nn.Module, Any], Tensor], Callable[[nn.Module], float]]:
    """A language model's `loss_fn` and `validate` for a Task: mean next-token cross-entropy of
    `logits_of(model, x)` (under bf16 autocast when asked), and its mean over the validation
    windows `val` (in batches of `batch_size` windows; None: one batch), in eval mode."""

    def loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            logits = logits_of(model, x)  # (B, T, vocab)
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))

    def loss_fn(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        return loss(model, x, y)

    def validate(model: nn.Module) -> float:
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                if batch_size is None:
                    return loss(model, val[:, :-1], val[:, 1:]).item()
                losses = [loss(model, w[:, :-1], w[:, 1:]) * w.size(0) for w in val.split(batch_size)]
                return float(torch.stack(losses).sum() / val.size(0))
        finally:
            model.train(was_training)

    return loss_fn, validate


def task_device(name: str) -> torch.device:
    """``TaskConfig.device`` as a torch device; a TaskError saying what to use instead."""
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise TaskError(f"task device {name!r} is not a torch device: {e}") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TaskError(f"task device {name!r}: CUDA is not available; use --device cpu")
    return device


@runtime_checkable
class StatefulIterator(Protocol):
    """A batch iterator whose position can be saved and restored (checkpointed by the daemon)."""

    def __next__(self) -> Any: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


# Built-in tasks by the `package.module:factory` spec they stand for: resolved like a plug-in's
# (so a plug-in user never pays for the built-in corpus code, and this module imports none of them).
_BUILTINS: dict[str, str] = {
    "bytelm": "neuronode.training.bytelm:factory",
    "builtin": "neuronode.training.bytelm:factory",
    # Hugging Face architectures, tokenizers and local data (the hf extra).
    "hf": "neuronode.training.hf:factory",
}
BUILTIN_TASKS: tuple[str, ...] = tuple(_BUILTINS)

_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def load_task(spec: str) -> TaskFactory:
    """Resolve ``--task SPEC`` to a factory: a built-in name or ``package.module:factory``.

    Raises TaskError with a one-line fix for an unknown name, bad syntax, a module that is
    not importable, a missing attribute or an attribute that is not callable.
    """
    spec = spec.strip()
    spec = _BUILTINS.get(spec, spec)
    if ":" not in spec:
        raise TaskError(
            f"--task {spec}: unknown task; use a built-in one ({', '.join(BUILTIN_TASKS)}) "
            "or 'package.module:factory'"
        )
    module_name, _, attr_path = spec.partition(":")
    if not _DOTTED.fullmatch(module_name) or not _DOTTED.fullmatch(attr_path):
        raise TaskError(
            f"--task {spec}: expected 'package.module:factory' (dotted Python names, one ':')"
        )
    obj: Any = _import(spec, module_name)
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise TaskError(f"--task {spec}: module '{module_name}' has no attribute '{attr_path}'")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TaskError(
            f"--task {spec}: '{attr_path}' is a {type(obj).__name__}, not callable; "
            "it must be a function taking a TaskConfig and returning a Task"
        )
    factory: TaskFactory = obj
    return factory


def _import(spec: str, module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise TaskError(
                f"--task {spec}: module '{module_name}' not found; is it installed / on PYTHONPATH?"
            ) from e
        # The module exists but one of its own imports does not.
        raise TaskError(
            f"--task {spec}: importing '{module_name}' failed: no module named '{missing}'; "
            "install that dependency"
        ) from e
    except Exception as e:
        raise TaskError(
            f"--task {spec}: importing '{module_name}' raised {type(e).__name__}: {e}"
        ) from e


def create_task(spec: str, cfg: TaskConfig) -> Task:
    """Load the factory for ``spec``, call it with ``cfg`` and check that it returned a Task."""
    task = load_task(spec)(cfg)
    if not isinstance(task, Task):
        raise TaskError(
            f"--task {spec}: the factory returned a value of type '{type(task).__name__}', "
            "not a neuronode.training.Task"
        )
    return task
