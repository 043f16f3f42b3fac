"""`neuronode start --print-params`: what a node started with these flags would train, without
starting it: the task built as the daemon builds it (model, tokenizer, data all checked), its
parameter count, the tokens a round covers and the settings the swarm compares."""

from __future__ import annotations

from typing import Any

from neuronode.config import NodeConfig
from neuronode.errors import ConfigError
from neuronode.node.trainer import model_seed
from neuronode.training.task import TaskConfig, TaskError, create_task


def describe(cfg: NodeConfig) -> dict[str, Any]:
    """task, n_params, tokens_per_round (0 when the task does not say) and its settings."""
    task_cfg = TaskConfig(seed=model_seed(cfg.swarm_id, cfg.seed), data_seed=0, batch_size=cfg.batch_size,
                          seq_len=cfg.seq_len, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                          device="cpu", options=cfg.task_options())
    try:
        task = create_task(cfg.task, task_cfg)
    except TaskError as exc:
        msg = str(exc)
        raise ConfigError(msg if msg.startswith("--task") else f"--task: {msg}") from None
    return {"task": cfg.task, "n_params": sum(p.numel() for p in task.model.parameters()),
            "tokens_per_round": cfg.tokens_per_round(task.tokens_per_batch),
            "settings": dict(task.settings)}
