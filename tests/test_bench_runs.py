"""`neuronode bench quality` and `bench utilization` at tiny sizes: real node processes on
127.0.0.1, one JSON object out. Figures are checked for sanity only, never against a clock."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest
from helpers import run_neuronode

from neuronode.bench import quality, stall, statesync, utilization
from neuronode.errors import ConfigError

TINY_MODEL = ("--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "32",
              "--batch-size", "4")
QUALITY_KEYS = {
    "val_loss", "val_loss_per_node", "val_loss_by_round", "replicas_identical", "param_digest",
    "contributors_min", "payload_bytes_per_param", "params", "nodes", "rounds", "codec",
    "inner_steps", "overlap", "seed", "seconds", "aggregator", "opposed_left_out",
}
UTILIZATION_KEYS = {
    "utilization", "utilization_per_node", "round_seconds", "train_seconds", "other_seconds",
    "sync_seconds", "waited_seconds", "step_seconds", "inner_steps", "overlap", "rounds",
    "timed_rounds", "nodes", "codec", "max_upload_mbps", "seconds",
}


def bench(kind: str, *flags: str, timeout_s: float) -> dict[str, Any]:
    # The bench's own deadline comes first, so a hang fails with the node's log quoted.
    flags = (*flags, "--timeout", str(timeout_s - 40))
    out = run_neuronode("bench", kind, *flags, "--json", timeout_s=timeout_s)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, out.stdout
    return dict(json.loads(lines[0]))


@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_quality_tiny() -> None:
    result = bench("quality", "--nodes", "2", "--rounds", "2", "--inner-steps", "5", "--codec", "int8",
                   *TINY_MODEL, timeout_s=280)
    assert QUALITY_KEYS <= result.keys()
    assert (result["nodes"], result["rounds"], result["inner_steps"]) == (2, 2, 5)
    assert result["codec"] == "int8" and result["overlap"] is False
    assert result["replicas_identical"] is True
    assert result["contributors_min"] == 2
    assert result["opposed_left_out"] == 0  # of two members nobody is left out
    assert math.isfinite(result["val_loss"]) and result["val_loss"] < 5.6
    assert result["val_loss_per_node"] == [result["val_loss"]] * 2
    assert len(result["val_loss_by_round"]) == 3  # before training, then after each round
    assert result["val_loss_by_round"][-1] == pytest.approx(result["val_loss"], abs=1e-4)
    assert result["params"] > 0
    # int8 is about 1.06 bytes a parameter before zstd; framing adds a little.
    assert 0.3 < result["payload_bytes_per_param"] < 2.0


@pytest.mark.swarm
@pytest.mark.timeout(400)
def test_overlap_with_default_momentum_learns_like_no_overlap() -> None:
    """--overlap's lookahead keeps the delayed outer step stable at momentum 0.9. Measured with
    this model: 3.34 with overlap, 3.35 without; the plain delayed step diverged (5.40)."""
    small = ("--nodes", "2", "--rounds", "6", "--inner-steps", "10", "--d-model", "64",
             "--n-layers", "2", "--seq-len", "64", "--batch-size", "8")
    overlap = bench("quality", *small, "--overlap", timeout_s=180)
    plain = bench("quality", *small, timeout_s=180)
    assert overlap["overlap"] is True and plain["overlap"] is False
    assert overlap["replicas_identical"] is True and overlap["contributors_min"] == 2
    assert overlap["val_loss"] <= 1.05 * plain["val_loss"], (overlap["val_loss_by_round"],
                                                            plain["val_loss_by_round"])
    assert max(overlap["val_loss_by_round"][1:]) < overlap["val_loss_by_round"][0]  # never back up


@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_utilization_tiny() -> None:
    result = bench("utilization", "--inner-steps", "5", "--rounds", "3", timeout_s=280)
    assert UTILIZATION_KEYS <= result.keys()
    assert (result["inner_steps"], result["rounds"], result["timed_rounds"]) == (5, 3, 2)
    assert result["overlap"] is False and result["nodes"] == 2
    assert 0 < result["utilization"] <= 1
    assert all(0 < u <= 1 for u in result["utilization_per_node"])
    assert 0 < result["train_seconds"] <= result["round_seconds"]
    assert result["step_seconds"] == pytest.approx(result["train_seconds"] / 5, rel=0.01)


STALL_KEYS = {
    "rss_bytes_per_round", "reference_rss_bytes_per_round", "peak_rss_bytes", "reference_peak_rss_bytes",
    "ratio_vs_reference", "rss_growth_bytes", "buffered_bytes_max", "buffered_bytes_after_close",
    "buffered_bytes_bound", "params", "codec", "rounds", "seconds",
}


@pytest.mark.timeout(120)
def test_stall_tiny() -> None:
    """A member stalling every stream for three rounds: the honest node lets go of each."""
    out = run_neuronode("bench", "stall", "--params", "300000", "--rounds", "3", "--json", timeout_s=110)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert STALL_KEYS <= result.keys()
    assert len(result["rss_bytes_per_round"]) == len(result["reference_rss_bytes_per_round"]) == 3
    assert result["buffered_bytes_after_close"] == 0
    assert 4 * 300_000 <= result["buffered_bytes_max"] <= result["buffered_bytes_bound"]
    assert result["ratio_vs_reference"] > 0


@pytest.mark.timeout(120)
def test_statesync_tiny() -> None:
    """A 600k-parameter state (6 chunks) from 1 and 2 donors at 200 Mbit/s each: every chunk
    comes once, the two donors share it, and the one-donor run is the reference."""
    out = run_neuronode("bench", "statesync", "--params", "600000", "--donors", "2", "--max-upload-mbps", "200",
                        "--json", timeout_s=110)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["max_upload_mbps"] == 200 and [r["donors"] for r in result["runs"]] == [1, 2]
    for run in result["runs"]:
        assert {"params", "state_bytes", "donors", "seconds", "mb_per_s", "uplink_use", "speedup_vs_one_donor",
                "chunks_by_donor", "donors_at_once"} <= run.keys()
        assert run["state_bytes"] == 4_800_000 and sum(run["chunks_by_donor"].values()) == 6
        assert len(run["chunks_by_donor"]) == run["donors"] and run["seconds"] > 0
    assert result["runs"][0]["speedup_vs_one_donor"] == 1.0


def test_statesync_refuses_bad_counts(capsys: pytest.CaptureFixture[str]) -> None:
    assert statesync.main(["--donors", "0", "--json"]) == 2
    assert "--donors" in capsys.readouterr().err
    out = run_neuronode("bench", "statesync", "--params", "lots")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_module_main_refuses_one_node(capsys: pytest.CaptureFixture[str]) -> None:
    assert quality.main(["--nodes", "1", "--json"]) == 2
    assert "--nodes 1" in capsys.readouterr().err


def test_cli_refuses_one_node() -> None:
    out = run_neuronode("bench", "utilization", "--nodes", "1", "--json")
    assert out.returncode == 2 and out.stdout == ""
    assert "--nodes 1" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def parse(module: Any, *flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.configure(parser)
    return parser.parse_args(list(flags))


@pytest.mark.parametrize("module, flags, word", [
    (quality, ("--nodes", "1"), "--nodes 1"),
    (quality, ("--rounds", "0"), "--rounds 0"),
    (quality, ("--inner-steps", "0"), "--inner-steps 0"),
    (utilization, ("--rounds", "1"), "--rounds 1"),
    (utilization, ("--max-upload-mbps", "-1"), "--max-upload-mbps"),
    (quality, ("--codec", "sparse", "--sparse-bits", "3"), "--sparse-bits"),
    (quality, ("--outer-momentum", "1.0"), "--outer-momentum"),
    (utilization, ("--codec", "sparse", "--sparse-k", "0"), "--sparse-k"),
])
def test_bad_flags_are_refused_before_any_process_starts(module: Any, flags: tuple[str, ...], word: str) -> None:
    with pytest.raises(ConfigError, match=word):
        module.spec_from_args(parse(module, *flags))


def test_stall_refuses_one_round(capsys: pytest.CaptureFixture[str]) -> None:
    assert stall.main(["--rounds", "1", "--json"]) == 2
    assert "--rounds 1" in capsys.readouterr().err


def test_node_flags() -> None:
    spec = quality.spec_from_args(parse(quality, "--nodes", "3", "--codec", "int4", "--overlap",
                                        "--d-model", "64", "--val-windows", "8"))
    first = spec.node_argv(0, data_dir=Path("d0"), port=1, bootstrap="127.0.0.1:1")
    other = spec.node_argv(2, data_dir=Path("d2"), port=3, bootstrap="127.0.0.1:1")
    assert "--peers" not in first and other[-2:] == ["--peers", "127.0.0.1:1"]
    for argv in (first, other):
        joined = " ".join(argv)
        assert "--codec int4" in joined and "--overlap" in joined and "--min-peers 3" in joined
        assert "--d-model 64" in joined and "--task-option val_windows=8" in joined
        assert "--threads 1" in joined and "--log-format json" in joined
    assert "--node-id bench-2" in " ".join(other)


def test_settings_flags_reach_every_node_and_the_report() -> None:
    args = parse(quality, "--codec", "sparse", "--sparse-k", "32", "--sparse-bits", "4", "--outer-lr", "1.0",
                 "--outer-momentum", "0")
    joined = " ".join(quality.spec_from_args(args).node_argv(1, data_dir=Path("d"), port=1, bootstrap="b:1"))
    assert "--sparse-k 32" in joined and "--sparse-bits 4" in joined and "--outer-lr 1.0" in joined
    assert "--outer-momentum 0.0" in joined and "--sparse-block" not in joined  # the daemon's default
    assert quality.settings_report(args) == {"outer_lr": 1.0, "outer_momentum": 0.0, "sparse_k": 32,
                                             "sparse_bits": 4, "sparse_block": 4096, "sparse_decay": 0.95}
    assert quality.settings_report(parse(quality, "--codec", "int8")).keys() == {"outer_lr", "outer_momentum"}


@pytest.mark.timeout(120)
def test_api_tiny() -> None:
    """`neuronode bench api`: both loops timed in one run, the call itself measured."""
    out = run_neuronode("bench", "api", "--steps", "4", "--block", "2", "--warmup", "1", *TINY_MODEL, "--json",
                        timeout_s=110)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["steps"] == 4 and result["n_params"] > 0
    assert result["reference_step_s"] > 0 and result["api_step_s"] > 0
    assert result["ratio"] == pytest.approx(result["api_step_s"] / result["reference_step_s"], rel=1e-3)
    assert 0 < result["step_call_us"] <= result["step_call_max_us"]
    assert result["within_target"] is (result["step_share"] <= result["target_share"])
