"""Dozens of members on one machine (issue 18): 24 real `neuronode start` processes of a tiny
model, all-to-all, --min-peers 24, three rounds: every member ends at round 3 with one digest and
every round averaged all 24 contributions.

A benchmark-style test: about two minutes on the 2-core development machine, so not part of
every CI run (`make test`). Run it with `NEURONODE_SCALE=1 .venv/bin/python -m pytest
tests/test_scale.py`; the last run's time is in docs/benchmarks.md.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import Node, run_to_end

pytestmark = [
    pytest.mark.swarm, pytest.mark.timeout(900),
    pytest.mark.skipif(not os.environ.get("NEURONODE_SCALE"), reason="24 and 64 processes: set NEURONODE_SCALE=1 to run"),
]

MEMBERS = 24
ARGS = ("--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "32", "--batch-size", "4",
        "--inner-steps", "4", "--rounds", "3", "--min-peers", str(MEMBERS), "--sync-timeout", "60",
        "--heartbeat-s", "2", "--swarm-id", "scale", "--device", "cpu",
        "--max-ids-per-host", str(MEMBERS))  # all on 127.0.0.1: the default (16) turns the rest away


def test_24_members_average_all_24_contributions_every_round(tmp_path: Path) -> None:
    first = Node(tmp_path, "m00", *ARGS, "--node-id", "m00")
    # Each joins through one of the first few: most learn the rest by peer exchange (the join
    # race of issue 18: a push arriving before its sender's Hello).
    nodes = [first] + [Node(tmp_path, f"m{i:02d}", *ARGS, "--node-id", f"m{i:02d}", "--peers", first.address)
                       for i in range(1, MEMBERS)]
    run_to_end(nodes, 600)
    statuses = {n.name: n.status() for n in nodes}
    assert all(s["round"] == 3 for s in statuses.values()), {k: s["round"] for k, s in statuses.items()}
    assert len({s["param_digest"] for s in statuses.values()}) == 1
    everyone = sorted(n.name for n in nodes)
    for node in nodes:
        done = {e["round"]: e for e in node.events("round_done")}
        assert sorted(done) == [1, 2, 3], node.log()[-2000:]
        assert all(e["contributors"] == everyone for e in done.values()), (node.name, node.log()[-2000:])


GATHER_MEMBERS = 64
GATHER_ARGS = ("--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "32", "--batch-size", "4",
               "--inner-steps", "4", "--rounds", "3", "--min-peers", str(GATHER_MEMBERS), "--sync-timeout", "120",
               "--heartbeat-s", "4", "--swarm-id", "scale-gather", "--device", "cpu", "--threads", "1",
               "--averaging", "gather", "--codec", "sparse", "--max-ids-per-host", str(GATHER_MEMBERS))


def test_64_members_gather_their_makers_and_end_on_one_digest(tmp_path: Path) -> None:
    """Issue 41: 64 real processes under --averaging gather (32 makers a round, the rest carry
    theirs; each maker's contribution reaches the others down its tree, forwarded): every member
    ends round 3 with one digest, and every round averaged the same makers at every member, at
    most 32 of them."""
    first = Node(tmp_path, "g00", *GATHER_ARGS, "--node-id", "g00")
    nodes = [first] + [Node(tmp_path, f"g{i:02d}", *GATHER_ARGS, "--node-id", f"g{i:02d}", "--peers", first.address)
                       for i in range(1, GATHER_MEMBERS)]
    run_to_end(nodes, 840)
    statuses = {n.name: n.status() for n in nodes}
    assert all(s["round"] == 3 for s in statuses.values()), {k: s["round"] for k, s in statuses.items()}
    assert len({s["param_digest"] for s in statuses.values()}) == 1
    by_round: dict[int, set[tuple[str, ...]]] = {}
    for node in nodes:
        for e in node.events("round_done"):
            by_round.setdefault(e["round"], set()).add(tuple(e["contributors"]))
    assert all(len(lists) == 1 and 0 < len(next(iter(lists))) <= 32 for lists in by_round.values()), by_round
