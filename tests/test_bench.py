"""`neuronode bench sync`: real node processes on 127.0.0.1 (small P), plus its pure summary."""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
from procutil import neuronode_cmd

from neuronode.bench.sync import (
    SyncBenchConfig,
    Usage,
    encode_contribution,
    summarize,
    used_between,
)
from neuronode.codec import ErrorFeedback
from neuronode.config import NodeConfig
from neuronode.errors import ConfigError
from neuronode.trainer import Trainer

KEYS = {
    "seconds", "gloo_seconds", "ratio_vs_gloo", "payload_bytes_per_param", "wire_bytes_per_param",
    "peak_rss_bytes", "nodes", "params", "codec", "averaging", "rounds", "replicas_identical",
    "encode_seconds", "decode_average_seconds",
}


def bench_sync(*flags: str, timeout_s: float = 120) -> dict[str, Any]:
    out = subprocess.run(neuronode_cmd("bench", "sync", *flags, "--json"), capture_output=True,
                         text=True, timeout=timeout_s, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, out.stdout
    return dict(json.loads(lines[0]))


def check_common(result: dict[str, Any], *, nodes: int, params: int, codec: str) -> None:
    assert KEYS <= result.keys()
    assert (result["nodes"], result["params"], result["codec"]) == (nodes, params, codec)
    assert result["averaging"] == "all-to-all" and result["rounds"] == 2
    assert result["replicas_identical"] is True
    assert result["seconds"] > 0 and result["peak_rss_bytes"] > 0
    assert 0 < result["encode_seconds"] <= result["seconds"]
    assert 0 < result["decode_average_seconds"] <= result["seconds"]
    # Every node sends its contribution once to each of the other N - 1.
    expected_wire = (nodes - 1) * result["payload_bytes_per_param"]
    assert result["wire_bytes_per_param"] == pytest.approx(expected_wire, rel=0.3)


@pytest.mark.swarm
@pytest.mark.timeout(150)
def test_fp32_against_gloo() -> None:
    result = bench_sync("--nodes", "2", "--params", "200000", "--codec", "fp32", "--rounds", "2")
    check_common(result, nodes=2, params=200_000, codec="fp32")
    assert 3.0 <= result["payload_bytes_per_param"] <= 4.2
    assert result["gloo_seconds"] > 0
    assert result["ratio_vs_gloo"] == pytest.approx(result["seconds"] / result["gloo_seconds"], rel=0.05)


@pytest.mark.swarm
@pytest.mark.timeout(150)
def test_bf16_without_gloo() -> None:
    result = bench_sync("--nodes", "2", "--params", "200000", "--codec", "bf16", "--rounds", "2",
                        "--no-gloo")
    check_common(result, nodes=2, params=200_000, codec="bf16")
    assert 1.2 <= result["payload_bytes_per_param"] <= 2.2
    assert result["gloo_seconds"] is None and result["ratio_vs_gloo"] is None


def test_one_node_is_a_usage_error() -> None:
    out = subprocess.run(neuronode_cmd("bench", "sync", "--nodes", "1", "--json"),
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2
    assert out.stdout == "" and len(out.stderr.strip().splitlines()) == 1
    assert "--nodes 1" in out.stderr


@pytest.mark.parametrize("field, value", [("nodes", 1), ("params", 0), ("rounds", 0),
                                          ("zstd_level", 23), ("averaging", "ring")])
def test_config_refuses(field: str, value: Any) -> None:
    good: dict[str, Any] = dict(nodes=2, params=10, codec="fp32", averaging="all-to-all",
                                rounds=1, zstd_level=1)
    with pytest.raises(ConfigError):
        SyncBenchConfig(**{**good, field: value})


def node_result(round_seconds: list[float], sha: str = "s", *, sent: int = 300,
                contributors: int = 2) -> dict[str, Any]:
    rounds = [{"seconds": s, "encode_s": s / 4, "exchange_s": s / 2, "decode_average_s": s / 4,
               "contributors": contributors, "sha256": sha, "bytes_sent": sent,
               "min_peer_bytes": sent, "cpu_s": s} for s in round_seconds]
    return {"rounds": rounds, "byte_shuffle": True, "peak_rss_bytes": 1000 + len(round_seconds)}


def test_summary_takes_the_slowest_worker_per_round_and_the_median() -> None:
    cfg = SyncBenchConfig(nodes=2, params=100, codec="fp32", averaging="all-to-all", rounds=3,
                          zstd_level=1)
    nodes = [node_result([1.0, 5.0, 2.0]), node_result([3.0, 1.0, 2.5])]
    gloo = [{"seconds": [0.1, 0.3, 0.2], "cpu_s": [0.1, 0.3, 0.2], "peak_rss_bytes": 7, "sha256": "g"},
            {"seconds": [0.2, 0.1, 0.1], "cpu_s": [0.2, 0.1, 0.1], "peak_rss_bytes": 9, "sha256": "g"}]
    result = summarize(cfg, nodes, gloo)
    assert result["round_seconds"] == [3.0, 5.0, 2.5]
    assert result["seconds"] == 3.0
    assert result["cpu_seconds"] == 4.5 and result["gloo_cpu_seconds"] == 0.3
    assert result["gloo_seconds"] == 0.2 and result["ratio_vs_gloo"] == 15.0
    assert result["payload_bytes_per_param"] == 3.0 and result["wire_bytes_per_param"] == 3.0
    assert result["replicas_identical"] is True
    assert result["gloo_peak_rss_bytes"] == 9 and result["gloo_replicas_identical"] is True


def test_summary_flags_differing_replicas_and_missing_contributors() -> None:
    cfg = SyncBenchConfig(nodes=2, params=100, codec="fp32", averaging="all-to-all", rounds=1,
                          zstd_level=1)
    assert not summarize(cfg, [node_result([1.0], "a"), node_result([1.0], "b")], [])["replicas_identical"]
    short = [node_result([1.0], contributors=1), node_result([1.0])]
    assert not summarize(cfg, short, [])["replicas_identical"]


def test_used_between_counts_one_contribution_per_peer() -> None:
    before = Usage(100, {"a": 40, "b": 60}, 1.0)
    after = Usage(400, {"a": 190, "b": 210, "c": 0}, 3.5)
    assert used_between(before, after) == {"bytes_sent": 300, "min_peer_bytes": 150, "cpu_s": 2.5}


@pytest.mark.parametrize("codec", ["fp32", "bf16"])
def test_bench_encodes_as_the_daemon_does(tmp_path: Path, codec: str) -> None:
    """The benchmark mirrors Trainer.encode; same pseudo-gradient, same frames on the wire."""
    cfg = NodeConfig(data_dir=str(tmp_path), d_model=32, n_layers=1, n_heads=2, seq_len=32,
                     batch_size=4, inner_steps=2, threads=1, codec=codec, zstd_level=1,
                     chunk_bytes=4096)
    trainer = Trainer(cfg, node_id="node-a")
    trainer.train_round(threading.Event())
    delta = trainer.engine.pseudo_gradient()
    feedback = ErrorFeedback(delta.numel()) if trainer.feedback is not None else None
    bench = SyncBenchConfig(nodes=2, params=delta.numel(), codec=codec, averaging="all-to-all",
                            rounds=1, zstd_level=1, chunk_bytes=cfg.chunk_bytes)
    ours = encode_contribution(delta, codec=codec, chunk_bytes=bench.chunk_bytes, zstd_level=1,
                               shuffle=bench.shuffle, feedback=feedback, weight=1.0)
    theirs = trainer.encode()
    assert len(ours.frames) > 1
    assert ours.frames == theirs.frames and ours.digest == theirs.digest
    assert (ours.chunk_elements, ours.shuffled, ours.zstd_level) == (
        theirs.chunk_elements, theirs.shuffled, theirs.zstd_level)
