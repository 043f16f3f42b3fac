"""`neuronode export --data-dir DIR --out MODEL_DIR`: the swarm's global parameters from the
newest checkpoint that verifies, as a model directory.

Written: ``model.safetensors`` (the global parameters by name, float32) and the task's files
(``config.json``, ``generation_config.json``, the tokenizer's files), all with the mode a new
file gets here. For ``--task hf`` the directory loads with
``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``; for the built-in
``bytelm`` with ``neuronode.training.bytelm.load_exported``. Needs safetensors, not transformers.

A checkpoint verifies when its trailing sha256 matches its bytes and its global parameters hash
to the param_digest it records; one that does not is refused with a line saying why, and the
next older one is tried.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from neuronode.errors import CheckpointError, NeuronodeError
from neuronode.node import checkpoint

logger = logging.getLogger(__name__)


class ExportError(NeuronodeError):
    """Nothing to export, or nowhere to write it."""


def params_digest(params: list[Any]) -> str:
    """The engine's param_digest of a list of tensors: sha256 of float32 little-endian bytes."""
    import numpy as np

    hasher = hashlib.sha256()
    for g in params:
        hasher.update(np.ascontiguousarray(g.detach().cpu().numpy(), dtype="<f4").data)
    return hasher.hexdigest()


def verified(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(meta, state) of a checkpoint whose file digest and parameter digest both hold."""
    meta, state = checkpoint.read(path)
    params = state.get("engine", {}).get("global_params")
    if not isinstance(params, list) or not params:
        raise CheckpointError(f"{path} holds no global parameters")
    digest = params_digest(params)
    if digest != meta.get("param_digest"):
        raise CheckpointError(f"{path}: its global parameters hash to {digest[:16]}, not the "
                              f"param_digest it records ({str(meta.get('param_digest'))[:16]})")
    if "export" not in state:
        raise CheckpointError(f"{path} was written by a release before export; run the node for one "
                              "more round to write a checkpoint that can be exported")
    return meta, state


def newest_verified(data_dir: Path, *, say: Callable[[str], None]) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    paths = checkpoint.list_checkpoints(data_dir)
    if not paths:
        raise ExportError(f"--data-dir {data_dir}: no checkpoint there (a node writes one per round)")
    for path in paths:
        try:
            meta, state = verified(path)
        except (CheckpointError, OSError, ValueError, RuntimeError) as exc:
            say(f"refusing checkpoint {path.name}: {exc}")
            continue
        return path, meta, state
    raise ExportError(f"--data-dir {data_dir}: no checkpoint verifies ({len(paths)} refused); nothing exported")


def file_mode() -> int:
    """The mode a new file gets here (0644 under the usual umask 022)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def export(data_dir: str, out: str, *, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Write the newest verified checkpoint's global parameters and the task's files to `out`."""
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    folder = Path(data_dir).expanduser()
    if not folder.is_dir():
        raise ExportError(f"--data-dir: '{data_dir}' does not exist")
    path, meta, state = newest_verified(folder, say=say)
    info = state["export"]
    params = state["engine"]["global_params"]
    names = list(info["names"])
    if len(names) != len(params):
        raise ExportError(f"{path}: {len(names)} parameter names for {len(params)} tensors")
    out_dir = Path(out).expanduser()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        tensors = {name: p.detach().float().contiguous() for name, p in zip(names, params, strict=True)}
        tmp = out_dir / "model.safetensors.tmp"
        save_file(tensors, str(tmp), metadata={"format": "pt", "neuronode_task": str(info["task"]),
                                              "round": str(meta.get("round")),
                                              "param_digest": str(meta.get("param_digest"))})
        os.chmod(tmp, file_mode())  # safetensors writes 0600 whatever the umask: as the other files
        os.replace(tmp, out_dir / "model.safetensors")
        for name, blob in info["files"].items():
            if "/" in name or name.startswith("."):
                raise ExportError(f"{path}: the task names a file '{name}' outside the output folder")
            (out_dir / name).write_bytes(blob)
    except OSError as exc:
        raise ExportError(f"--out {out}: cannot write there: {exc.strerror or exc}") from None
    return {"out": str(out_dir), "checkpoint": path.name, "round": meta.get("round"),
            "param_digest": meta.get("param_digest"), "task": info["task"],
            "n_params": sum(p.numel() for p in params),
            "files": sorted(["model.safetensors", *info["files"]]),
            "seconds": round(time.perf_counter() - t0, 3)}
