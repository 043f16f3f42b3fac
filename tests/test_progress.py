"""What a node says about its pace: the live line's tokens per round and its ETA to the end of
--rounds, and the same on the status page (tokens_per_round, round_s, rounds_eta_s)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from helpers import swarm_config

from neuronode.config import NodeConfig
from neuronode.node.console import progress_line, round_seconds
from neuronode.node.history import History, RoundRecord
from neuronode.node.page import Page
from neuronode.swarm.node import SwarmNode

LINE = dict(step=12, inner_steps=50, loss=2.7, lr=3e-3, tokens_per_s=1024.0, tokens_per_batch=2048, peers=2)


def test_the_live_line_says_tokens_per_round_and_when_the_rounds_end() -> None:
    # 2048 tokens a step at 1024 tok/s: 2 s a step; 38 steps left in round 3 of 10, then 7 rounds.
    line = progress_line(round_id=2, rounds=10, tokens_per_round=102_400, round_s=90.0, **LINE)  # type: ignore[arg-type]
    assert "102.4k tok/round" in line and line.endswith("ETA 11m46s"), line  # 38 x 2 + 7 x 90
    early = progress_line(round_id=2, rounds=10, tokens_per_round=102_400, round_s=0.0, **LINE)  # type: ignore[arg-type]
    assert early.endswith("ETA 12m56s"), early  # 38 x 2 + 7 x 50 x 2: no round measured yet
    # Two micro-batches a step (--grad-accum 2): a step trains on twice the tokens, and takes twice as long.
    accum = progress_line(round_id=9, rounds=10, tokens_per_round=204_800, **LINE)  # type: ignore[arg-type]
    assert accum.endswith("ETA 2m32s"), accum  # 38 x 4
    unbounded = progress_line(round_id=2, rounds=0, tokens_per_round=102_400, **LINE)  # type: ignore[arg-type]
    assert unbounded.startswith("round 3 [") and unbounded.endswith("ETA 1m16s"), unbounded  # this round's end


def test_round_seconds_is_the_mean_of_the_last_rounds() -> None:
    assert round_seconds([]) == round_seconds([5.0]) == 0.0
    assert round_seconds([0.0, 100.0, 160.0, 220.0]) == 220.0 / 3
    assert round_seconds([0.0, 1000.0, *range(1100, 1600, 100)], last=5) == 100.0


def page(tmp: Path, executor: ThreadPoolExecutor, *, rounds: int, ends: list[float]) -> Page:
    swarm = SwarmNode(swarm_config("self"), executor=executor,
                      status_provider=lambda: {"round": len(ends), "tokens_per_s": 100.0})
    history = History(tmp)
    for i, t in enumerate(ends, 1):
        history.add(RoundRecord(round=i, time_s=t, loss=1.0, val_loss=1.0, tokens_per_s=100.0, sync_s=0.1,
                                bytes_sent=0, bytes_received=0, contributors=1))
    return Page(cfg=NodeConfig(rounds=rounds), swarm=swarm, state=swarm.state, history=history, show_addresses=True,
                tokens_per_round=1000)


def test_the_page_says_tokens_per_round_and_when_the_rounds_end(tmp_path: Path) -> None:
    with ThreadPoolExecutor(1) as executor:
        measured = page(tmp_path / "a", executor, rounds=10, ends=[100.0, 160.0, 220.0]).status()
        assert (measured["tokens_per_round"], measured["round_s"], measured["rounds_eta_s"]) == (1000, 60.0, 420.0)
        early = page(tmp_path / "b", executor, rounds=10, ends=[100.0]).schedule({"round": 1, "tokens_per_s": 100.0}, [100.0])
        assert early == {"tokens_per_round": 1000, "round_s": 0.0, "rounds_eta_s": 90.0}  # 9 rounds of 1000 tokens at 100/s
        unbounded = page(tmp_path / "c", executor, rounds=0, ends=[100.0, 160.0]).status()
        assert unbounded["rounds_eta_s"] is None and unbounded["round_s"] == 60.0
