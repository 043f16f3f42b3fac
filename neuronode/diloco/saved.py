"""What a saved engine state is made of besides tensors it owns: CPU copies of state dicts and
the random number generators' states (so a resumed run continues bit-exactly)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import Tensor


def cpu_copy(obj: Any) -> Any:
    """Deep copy of a (nested) state dict with every tensor cloned to CPU."""
    if isinstance(obj, Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {key: cpu_copy(value) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(cpu_copy(value) for value in obj)
    return obj


def capture_rng() -> dict[str, Any]:
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    # numpy's state holds an ndarray, which weights_only loading rejects; store plain ints.
    kind, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    rng["numpy"] = (kind, [int(k) for k in key], int(pos), int(has_gauss), float(gauss))
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "numpy" in rng:
        kind, key, pos, has_gauss, gauss = rng["numpy"]
        np.random.set_state((kind, np.asarray(key, dtype=np.uint32), pos, has_gauss, gauss))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
