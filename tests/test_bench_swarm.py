"""`neuronode bench swarm` at small sizes, in this process: every member ends each round with the
same average of all N contributions, and what a member handles grows with N. Counts are checked,
never seconds (the machine is shared)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
import torch
from helpers import run_neuronode

from neuronode import cli
from neuronode.averaging import Average
from neuronode.bench import swarm
from neuronode.bench.common import BenchError
from neuronode.codec import CODECS

pytestmark = pytest.mark.timeout(60)

KEYS = {
    "members", "rounds", "params", "averaging", "codec", "seconds", "round_seconds",
    "cpu_seconds_per_member_per_round", "peak_rss_bytes", "rss_bytes_per_member",
    "control_messages_per_member_per_round", "contributions_per_member_per_round", "identical",
}
MODES = ("all-to-all", "reduce-scatter")
# Records one member receives a round: every other member's contribution (all-to-all), or its
# slice of every other member's shard and every other reducer's averaged shard (reduce-scatter).
RECORDS_PER_PEER = {"all-to-all": 1, "reduce-scatter": 2}


def bench(*flags: str) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    swarm.configure(parser)
    return swarm.run(parser.parse_args(list(flags)))


@pytest.mark.parametrize("averaging", MODES)
def test_every_member_averages_all_contributions_alike(averaging: str) -> None:
    result = bench("--members", "20", "--rounds", "2", "--params", "2000", "--averaging", averaging)
    assert KEYS <= result.keys()
    assert (result["members"], result["rounds"], result["params"]) == (20, 2, 2000)
    assert (result["averaging"], result["codec"]) == (averaging, "fp32")
    assert result["identical"] is True  # the bench raises unless every member holds all 20 alike
    assert result["contributions_per_member_per_round"] == 19 * RECORDS_PER_PEER[averaging]
    assert result["control_messages_per_member_per_round"] == 19  # one receipt from each other member, no fetch
    assert result["cpu_seconds_per_member_per_round"] > 0 and result["peak_rss_bytes"] > 0
    assert result["rss_bytes_per_member"] >= 0


@pytest.mark.parametrize("averaging", MODES)
def test_control_messages_per_member_grow_with_the_swarm(averaging: str) -> None:
    small, big = (bench("--members", str(n), "--rounds", "1", "--params", "500", "--averaging", averaging)
                  for n in (10, 40))
    assert small["control_messages_per_member_per_round"] == 9
    assert big["control_messages_per_member_per_round"] == 39
    assert big["contributions_per_member_per_round"] > small["contributions_per_member_per_round"]


def test_a_lossy_codec_still_leaves_every_member_alike() -> None:
    """int8 with more members than blocks: some reduce-scatter shards are empty."""
    result = bench("--members", "12", "--rounds", "2", "--params", "300", "--codec", "int8",
                   "--averaging", "reduce-scatter")
    assert result["identical"] is True and result["codec"] == "int8"


def test_the_check_names_the_round_a_member_parted_in() -> None:
    ids = ["a", "b"]
    same = [Average(vector=torch.ones(3), contributors=ids, fewest=2) for _ in ids]
    swarm.check_identical(4, same, ids)
    apart = [same[0], Average(vector=torch.zeros(3), contributors=ids, fewest=2)]
    with pytest.raises(BenchError, match=r"round 4: b's averaged vector differs"):
        swarm.check_identical(4, apart, ids)
    short = [same[0], Average(vector=torch.ones(3), contributors=["a"], fewest=1)]
    with pytest.raises(BenchError, match=r"round 7: b averaged 1 of 2"):
        swarm.check_identical(7, short, ids)


def test_without_json_a_person_gets_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "swarm", "--members", "3", "--rounds", "1", "--params", "100"]) == 0
    out = capsys.readouterr().out
    assert "control messages per member per round  2.0" in out and "identical" in out and "{" not in out


def test_codecs_are_the_codec_packages() -> None:
    assert swarm.CODECS == CODECS


def test_cli_refuses_one_member() -> None:
    out = run_neuronode("bench", "swarm", "--members", "1", "--json")
    assert out.returncode == 2 and out.stdout == ""
    assert "--members 1" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_under_gather_what_a_member_receives_stays_flat_as_the_swarm_grows() -> None:
    """--averaging gather --codec sparse, K = 8: at 16 and at 48 members every member ends on
    the average of the round's 8 makers, and the median member receives about as many bytes
    (8 contributions, 8 receipts) at 48 as at 16, where all-to-all's grows with N."""
    flags = ("--averaging", "gather", "--codec", "sparse", "--gather-makers", "8", "--rounds", "2", "--params", "4096")
    small, large = bench("--members", "16", *flags), bench("--members", "48", *flags)
    assert KEYS | {"bytes_up_per_member_per_round", "bytes_down_per_member_per_round", "makers"} <= set(large)
    assert small["identical"] and large["identical"] and small["makers"] == large["makers"] == 8
    assert large["contributions_per_member_per_round"] <= 8
    assert large["bytes_down_per_member_per_round"] <= 1.2 * small["bytes_down_per_member_per_round"]
    assert large["bytes_up_per_member_per_round"] <= 1.2 * small["bytes_up_per_member_per_round"]
    every = bench("--members", "48", "--averaging", "all-to-all", "--codec", "sparse", "--rounds", "2", "--params", "4096")
    assert every["bytes_down_per_member_per_round"] > 4 * large["bytes_down_per_member_per_round"]
