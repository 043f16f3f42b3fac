"""`neuronode bench sync`: average a P-parameter pseudo-gradient among N local node processes
through neuronode's real transport, and time gloo's all_reduce of the same size as reference.

Parent (`run_sync_bench`): starts N `python -m neuronode.bench.sync node ...` processes, waits
for them (bounded), then N `... gloo ...` processes, and folds their JSON result files into one
dict. Every child is killed when the parent leaves, whatever the reason (Ctrl-C included: the
children run in their own session, so the terminal's SIGINT reaches only the parent); a child
also exits by itself when its parent disappears.

Node worker (neuronode.bench.sync_worker): a SwarmNode on 127.0.0.1:0 (worker 0's address is
the others' bootstrap peer), a random float32 pseudo-gradient seeded by its index, then rounds,
each averaged by the very protocol object a node runs (neuronode.averaging: AllToAll or
ReduceScatter) over the SwarmNode's transport, with a node's encoder and error feedback.

A round is timed on each worker from encode start to the averaged vector; the round's time is
the slowest worker's (every replica has the result only then), and the benchmark reports the
median over rounds. `exchange_seconds` is the time spent waiting in exchanges (both phases for
reduce-scatter); `decode_average_seconds` the averaging (for reduce-scatter: reducing and
re-encoding my shard, plus decoding and concatenating the averaged shards). Rounds start
together: before round r each worker waits until its peer table shows every peer at round r
(so the swarm's push and expect rules, which read that table, include everyone) and then for
all workers' barrier files. Byte counters are read at those barriers, when every push of the
previous round has finished. Hashing the result (to compare replicas) happens after the
next barrier, when every worker is done with the round: it is not timed and takes no CPU from a
slower worker's round. `cpu_seconds` and `page_faults` are all workers' CPU time and minor
page faults (fresh memory the kernel had to map and zero) per round, medians over rounds.

Bytes, per parameter: `payload_bytes_per_param` is one encoded full contribution: the frame
bytes (zstd output or raw codec payload, without gRPC/protobuf framing) of all of one node's
shards, its own included (all-to-all: its one contribution). `wire_bytes_per_param` is
everything one node sends in a round, message framing included. Both are means over the same
workers and timed rounds, so their ratio means something even when auto zstd varies the
level: about (N-1) x payload for all-to-all, 2(N-1)/N x payload for reduce-scatter.

CPU by role, per node and round: `encode_cpu_seconds` (the encoder thread: encoding and error
feedback) and `decode_cpu_seconds` (the two codec threads: taking in received chunks, and
averaging, which decodes every contribution into the float32 accumulator). `codec_cpu_seconds`
and `int8_codec_cpu_seconds` are one encode and decode of a node's whole vector with this run's
codec and with int8, timed by each worker after its rounds (the median over workers), and
`codec_cpu_ratio_vs_int8` their ratio: a codec's cost against int8's under the same load.

`--max-upload-mbps M` caps every node's upload as the daemon's flag does (0: none); round
deadlines then grow by three times what one node's all-to-all upload takes at the cap.
`--codec sparse` takes the daemon's `--sparse-*` settings, reported back in the JSON.

`--zstd-level -1` (auto) chooses the level per encode as the daemon does
(`neuronode.codec.auto_zstd_level`, from the node's last push rate and our last zstd rate);
the first round then runs at level 1 while nothing is measured, so auto adds one untimed
warm-up round. `zstd_levels_used` lists the levels of the timed rounds.

Gloo workers run after the node workers, never beside them: N ranks all_reduce(SUM) the same
size of float32 and divide, after one untimed warm-up; again the slowest rank per round counts.

`--grpc-floor` then runs N bare grpc.aio workers (neuronode.bench.floor) that move the bytes the
node workers sent, and nothing else: `grpc_floor_seconds` and `ratio_vs_grpc_floor` separate
what gRPC costs from what neuronode adds.

Files in the work dir: `address-{i}`, `barrier-{r}-{i}`, `node-{i}.json` / `gloo-{i}.json`
(results) and `node-{i}.log` / `gloo-{i}.log` (stderr, quoted when a worker fails).
This module is the parent; it imports neither torch nor grpc.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from neuronode.bench.common import BenchError, check, free_port, wait_all
from neuronode.config import AVERAGINGS, RANGES, NodeConfig
from neuronode.errors import ConfigError

# Untimed full-size rounds before the timed ones. 0 keeps N=4, P=25M within a minute on 2 cores:
# the hellos have opened every channel already; the first round is still often slower (gRPC
# flow-control windows grow during the first big transfer), which the median over >= 3 rounds
# absorbs and `round_seconds` shows. --zstd-level -1 adds one (see the module docstring).
WARMUP_ROUNDS = 0
START_TIMEOUT_S = 120.0  # process start (torch import) and peer discovery, on a loaded machine
AVERAGING = AVERAGINGS
AUTO_ZSTD = -1
SPARSE_SETTINGS = ("sparse_k", "sparse_bits", "sparse_block", "sparse_decay")


def bytes_per_param_bound(codec: str) -> float:
    """At least what one parameter takes in `codec` (a parent's estimate, without torch: the
    timeouts only need an upper bound; under reduce-scatter a node sends less)."""
    return {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.07, "int4": 0.57}.get(codec, 0.05)


class BenchInterrupted(BenchError):
    """Ctrl-C: the workers were killed and nothing was measured (exit status 130, as for SIGINT)."""

    exit_code = 130


@dataclass(frozen=True)
class SyncBenchConfig:
    """What every worker of one `bench sync` run needs to know."""

    nodes: int
    params: int
    codec: str
    averaging: str
    rounds: int
    zstd_level: int  # -1: auto, as the daemon's --zstd-level -1
    gloo: bool = True
    chunk_bytes: int = NodeConfig.chunk_bytes
    byte_shuffle: bool = NodeConfig.byte_shuffle
    secret_file: str = ""  # closed swarm: HMAC proofs on every call and contribution
    grpc_floor: bool = False  # also time bare grpc.aio moving the same bytes (neuronode.bench.floor)
    max_upload_mbps: float = 0.0  # every node's --max-upload-mbps (0: no cap)
    sparse_k: int = NodeConfig.sparse_k  # --codec sparse: its settings, as the daemon's flags
    sparse_bits: int = NodeConfig.sparse_bits
    sparse_block: int = NodeConfig.sparse_block
    sparse_decay: float = NodeConfig.sparse_decay

    def __post_init__(self) -> None:
        check((self.nodes >= 2, f"--nodes {self.nodes}: averaging needs at least 2 nodes"),
              (self.params >= 1, f"--params {self.params}: give at least 1 parameter (e.g. 25e6)"),
              (self.rounds >= 1, f"--rounds {self.rounds}: time at least 1 round"))
        for name in ("zstd_level", "chunk_bytes"):  # the daemon's own limits
            ok, allowed = RANGES[name]
            if not ok(getattr(self, name)):
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be {allowed}")
        if self.averaging not in AVERAGING:
            raise ConfigError(f"--averaging {self.averaging}: choose one of {', '.join(AVERAGING)}")
        # The daemon's own checks of the codec's settings and the cap, naming the flag.
        NodeConfig(codec=self.codec, averaging=self.averaging, max_upload_mbps=self.max_upload_mbps,
                   **{name: getattr(self, name) for name in SPARSE_SETTINGS})

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SyncBenchConfig:
        return cls(nodes=args.nodes, params=int(args.params), codec=args.codec,
                   averaging=args.averaging, rounds=args.rounds, zstd_level=args.zstd_level,
                   gloo=not args.no_gloo,
                   chunk_bytes=getattr(args, "chunk_bytes", NodeConfig.chunk_bytes),
                   byte_shuffle=getattr(args, "byte_shuffle", NodeConfig.byte_shuffle),
                   secret_file=getattr(args, "secret_file", "") or "",
                   grpc_floor=getattr(args, "grpc_floor", False),
                   max_upload_mbps=getattr(args, "max_upload_mbps", 0.0),
                   **{name: getattr(args, name, getattr(NodeConfig, name)) for name in SPARSE_SETTINGS})

    @property
    def warmup_rounds(self) -> int:
        """Auto zstd runs its first round at level 1 (nothing measured yet); leave it untimed."""
        return WARMUP_ROUNDS + (1 if self.zstd_level == AUTO_ZSTD else 0)

    @property
    def round_timeout_s(self) -> float:
        """Generous bound for one round (about 10x what 2 busy cores need), plus, under an
        upload cap, three times what one node's upload takes at the cap (all-to-all: N - 1 full
        contributions at the codec's full size, fp32 at most: bytes_per_param_bound)."""
        capped = 0.0
        if self.max_upload_mbps:
            upload_bytes = (self.nodes - 1) * self.params * bytes_per_param_bound(self.codec)
            capped = 3 * upload_bytes * 8 / (self.max_upload_mbps * 1e6)
        return 60.0 + 4e-7 * self.params * self.nodes + capped

    @property
    def total_timeout_s(self) -> float:
        return START_TIMEOUT_S + (self.warmup_rounds + self.rounds + 1) * self.round_timeout_s


