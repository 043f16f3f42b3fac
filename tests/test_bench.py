"""`neuronode bench sync`: real node processes on 127.0.0.1 (small P), plus its pure summary."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import neuronode_cmd, run_neuronode

from neuronode.bench import sync as bench_sync_mod
from neuronode.bench.sync import BenchInterrupted, SyncBenchConfig, summarize
from neuronode.bench.sync_worker import Usage, used_between
from neuronode.errors import ConfigError

KEYS = {
    "seconds", "gloo_seconds", "ratio_vs_gloo", "payload_bytes_per_param", "wire_bytes_per_param",
    "peak_rss_bytes", "nodes", "params", "codec", "averaging", "rounds", "replicas_identical",
    "encode_seconds", "exchange_seconds", "decode_average_seconds", "result_digest",
    "zstd_level", "zstd_levels_used", "chunk_bytes", "byte_shuffle", "page_faults",
}
TINY = ("--nodes", "3", "--params", "300000", "--rounds", "2")


def bench_sync(*flags: str, timeout_s: float = 120) -> dict[str, Any]:
    out = run_neuronode("bench", "sync", *flags, "--json", timeout_s=timeout_s)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, out.stdout
    return dict(json.loads(lines[0]))


def check_common(result: dict[str, Any], *, nodes: int, params: int, codec: str,
                 averaging: str = "all-to-all") -> None:
    assert KEYS <= result.keys()
    assert (result["nodes"], result["params"], result["codec"]) == (nodes, params, codec)
    assert result["averaging"] == averaging and result["rounds"] == 2
    assert result["replicas_identical"] is True and len(result["result_digest"]) == 64
    assert result["seconds"] > 0 and result["peak_rss_bytes"] > 0
    assert 0 < result["encode_seconds"] <= result["seconds"]
    assert 0 < result["decode_average_seconds"] <= result["seconds"]
    assert result["zstd_level"] == -1 and result["zstd_levels_used"]  # auto by default
    payload, wire = result["payload_bytes_per_param"], result["wire_bytes_per_param"]
    if averaging == "all-to-all":  # every node sends its contribution to each of the other N - 1
        assert wire == pytest.approx((nodes - 1) * payload, rel=0.3)
    else:  # N - 1 slices of 1/N out, then N - 1 copies of our averaged 1/N
        assert wire == pytest.approx(2 * (nodes - 1) / nodes * payload, rel=0.3)
        assert wire <= 2.3 * payload


@pytest.fixture(scope="module")
def fp32_all_to_all() -> dict[str, Any]:
    return bench_sync(*TINY, "--codec", "fp32")


@pytest.mark.swarm
@pytest.mark.timeout(150)
def test_fp32_against_gloo(fp32_all_to_all: dict[str, Any]) -> None:
    result = fp32_all_to_all
    check_common(result, nodes=3, params=300_000, codec="fp32")
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
    assert result["grpc_floor_seconds"] is None and result["ratio_vs_grpc_floor"] is None


@pytest.mark.swarm
@pytest.mark.timeout(200)
def test_grpc_floor_moves_the_node_runs_bytes_again() -> None:
    """--grpc-floor: bare grpc.aio workers move what the nodes sent, and the ratio is reported."""
    result = bench_sync("--nodes", "3", "--params", "300000", "--codec", "fp32", "--rounds", "2",
                        "--averaging", "reduce-scatter", "--no-gloo", "--grpc-floor")
    check_common(result, nodes=3, params=300_000, codec="fp32", averaging="reduce-scatter")
    assert result["grpc_floor_seconds"] > 0 and result["grpc_floor_cpu_seconds"] > 0
    assert len(result["grpc_floor_round_seconds"]) == 2
    assert result["ratio_vs_grpc_floor"] == pytest.approx(result["seconds"] / result["grpc_floor_seconds"], rel=0.05)
    # Each floor worker received what each node sent (the run is symmetric), framing included.
    assert result["grpc_floor_wire_bytes_per_param"] == pytest.approx(result["wire_bytes_per_param"], rel=0.01)


@pytest.mark.swarm
@pytest.mark.timeout(250)
def test_reduce_scatter_fp32_averages_exactly_as_all_to_all(fp32_all_to_all: dict[str, Any]) -> None:
    """Lossless codec, same seeds: every element is the same weighted sum in the same order."""
    result = bench_sync(*TINY, "--codec", "fp32", "--averaging", "reduce-scatter", "--no-gloo")
    check_common(result, nodes=3, params=300_000, codec="fp32", averaging="reduce-scatter")
    assert 3.0 <= result["payload_bytes_per_param"] <= 4.2
    assert result["result_digest"] == fp32_all_to_all["result_digest"]


@pytest.mark.swarm
@pytest.mark.timeout(150)
def test_reduce_scatter_int8() -> None:
    result = bench_sync(*TINY, "--codec", "int8", "--averaging", "reduce-scatter", "--no-gloo")
    check_common(result, nodes=3, params=300_000, codec="int8", averaging="reduce-scatter")
    assert 0.9 <= result["payload_bytes_per_param"] <= 1.2


def bench_processes(marker: str) -> list[int]:
    """Pids whose command line mentions `marker` (our workers' work dir lives under it)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


@pytest.mark.swarm
@pytest.mark.timeout(150)
def test_ctrl_c_stops_workers_and_exits_130(tmp_path: Path) -> None:
    # A terminal's Ctrl-C: SIGINT as the shell leaves it for a foreground command. CI runs the
    # suite as a background job, which the shell starts with SIGINT ignored, and an ignored
    # signal stays ignored across exec: the bench then ran on and this test failed in CI only.
    proc = subprocess.Popen(
        neuronode_cmd("bench", "sync", "--nodes", "2", "--params", "1e5", "--rounds", "100000",
                      "--no-gloo", "--json"),
        env={**os.environ, "TMPDIR": str(tmp_path)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 90
        while not list(tmp_path.glob("neuronode-bench-*/address-0")):  # a worker is up
            assert proc.poll() is None and time.monotonic() < deadline, "bench never started"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"bench sync still running 60 s after SIGINT:\n{process_report(proc.pid)}") from None
        out, err = read_available(proc.stdout), read_available(proc.stderr)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and out == ""
    assert len(err.strip().splitlines()) == 1 and "interrupted" in err, err
    assert bench_processes(str(tmp_path)) == [] and not list(tmp_path.iterdir())


def read_available(pipe: Any) -> str:
    """What a pipe holds now, without waiting for EOF (raw reads: nothing was read through
    `pipe` before, so its buffer is empty)."""
    fd, data = pipe.fileno(), b""
    os.set_blocking(fd, False)
    try:
        while chunk := os.read(fd, 1 << 16):
            data += chunk
    except BlockingIOError:
        pass
    return data.decode()


def process_report(pid: int) -> str:
    """Where `pid` and its children are stuck (state, kernel wait channel, Python-free)."""
    lines = []
    for proc_dir in Path("/proc").iterdir():
        try:
            status = (proc_dir / "status").read_text()
            fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
            if proc_dir.name == str(pid) or fields.get("PPid", "").strip() == str(pid):
                cmd = (proc_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
                wchan = (proc_dir / "wchan").read_text()
                lines.append(f"{proc_dir.name} {fields.get('State', '').strip()} {wchan} {cmd}")
        except (OSError, ValueError):
            continue
    return "\n".join(lines) or f"no process {pid} or children"


def test_interrupt_becomes_a_bench_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*_: Any, **__: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_sync_mod, "run_workers", interrupted)
    args = dict(nodes=2, params=10.0, codec="fp32", averaging="all-to-all", rounds=1,
                zstd_level=-1, no_gloo=True)
    with pytest.raises(BenchInterrupted) as caught:
        bench_sync_mod.run_sync_bench(argparse.Namespace(**args))
    assert caught.value.exit_code == 130


def test_sparse_within_its_byte_budget_and_replicas_identical() -> None:
    """--codec sparse at the defaults: about 0.0195 bytes a parameter (0.02 is the budget); the
    CPU figures by role and the codec's settings are reported."""
    result = bench_sync("--nodes", "2", "--params", "300000", "--codec", "sparse", "--rounds", "1", "--no-gloo")
    assert result["replicas_identical"] is True
    assert 0.015 < result["payload_bytes_per_param"] <= 0.02
    assert (result["sparse_k"], result["sparse_bits"], result["sparse_block"]) == (64, 2, 4096)
    assert result["encode_cpu_seconds"] > 0 and result["decode_cpu_seconds"] > 0
    assert result["codec_cpu_seconds"] > 0 and result["int8_codec_cpu_seconds"] > 0


def test_one_node_is_a_usage_error() -> None:
    out = run_neuronode("bench", "sync", "--nodes", "1", "--json")
    assert out.returncode == 2
    assert out.stdout == "" and len(out.stderr.strip().splitlines()) == 1
    assert "--nodes 1" in out.stderr


@pytest.mark.parametrize("field, value", [("nodes", 1), ("params", 0), ("rounds", 0),
                                          ("zstd_level", 23), ("zstd_level", -2),
                                          ("chunk_bytes", 100), ("averaging", "ring")])
def test_config_refuses(field: str, value: Any) -> None:
    good: dict[str, Any] = dict(nodes=2, params=10, codec="fp32", averaging="reduce-scatter",
                                rounds=1, zstd_level=-1)
    SyncBenchConfig(**good)
    with pytest.raises(ConfigError, match=f"--{field.replace('_', '-')}"):
        SyncBenchConfig(**{**good, field: value})


def node_result(round_seconds: list[float], sha: str = "s", *, sent: int = 300,
                contributors: int = 2) -> dict[str, Any]:
    rounds = [{"seconds": s, "encode_s": s / 4, "exchange_s": s / 2, "decode_average_s": s / 4,
               "contributors": contributors, "digest": sha, "bytes_sent": sent,
               "payload_bytes": sent, "cpu_s": s, "page_faults": int(s * 10), "zstd_levels": [1],
               "shuffled": True, "encode_cpu_s": s / 8, "decode_cpu_s": s / 2}
              for s in round_seconds]
    return {"rounds": rounds, "peak_rss_bytes": 1000 + len(round_seconds), "codec_cpu_s": 0.5,
            "int8_codec_cpu_s": 0.25}


def test_summary_takes_the_slowest_worker_per_round_and_the_median() -> None:
    cfg = SyncBenchConfig(nodes=2, params=100, codec="fp32", averaging="all-to-all", rounds=3,
                          zstd_level=1)
    nodes = [node_result([1.0, 5.0, 2.0]), node_result([3.0, 1.0, 2.5])]
    gloo = [{"seconds": [0.1, 0.3, 0.2], "cpu_s": [0.1, 0.3, 0.2], "peak_rss_bytes": 7, "digest": "g"},
            {"seconds": [0.2, 0.1, 0.1], "cpu_s": [0.2, 0.1, 0.1], "peak_rss_bytes": 9, "digest": "g"}]
    result = summarize(cfg, nodes, gloo)
    assert result["round_seconds"] == [3.0, 5.0, 2.5]
    assert result["seconds"] == 3.0
    assert result["cpu_seconds"] == 4.5 and result["gloo_cpu_seconds"] == 0.3
    assert result["page_faults"] == 45  # per round summed over workers (40, 60, 45), median
    assert result["gloo_seconds"] == 0.2 and result["ratio_vs_gloo"] == 15.0
    assert result["payload_bytes_per_param"] == 3.0 and result["wire_bytes_per_param"] == 3.0
    assert result["replicas_identical"] is True and result["result_digest"] == "s"
    assert result["zstd_levels_used"] == [1] and result["byte_shuffle"] is True
    assert result["gloo_peak_rss_bytes"] == 9 and result["gloo_replicas_identical"] is True
    # CPU by role: the mean over workers per round ((1+3)/2, (5+1)/2, (2+2.5)/2), its median.
    assert result["encode_cpu_seconds"] == round(2.25 / 8, 4) and result["decode_cpu_seconds"] == 1.125
    assert result["codec_cpu_seconds"] == 0.5 and result["codec_cpu_ratio_vs_int8"] == 2.0


def test_summary_of_the_grpc_floor() -> None:
    cfg = SyncBenchConfig(nodes=2, params=100, codec="fp32", averaging="all-to-all", rounds=3,
                          zstd_level=1, grpc_floor=True)
    nodes = [node_result([1.0, 5.0, 2.0]), node_result([3.0, 1.0, 2.5])]
    floor = [{"seconds": [0.5, 1.0, 0.5], "cpu_s": [0.5, 0.5, 0.5], "bytes_received": [300, 300, 300]},
             {"seconds": [1.0, 0.5, 0.5], "cpu_s": [0.2, 0.1, 0.1], "bytes_received": [300, 300, 300]}]
    result = summarize(cfg, nodes, [], floor)
    assert result["grpc_floor_round_seconds"] == [1.0, 1.0, 0.5] and result["grpc_floor_seconds"] == 1.0
    assert result["grpc_floor_cpu_seconds"] == 0.6 and result["ratio_vs_grpc_floor"] == 3.0
    assert result["grpc_floor_wire_bytes_per_param"] == 3.0
    assert result["gloo_seconds"] is None
    # The floor workers send each peer what one node sent per round, over its N - 1 peers.
    args = bench_sync_mod.floor_args(cfg, nodes)
    assert args[args.index("--bytes-per-peer") + 1] == "300"
    assert len(args[args.index("--ports") + 1].split(",")) == 2


def test_floor_messages_cut_the_bytes_in_chunks() -> None:
    from neuronode.bench.floor import messages

    sizes = [len(m) for m in messages(2500, 1000)]
    assert sizes == [1000, 1000, 500]
    assert messages(0, 1000) == [] and [len(m) for m in messages(2000, 1000)] == [1000, 1000]


def test_summary_skips_the_auto_zstd_warm_up_round() -> None:
    cfg = SyncBenchConfig(nodes=2, params=100, codec="fp32", averaging="reduce-scatter", rounds=2,
                          zstd_level=-1)
    nodes = [node_result([9.0, 1.0, 2.0]), node_result([9.0, 1.5, 1.0])]
    nodes[0]["rounds"][0]["zstd_levels"] = [1]
    for worker in nodes:
        for r in worker["rounds"][1:]:
            r["zstd_levels"], r["shuffled"] = [0], False
    result = summarize(cfg, nodes, [])
    assert result["round_seconds"] == [1.5, 2.0] and result["zstd_levels_used"] == [0]
    assert result["byte_shuffle"] is False


def test_summary_flags_differing_replicas_and_missing_contributors() -> None:
    cfg = SyncBenchConfig(nodes=2, params=100, codec="fp32", averaging="all-to-all", rounds=1,
                          zstd_level=1)
    differ = summarize(cfg, [node_result([1.0], "a"), node_result([1.0], "b")], [])
    assert not differ["replicas_identical"] and differ["result_digest"] is None
    short = [node_result([1.0], contributors=1), node_result([1.0])]
    assert not summarize(cfg, short, [])["replicas_identical"]


def test_used_between_counts_bytes_and_cpu() -> None:
    assert used_between(Usage(100, 1.0, 7, 0.5, 1.0), Usage(400, 3.5, 19, 0.75, 2.0)) == {
        "bytes_sent": 300, "cpu_s": 2.5, "page_faults": 12, "encode_cpu_s": 0.25, "decode_cpu_s": 1.0}


def test_pool_clocks_count_only_their_own_threads_cpu() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from neuronode.bench.sync_worker import PoolClock

    clock = PoolClock()
    with ThreadPoolExecutor(1, initializer=clock.register) as pool:
        before = clock.seconds()
        pool.submit(lambda: sum(i * i for i in range(2_000_000))).result()
        busy = clock.seconds() - before
        sum(i * i for i in range(2_000_000))  # this thread's work is not the pool's
        assert 0 < busy and clock.seconds() - before < busy * 1.5 + 0.05


@pytest.mark.parametrize(("flags", "word"), [
    ({"codec": "sparse", "averaging": "reduce-scatter"}, "union of the members' kept entries"),
    ({"codec": "sparse", "sparse_bits": 3}, "--sparse-bits"),
    ({"max_upload_mbps": -1.0}, "--max-upload-mbps"),
])
def test_config_refuses_what_the_daemon_refuses(flags: dict[str, Any], word: str) -> None:
    good: dict[str, Any] = dict(nodes=2, params=10, codec="fp32", averaging="all-to-all", rounds=1, zstd_level=-1)
    with pytest.raises(ConfigError, match=word):
        SyncBenchConfig(**{**good, **flags})


def test_round_deadlines_follow_the_upload_cap() -> None:
    """fp32 at 20 Mbit/s, 4 nodes, 25M parameters: 300 MB a node a round, two minutes."""
    free = SyncBenchConfig(nodes=4, params=25_000_000, codec="fp32", averaging="all-to-all", rounds=1, zstd_level=0)
    capped = SyncBenchConfig(nodes=4, params=25_000_000, codec="fp32", averaging="all-to-all", rounds=1,
                             zstd_level=0, max_upload_mbps=20.0)
    assert capped.round_timeout_s - free.round_timeout_s == pytest.approx(3 * 120.0)


def test_free_ports_come_from_below_the_ephemeral_range_and_never_twice() -> None:
    """A port the kernel hands out for bind(0) is in its ephemeral range, where any outgoing
    connection may take it before the node binds it (a node failed to start in CI: 'Failed to
    bind'): nodes get ports below that range, free when handed out, each once per process."""
    import socket

    from neuronode.bench.common import LOWEST_PORT, _ephemeral_floor, free_port

    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(LOWEST_PORT <= p < _ephemeral_floor() for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # free when handed out (nobody else took it since)
