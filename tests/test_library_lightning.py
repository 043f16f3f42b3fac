"""neuronode.library.lightning: a Lightning Trainer runs a member of a swarm (alone here):
rounds after inner_steps optimizer steps, gradient accumulation counted as one step, and the
Trainer stops when the swarm has run its rounds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")


class Regression(pl.LightningModule):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


@pytest.mark.timeout(120)
def test_a_lightning_trainer_stops_when_the_swarm_ran_its_rounds(tmp_path: Path) -> None:
    from neuronode.library.lightning import NeuronodeCallback

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(256, 4, generator=gen)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    callback = NeuronodeCallback(data_dir=str(tmp_path), listen="127.0.0.1:0", inner_steps=3, rounds=2,
                                 batch_size=8)
    trainer = pl.Trainer(max_steps=20, accumulate_grad_batches=2, accelerator="cpu", logger=False, callbacks=[callback],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regression(), data)
    assert callback.swarm is not None
    status = callback.swarm.status()
    assert status["round"] == 2 and status["phase"] == "stopped"
    assert trainer.global_step == 6  # 2 rounds of 3 optimizer steps, each of 2 batches
    assert status["inner_steps"] == 6
    from neuronode.node import checkpoint

    loaded = checkpoint.load_latest(tmp_path)
    assert loaded is not None
    assert loaded.state["engine"]["counters"]["round"] == 2