# ---- parent ---------------------------------------------------------------------------------


def run_sync_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by the CLI's `bench sync` flags; returns the JSON object."""
    cfg = SyncBenchConfig.from_args(args)
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="neuronode-bench-") as tmp:
            workdir = Path(tmp)
            nodes = run_workers(cfg, workdir, "node", [[] for _ in range(cfg.nodes)])
            gloo: list[dict[str, Any]] = []
            if cfg.gloo:
                port = ["--port", str(free_port())]
                gloo = run_workers(cfg, workdir, "gloo", [port for _ in range(cfg.nodes)])
            floor: list[dict[str, Any]] = []
            if cfg.grpc_floor:
                floor = run_workers(cfg, workdir, "floor", [floor_args(cfg, nodes)] * cfg.nodes)
    except KeyboardInterrupt:
        raise BenchInterrupted("bench sync interrupted; its workers were stopped") from None
    result = summarize(cfg, nodes, gloo, floor)
    result["bench_seconds"] = round(time.monotonic() - started, 3)
    return result


def worker_argv(cfg: SyncBenchConfig, workdir: Path, kind: str, index: int) -> list[str]:
    return [sys.executable, "-m", "neuronode.bench.sync_worker", kind, "--dir", str(workdir),
            "--index", str(index), "--config", json.dumps(asdict(cfg))]


