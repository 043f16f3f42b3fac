"""A Byzantine member among five real nodes: robust aggregators shrug it off, the mean does not.

The liar distorts its pseudo-gradient before sending it, through its --fault-file
(neuronode/swarm/faults.py): times -100 (`byzantine_scale`), or plus large gaussian noise
(`byzantine_noise`). Swarms of `neuronode start` processes with a small model run one after
the other:

- honest: the four honest nodes alone, the reference;
- trimmed-flip: the four plus the liar (x -100), every node with --aggregator trimmed-mean
  (trim_fraction 0.2: per coordinate one value dropped at each end, the liar's always one);
- median-flip: the same with --aggregator median;
- mean-flip, mean-noise: the four plus the liar (x -100, or noise) with the plain weighted mean,
  which one liar wrecks.

Every node waits for all members' contributions in every round (--min-peers), so every round
averages the liar's contribution and each run is reproducible bit for bit whatever the timing;
the honest four keep their ids and seeds in every swarm, so they draw the same data. The noise
is the exception: it comes from torch's global generator, seeded at random in each process, so
robust rules are held to 5% against the deterministic liar only (against noise, trimmed-mean
measured -0.5% to +5.7% over five runs). With trim_fraction 0.2 a swarm of four trims nothing,
so the reference, run with the trimmed-mean flags, is the honest mean. At the end the honest
nodes' val_loss (what `neuronode status --data-dir` reports) is compared with the reference's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from helpers import Node

from neuronode.node.status import from_data_dir as status_of

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]

HONEST = ("a", "b", "c", "d")
LIAR = "e"
ROUNDS = 4
SWARM_ARGS = (
    "--d-model", "64", "--n-layers", "2", "--n-heads", "2", "--seq-len", "64", "--batch-size", "8",
    "--inner-steps", "10", "--rounds", str(ROUNDS), "--threads", "1", "--sync-timeout", "60",
    "--swarm-id", "byzantine-drill", "--device", "cpu",  # even with a GPU: reproducible numbers
)
TRIMMED = ("--aggregator", "trimmed-mean", "--aggregator-option", "trim_fraction=0.2")
MEDIAN = ("--aggregator", "median")
MEAN = ("--aggregator", "mean")
FLIP = {"byzantine_scale": -100.0}
NOISE = {"byzantine_noise": 1.0}  # std 1 per coordinate: far above any honest inner-loop move
SCENARIOS: dict[str, tuple[tuple[str, ...], dict[str, float] | None]] = {
    "honest": (TRIMMED, None),
    "trimmed-flip": (TRIMMED, FLIP), "median-flip": (MEDIAN, FLIP),
    "mean-flip": (MEAN, FLIP), "mean-noise": (MEAN, NOISE),
}


class Swarm:
    """One scenario: the members, started concurrently (all bootstrap from `a`)."""

    def __init__(self, tmp: Path, name: str, flags: tuple[str, ...],
                 lie: dict[str, float] | None) -> None:
        self.name = name
        folder = tmp / name
        folder.mkdir()
        members = [*HONEST, LIAR] if lie else list(HONEST)
        common = (*SWARM_ARGS, *flags, "--min-peers", str(len(members)))
        first = Node(folder, members[0], *common, "--node-id", members[0])
        self.nodes = [first] + [Node(folder, m, *common, "--node-id", m, "--peers", first.address)
                                for m in members[1:]]
        if lie:
            plan = folder / "lie.json"
            plan.write_text(json.dumps(lie))
            self.nodes[-1].extra += ["--fault-file", str(plan)]

    def start(self) -> Swarm:
        try:
            for node in self.nodes:
                node.start()
        except BaseException:
            self.kill()
            raise
        return self

    def finish(self) -> dict[str, dict[str, Any]]:
        """Wait for the members to finish their rounds; each one's final status."""
        try:
            for node in self.nodes:
                assert node.wait(240) == 0, f"{self.name}/{node.name}:\n{node.log()[-3000:]}"
        finally:
            self.kill()
        for node in self.nodes:  # every round averaged every member, the liar included
            contributors = {e["round"]: len(e["contributors"]) for e in node.events("round_done")}
            want = {r: len(self.nodes) for r in range(1, ROUNDS + 1)}
            assert contributors == want, (self.name, node.name, contributors)
        return {node.name: status_of(str(node.data_dir)) for node in self.nodes}

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()


def honest_val_loss(statuses: dict[str, dict[str, Any]]) -> float:
    """The honest nodes' common val_loss (every member averaged the same contributions)."""
    honest = [statuses[n] for n in HONEST]
    assert all(s["round"] == ROUNDS for s in honest), {n: statuses[n]["round"] for n in HONEST}
    assert len({s["param_digest"] for s in statuses.values()}) == 1, "the replicas diverged"
    return float(honest[0]["val_loss"])


@pytest.fixture(scope="module")
def val_losses(tmp_path_factory: pytest.TempPathFactory) -> dict[str, float]:
    tmp = tmp_path_factory.mktemp("byzantine")
    losses = {name: honest_val_loss(Swarm(tmp, name, flags, lie).start().finish())
              for name, (flags, lie) in SCENARIOS.items()}
    print(f"val_loss after {ROUNDS} rounds: {losses}")  # the measured numbers, shown with -s
    return losses


# The bar is 5% for "a robust aggregator": trimmed mean meets it. The coordinate-wise
# median of 5 throws away more honest information (measured +6.3% in one CI run), so it is held
# to 10%, still far from the mean's collapse (about 100x).
@pytest.mark.parametrize(("scenario", "bound"), [("trimmed-flip", 0.05), ("median-flip", 0.10)])
def test_robust_aggregator_keeps_the_honest_swarms_validation_loss(val_losses: dict[str, float],
                                                                    scenario: str, bound: float) -> None:
    honest = val_losses["honest"]
    assert math.isfinite(honest) and honest < 4.0, val_losses  # the reference learned (5.4 untrained)
    assert abs(val_losses[scenario] / honest - 1.0) <= bound, val_losses


@pytest.mark.parametrize("scenario", ["mean-flip", "mean-noise"])
def test_plain_mean_is_wrecked_by_one_liar(val_losses: dict[str, float], scenario: str) -> None:
    """The liar's share of the mean is finite (the daemon would log "averaged pseudo-gradient is
    not finite; skipping the outer update" otherwise) and applied: with x -100 each outer step
    goes about 19 times the honest step the wrong way."""
    honest, broken = val_losses["honest"], val_losses[scenario]
    assert not math.isfinite(broken) or broken > 1.2 * honest, val_losses
