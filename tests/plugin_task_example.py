"""Example task plug-in: fit a linear layer to y = x @ w_true + noise.

Use it with ``neuronode --task plugin_task_example:make_task`` (this directory on PYTHONPATH).
"""

import torch
from torch import nn

from neuronode.training import Task, TaskConfig


def make_task(cfg: TaskConfig) -> Task:
    init = torch.Generator().manual_seed(cfg.seed)  # same on every node: same target, same model
    w_true = torch.randn(8, 1, generator=init)
    model = nn.Linear(8, 1)
    with torch.no_grad():
        model.weight.normal_(0.0, 0.1, generator=init)
        model.bias.zero_()
    data = torch.Generator().manual_seed(cfg.data_seed)  # per node: different samples

    def batches():
        while True:
            x = torch.randn(cfg.batch_size, 8, generator=data)
            yield x, x @ w_true + 0.01 * torch.randn(cfg.batch_size, 1, generator=data)

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    return Task(model=model, batches=batches(), loss_fn=loss_fn, samples_per_batch=cfg.batch_size)