def run_workers(
    cfg: SyncBenchConfig, workdir: Path, kind: str, extra: list[list[str]],
) -> list[dict[str, Any]]:
    """Start one `kind` worker per entry of `extra`, wait for all, return their results."""
    # One torch/OpenMP thread per worker: N workers already share the machine's cores.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo"}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for index, more in enumerate(extra):
            with open(workdir / f"{kind}-{index}.log", "wb") as log:
                # Own session: a terminal's Ctrl-C interrupts only us, and we stop the workers.
                procs.append(subprocess.Popen(
                    [*worker_argv(cfg, workdir, kind, index), *more], env=env,
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                    start_new_session=True))
        wait_all(procs, [f"{kind} worker {i}" for i in range(len(procs))],
                 [workdir / f"{kind}-{i}.log" for i in range(len(procs))],
                 deadline=time.monotonic() + cfg.total_timeout_s)
    finally:
        for proc in procs:  # only still-running ones: after an error or Ctrl-C
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            proc.wait(timeout=30)
    return [json.loads((workdir / f"{kind}-{i}.json").read_text()) for i in range(len(procs))]


def floor_args(cfg: SyncBenchConfig, nodes: list[dict[str, Any]]) -> list[str]:
    """The floor workers' ports, and the bytes each sends each peer a round: what one node sent
    per round over its N-1 peers (message framing included; the mean over timed worker-rounds,
    as `wire_bytes_per_param`: with auto zstd the size varies from round to round)."""
    sent = statistics.fmean(r["bytes_sent"] for w in nodes for r in w["rounds"][cfg.warmup_rounds:])
    ports = ",".join(str(free_port()) for _ in range(cfg.nodes))
    return ["--ports", ports, "--bytes-per-peer", str(int(sent) // (cfg.nodes - 1))]


def summarize(cfg: SyncBenchConfig, nodes: list[dict[str, Any]], gloo: list[dict[str, Any]],
              floor: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Fold per-worker results into the benchmark's JSON object (see the module docstring)."""
    timed = [w["rounds"][cfg.warmup_rounds:] for w in nodes]
    n_rounds = len(timed[0])
    every = [r for rounds in timed for r in rounds]

    def slowest(key: str) -> list[float]:  # per round, the slowest worker
        return [max(rounds[k][key] for rounds in timed) for k in range(n_rounds)]

    def per_node(key: str) -> list[float]:  # per round, the mean over workers
        return [statistics.fmean(rounds[k][key] for rounds in timed) for k in range(n_rounds)]

    round_s = slowest("seconds")
    digests_agree = all(len({rounds[k]["digest"] for rounds in timed}) == 1 for k in range(n_rounds))
    contributors = min(r["contributors"] for r in every)
    # Both means over the same worker-rounds: with auto zstd the level, so the size, may vary.
    payload = statistics.fmean(r["payload_bytes"] for r in every)
    sent = statistics.fmean(r["bytes_sent"] for r in every)
    cpu_s = [sum(rounds[k]["cpu_s"] for rounds in timed) for k in range(n_rounds)]
    faults = [sum(rounds[k]["page_faults"] for rounds in timed) for k in range(n_rounds)]
    seconds = statistics.median(round_s)
    result: dict[str, Any] = {
        "nodes": cfg.nodes, "params": cfg.params, "codec": cfg.codec, "averaging": cfg.averaging,
        "rounds": cfg.rounds, "zstd_level": cfg.zstd_level, "chunk_bytes": cfg.chunk_bytes,
        "zstd_levels_used": sorted({level for r in every for level in r["zstd_levels"]}),
        "byte_shuffle": all(r["shuffled"] for r in every),
        "seconds": round(seconds, 4), "round_seconds": [round(s, 4) for s in round_s],
        "encode_seconds": round(statistics.median(slowest("encode_s")), 4),
        "exchange_seconds": round(statistics.median(slowest("exchange_s")), 4),
        "decode_average_seconds": round(statistics.median(slowest("decode_average_s")), 4),
        "payload_bytes_per_param": round(payload / cfg.params, 4),
        "wire_bytes_per_param": round(sent / cfg.params, 4),
        "peak_rss_bytes": max(w["peak_rss_bytes"] for w in nodes),
        # All workers' CPU per round: steadier than wall time on a shared machine.
        "cpu_seconds": round(statistics.median(cpu_s), 3),
        # Per node and round (mean over workers, median over rounds): its encoder thread's CPU
        # (encoding and error feedback), its two codec threads' (taking in chunks: decompressing,
        # checking, hashing; and averaging: decoding every contribution into the accumulator).
        "encode_cpu_seconds": round(statistics.median(per_node("encode_cpu_s")), 4),
        "decode_cpu_seconds": round(statistics.median(per_node("decode_cpu_s")), 4),
        # One encode and decode of a node's whole vector with this codec and with int8, timed in
        # the same run after the rounds (median over workers): the codec's cost against int8's.
        "codec_cpu_seconds": round(statistics.median(w["codec_cpu_s"] for w in nodes), 4),
        "int8_codec_cpu_seconds": round(statistics.median(w["int8_codec_cpu_s"] for w in nodes), 4),
        "max_upload_mbps": cfg.max_upload_mbps,
        # All workers' minor page faults per round (fresh memory the kernel had to zero).
        "page_faults": int(statistics.median(faults)),
        "replicas_identical": digests_agree and contributors == cfg.nodes,
        # The last timed round's average (BLAKE3 of its float32 bytes), when all replicas agree.
        "result_digest": timed[0][-1]["digest"] if digests_agree else None,
        "gloo_seconds": None, "ratio_vs_gloo": None,
        "grpc_floor_seconds": None, "ratio_vs_grpc_floor": None,
    }
    result["codec_cpu_ratio_vs_int8"] = round(result["codec_cpu_seconds"] / max(result["int8_codec_cpu_seconds"], 1e-9), 2)
    if cfg.codec == "sparse":
        result.update({name: getattr(cfg, name) for name in SPARSE_SETTINGS})
    if gloo:
        result.update(summarize_gloo(gloo))
        result["ratio_vs_gloo"] = round(seconds / max(result["gloo_seconds"], 1e-9), 2)
    if floor:
        result.update(summarize_reference(floor, "grpc_floor"))
        result["ratio_vs_grpc_floor"] = round(seconds / max(result["grpc_floor_seconds"], 1e-9), 2)
        # What each floor worker took in per round: the node run's traffic, moved again.
        received = statistics.fmean(b for w in floor for b in w["bytes_received"])
        result["grpc_floor_wire_bytes_per_param"] = round(received / cfg.params, 4)
    return result


def summarize_reference(workers: list[dict[str, Any]], prefix: str) -> dict[str, Any]:
    """A reference's times, measured as the node run's: slowest worker per round, median; CPU
    of all workers per round, median."""
    n_rounds = len(workers[0]["seconds"])
    round_s = [max(w["seconds"][k] for w in workers) for k in range(n_rounds)]
    cpu_s = [sum(w["cpu_s"][k] for w in workers) for k in range(n_rounds)]
    return {
        f"{prefix}_seconds": round(statistics.median(round_s), 4),
        f"{prefix}_round_seconds": [round(s, 4) for s in round_s],
        f"{prefix}_cpu_seconds": round(statistics.median(cpu_s), 3),
    }


def summarize_gloo(gloo: list[dict[str, Any]]) -> dict[str, Any]:
    """The gloo reference's fields."""
    return {
        **summarize_reference(gloo, "gloo"),
        "gloo_peak_rss_bytes": max(w["peak_rss_bytes"] for w in gloo),
        "gloo_replicas_identical": len({w["digest"] for w in gloo}) == 1,
    }
