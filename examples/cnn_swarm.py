"""Train a small CNN with plain PyTorch as a member of a swarm (neuronode.Swarm; docs/library.md).

The images are generated: 16x16 noise with a bright 4x4 patch in one of four quadrants, the
quadrant being the class. Every member draws its own training images (--data-seed) and the
same validation images; the model starts from the same weights everywhere (torch.manual_seed(0)
before it is built: the swarm refuses a member whose initial weights differ).

Two members on one machine:

    python examples/cnn_swarm.py --listen 127.0.0.1:7431 --data-dir run-a --data-seed 1 --min-peers 2
    python examples/cnn_swarm.py --listen 127.0.0.1:7432 --data-dir run-b --data-seed 2 --min-peers 2 \\
        --peers 127.0.0.1:7431

Each prints one JSON line when it is done: its round, param_digest (the same on both) and
validation loss before and after.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn

import neuronode

SIDE, CLASSES = 16, 4


def images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` images (n, 1, 16, 16) and their classes: noise, and a bright patch in the class's quadrant."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (n,), generator=gen)
    x = 0.5 * torch.randn(n, 1, SIDE, SIDE, generator=gen)
    offsets = torch.randint(0, SIDE // 2 - 4, (n, 2), generator=gen)
    for i in range(n):
        row = (labels[i] // 2) * (SIDE // 2) + offsets[i, 0]
        col = (labels[i] % 2) * (SIDE // 2) + offsets[i, 1]
        x[i, 0, row:row + 4, col:col + 4] += 0.5
    return x, labels


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.head = nn.Linear(16 * 4 * 4, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)  # (B, 8, 8, 8)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # (B, 16, 4, 4)
        return self.head(x.flatten(1))  # (B, CLASSES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--peers", default="")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--data-seed", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--min-peers", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)

    torch.manual_seed(0)  # the same initial weights on every member
    model = SmallCNN()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    val_x, val_y = images(256, seed=12345)

    def validate(m: nn.Module) -> float:
        with torch.no_grad():
            return float(F.cross_entropy(m(val_x), val_y))

    swarm = neuronode.Swarm(model, optimizer, listen=args.listen, peers=args.peers, data_dir=args.data_dir,
                            swarm_id="cnn-example", rounds=args.rounds, inner_steps=args.inner_steps,
                            min_peers=args.min_peers, batch_size=args.batch_size, validate=validate)
    before = swarm.status()["val_loss"]
    train_x, train_y = images(2048, seed=args.data_seed)
    step = 0
    while not swarm.finished:
        batch = torch.randint(0, len(train_x), (args.batch_size,), generator=torch.Generator().manual_seed(step))
        loss = F.cross_entropy(model(train_x[batch]), train_y[batch])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        swarm.step(samples=args.batch_size, loss=loss.item())
        step += 1
    swarm.close()
    status = swarm.status()
    print(json.dumps({"round": status["round"], "param_digest": status["param_digest"],
                      "val_loss_before": before, "val_loss": status["val_loss"],
                      "contributors": status["last_round_contributors"]}))


if __name__ == "__main__":
    main()
