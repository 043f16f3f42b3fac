"""`neuronode bench sync`: average a P-parameter pseudo-gradient among N local node processes
through neuronode's real transport, and time gloo's all_reduce of the same size as reference.

Parent (`run_sync_bench`): starts N `python -m neuronode.bench.sync node ...` processes, waits
for them (bounded), then N `... gloo ...` processes, and folds their JSON result files into one
dict. Every child is killed when the parent leaves, whatever the reason (Ctrl-C included: the
children run in their own session, so the terminal's SIGINT reaches only the parent); a child
also exits by itself when its parent disappears.

Node worker: a SwarmNode on 127.0.0.1:0 (worker 0's address is the others' bootstrap peer), a
random float32 pseudo-gradient seeded by its index, then rounds, averaged as the daemon does:

- all-to-all: encode the whole contribution, send it to every peer, average all N in sorted
  sender order.
- reduce-scatter (docs/protocol.md): members are the sorted ids of all N workers; encode one
  shard per member, send shard j to member j, average the slices of my shard, send the averaged
  shard to every member, concatenate (`neuronode.daemon.assemble_shards`).

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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuronode.bench.common import BenchError, free_port, wait_all
from neuronode.config import RANGES, NodeConfig
from neuronode.errors import ConfigError

if TYPE_CHECKING:  # the parent process never imports torch or grpc; workers import them lazily
    import torch

    from neuronode.codec import Assembler, ErrorFeedback
    from neuronode.swarm.node import Outgoing, SwarmNode
    from neuronode.swarm.rounds import Contribution
    from neuronode.trainer import Encoded

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
POLL_S = 0.005
# Untimed full-size rounds before the timed ones. 0 keeps N=4, P=25M within a minute on 2 cores:
# the hellos have opened every channel already; the first round is still often slower (gRPC
# flow-control windows grow during the first big transfer), which the median over >= 3 rounds
# absorbs and `round_seconds` shows. --zstd-level -1 adds one (see the module docstring).
WARMUP_ROUNDS = 0
START_TIMEOUT_S = 120.0  # process start (torch import) and peer discovery, on a loaded machine
AVERAGING = ("all-to-all", "reduce-scatter")
AUTO_ZSTD = -1


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

    def __post_init__(self) -> None:
        if self.nodes < 2:
            raise ConfigError(f"--nodes {self.nodes}: averaging needs at least 2 nodes")
        if self.params < 1:
            raise ConfigError(f"--params {self.params}: give at least 1 parameter (e.g. 25e6)")
        if self.rounds < 1:
            raise ConfigError(f"--rounds {self.rounds}: time at least 1 round")
        for name in ("zstd_level", "chunk_bytes"):  # the daemon's own limits
            ok, allowed = RANGES[name]
            if not ok(getattr(self, name)):
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be {allowed}")
        if self.averaging not in AVERAGING:
            raise ConfigError(f"--averaging {self.averaging}: choose one of {', '.join(AVERAGING)}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SyncBenchConfig:
        return cls(nodes=args.nodes, params=int(args.params), codec=args.codec,
                   averaging=args.averaging, rounds=args.rounds, zstd_level=args.zstd_level,
                   gloo=not args.no_gloo,
                   chunk_bytes=getattr(args, "chunk_bytes", NodeConfig.chunk_bytes),
                   byte_shuffle=getattr(args, "byte_shuffle", NodeConfig.byte_shuffle),
                   secret_file=getattr(args, "secret_file", "") or "",
                   grpc_floor=getattr(args, "grpc_floor", False))

    @property
    def warmup_rounds(self) -> int:
        """Auto zstd runs its first round at level 1 (nothing measured yet); leave it untimed."""
        return WARMUP_ROUNDS + (1 if self.zstd_level == AUTO_ZSTD else 0)

    @property
    def round_timeout_s(self) -> float:
        """Generous bound for one round (about 10x what 2 busy cores need)."""
        return 60.0 + 4e-7 * self.params * self.nodes

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
    return [sys.executable, "-m", "neuronode.bench.sync", kind, "--dir", str(workdir),
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
        # All workers' minor page faults per round (fresh memory the kernel had to zero).
        "page_faults": int(statistics.median(faults)),
        "replicas_identical": digests_agree and contributors == cfg.nodes,
        # The last timed round's average (BLAKE3 of its float32 bytes), when all replicas agree.
        "result_digest": timed[0][-1]["digest"] if digests_agree else None,
        "gloo_seconds": None, "ratio_vs_gloo": None,
        "grpc_floor_seconds": None, "ratio_vs_grpc_floor": None,
    }
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


# ---- encoding, as the daemon does -----------------------------------------------------------


class BenchEncoder:
    """The daemon's own encoder (neuronode.codec.VectorEncoder, which the Trainer uses too), plus
    Trainer.encode / encode_shards / reduce_shard's steps around it without a model.
    tests/test_bench.py checks that both give the same frames."""

    def __init__(self, *, codec: str, chunk_bytes: int, zstd_level: int, byte_shuffle: bool) -> None:
        from neuronode.codec import VectorEncoder

        self.vector = VectorEncoder(codec=codec, chunk_bytes=chunk_bytes, zstd_level=zstd_level,
                                    byte_shuffle=byte_shuffle)

    def encode(self, vector: torch.Tensor, link_bytes_per_s: float, *, weight: float = 1.0) -> Encoded:
        return self.vector.encode(vector, link_bytes_per_s, weight=weight)

    def encode_parts(self, delta: torch.Tensor, ranges: list[tuple[int, int]], link_bytes_per_s: float,
                     feedback: ErrorFeedback | None) -> list[Encoded]:
        """Trainer.encode (one range) and Trainer.encode_shards: error feedback compensates the
        whole vector, each range is encoded on its own, feedback learns from the wire form."""

        if feedback is not None:
            delta = feedback.compensate(delta)
        parts = [self.encode(delta[a:b], link_bytes_per_s) for a, b in ranges]
        if feedback is not None:
            feedback.update_parts(delta, [(a, p.own) for (a, _), p in zip(ranges, parts, strict=True)])
        return parts

    def reduce(self, pieces: dict[str, tuple[Assembler, float]], link_bytes_per_s: float) -> Encoded:
        """Trainer.reduce_shard with the mean: average the slices (sorted by sender), encode the
        result; its weight is the pieces' total."""
        avg = average_of(pieces)
        return self.encode(avg, link_bytes_per_s, weight=float(sum(w for _, w in pieces.values())))


def average_of(pieces: dict[str, tuple[Assembler, float]]) -> torch.Tensor:
    """Average as the daemon does: in sorted sender order, each added chunk by chunk."""
    from neuronode.diloco import average

    return average(dict(pieces))


def pieces_of(got: dict[str, Contribution]) -> dict[str, tuple[Assembler, float]]:
    return {c.sender_id: (c.data, c.weight) for c in got.values()}


def frame_bytes(parts: list[Encoded]) -> int:
    return sum(len(f.data) for enc in parts for f in enc.frames)


# ---- workers --------------------------------------------------------------------------------


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def exit_with_parent() -> None:
    """A worker whose parent died (killed, crashed) must not linger: exit within a second."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def wait_until(what: str, predicate: Callable[[], bool], *, deadline: float) -> None:
    """Poll `predicate()` without blocking the event loop; raise TimeoutError at `deadline`."""
    while not predicate():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(POLL_S)


def pseudo_gradient(n: int, seed: int) -> torch.Tensor:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen) * 1e-3  # (P,) float32, a pseudo-gradient's scale


def digest_of(t: torch.Tensor) -> str:
    """BLAKE3 of a float32 vector's bytes, read in place (no copy)."""
    import blake3

    return blake3.blake3(memoryview(t.contiguous().numpy()).cast("B")).hexdigest()


@dataclass
class Averaged:
    """One worker's round: the average, what it took, and what it sent."""

    average: torch.Tensor
    contributors: int  # the fewest contributions any part of the average holds
    encoded: list[Encoded]  # every encode of the round (reduce-scatter: shards and reduced shard)
    payload_bytes: int  # frame bytes of our full contribution (all shards)
    encode_s: float
    exchange_s: float
    decode_average_s: float


class NodeWorker:
    """One benchmark node: a SwarmNode plus its pseudo-gradient and round loop."""

    def __init__(self, cfg: SyncBenchConfig, *, workdir: Path, index: int) -> None:
        from neuronode.codec import ErrorFeedback, get_codec

        self.cfg = cfg
        self.workdir = workdir
        self.index = index
        self.node_id = f"bench-{index}"
        self.members = tuple(sorted(f"bench-{i}" for i in range(cfg.nodes)))  # reduce-scatter
        self.delta = pseudo_gradient(cfg.params, seed=1000 + index)
        self.feedback = ErrorFeedback(cfg.params) if get_codec(cfg.codec).lossy else None
        self.encoder = BenchEncoder(codec=cfg.codec, chunk_bytes=cfg.chunk_bytes,
                                     zstd_level=cfg.zstd_level, byte_shuffle=cfg.byte_shuffle)
        # As in the daemon: one thread for torch work, two for the swarm's chunk decoding.
        self.work_pool = ThreadPoolExecutor(1, thread_name_prefix="work")
        self.codec_pool = ThreadPoolExecutor(2, thread_name_prefix="codec")

    async def run(self) -> dict[str, Any]:
        from neuronode.swarm.node import SwarmConfig, SwarmNode

        deadline = time.monotonic() + START_TIMEOUT_S
        peers: tuple[str, ...] = ()
        if self.index > 0:
            first = self.workdir / "address-0"
            await wait_until("worker 0's address", first.exists, deadline=deadline)
            peers = (first.read_text().strip(),)
        from neuronode.security.auth import load_secret
        from neuronode.swarm.security import Security

        secret = load_secret(self.cfg.secret_file) if self.cfg.secret_file else b""
        node = SwarmNode(SwarmConfig(
            node_id=self.node_id, swarm_id="bench", manifest_hash=f"bench-{self.cfg.params}",
            n_elements=self.cfg.params, listen="127.0.0.1:0", advertise="", peers=peers,
            sync_timeout_s=self.cfg.round_timeout_s, min_contributors=self.cfg.nodes,
            heartbeat_s=HEARTBEAT_S,
        ), executor=self.codec_pool, security=Security(node_id=self.node_id, swarm_id="bench", secret=secret))
        address = await node.start()
        try:
            write_atomic(self.workdir / f"address-{self.index}", address)
            rounds = await self.rounds(node, start_deadline=deadline)
        finally:
            await node.drain(timeout_s=5.0)
            await node.stop(grace_s=1.0)
            self.work_pool.shutdown(wait=True)
            self.codec_pool.shutdown(wait=True)
        return {"index": self.index, "address": address, "rounds": rounds,
                "peak_rss_bytes": peak_rss_bytes()}

    async def rounds(self, node: SwarmNode, *, start_deadline: float) -> list[dict[str, Any]]:
        """Warm-up and timed rounds; each result gets the bytes sent and the CPU time used
        between its barriers (all threads of this process, so the swarm's work is counted)."""
        total = self.cfg.warmup_rounds + self.cfg.rounds
        results: list[dict[str, Any]] = []
        usage: list[Usage] = []
        deadline = start_deadline
        unhashed: torch.Tensor | None = None  # the last round's average
        for round_id in range(total + 1):
            await self.barrier(node, round_id, deadline=deadline)
            usage.append(Usage.now(node.counters.bytes_sent))
            if unhashed is not None:
                # After the barrier: every worker is done with that round, so hashing steals no
                # CPU from a slower worker's timed work (and its CPU time is not counted).
                results[-1]["digest"] = await self.off_loop(digest_of, unhashed)
                usage[-1] = Usage.now(node.counters.bytes_sent)
                unhashed = None
            if round_id < total:
                deadline = time.monotonic() + self.cfg.round_timeout_s
                result, unhashed = await self.one_round(node, round_id, deadline=deadline)
                results.append(result)
        for result, before, after in zip(results, usage, usage[1:], strict=False):
            result.update(used_between(before, after))
        return results

    async def barrier(self, node: SwarmNode, round_id: int, *, deadline: float) -> None:
        """Every peer at `round_id` in our table (so we push to and wait for all of them), then
        every worker says so (so rounds start together)."""
        others = self.cfg.nodes - 1
        await wait_until(
            f"{others} peers at round {round_id}",
            lambda: sum(p.round >= round_id for p in node.table.alive()) >= others,
            deadline=deadline)
        (self.workdir / f"barrier-{round_id}-{self.index}").touch()
        names = [self.workdir / f"barrier-{round_id}-{i}" for i in range(self.cfg.nodes)]
        await wait_until(f"all workers at the round {round_id} barrier",
                         lambda: all(n.exists() for n in names), deadline=deadline)

    async def one_round(self, node: SwarmNode, round_id: int, *,
                        deadline: float) -> tuple[dict[str, Any], torch.Tensor]:
        """Average one round as configured and tell the peers; returns the result and the
        average, which `rounds` hashes after the next barrier (untimed)."""
        if self.cfg.averaging == "reduce-scatter":
            done = await self.reduce_scatter(node, round_id, deadline=deadline)
        else:
            done = await self.all_to_all(node, round_id, deadline=deadline)
        node.record_round(round_id, f"round-{round_id}")  # the bench compares digests itself
        return {"round_id": round_id, "encode_s": done.encode_s, "exchange_s": done.exchange_s,
                "decode_average_s": done.decode_average_s,
                "seconds": done.encode_s + done.exchange_s + done.decode_average_s,
                "contributors": done.contributors, "digest": "", "payload_bytes": done.payload_bytes,
                "zstd_levels": sorted({e.zstd_level for e in done.encoded}),
                "shuffled": all(e.shuffled for e in done.encoded)}, done.average

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.work_pool, fn, *args)

    def outgoing(self, round_id: int, enc: Encoded, **shard: Any) -> Outgoing:
        from neuronode.swarm.node import Outgoing

        return Outgoing(round_id=round_id, codec=self.cfg.codec, frames=enc.frames, digest=enc.digest,
                        n_elements=self.cfg.params, chunk_elements=enc.chunk_elements,
                        weight=enc.weight, shuffled=enc.shuffled, **shard)

    async def exchange(self, node: SwarmNode, out: Outgoing | dict[str, Outgoing], own: Contribution,
                       *, deadline: float, members: tuple[str, ...] = ()) -> dict[str, Contribution]:
        """node.exchange within the round's deadline; a timeout names who was missing."""
        from neuronode.swarm.node import Outgoing
        from neuronode.v1 import node_pb2 as pb

        try:
            return await asyncio.wait_for(node.exchange(out, own, members=members),
                                          deadline - time.monotonic())
        except TimeoutError:
            phase = out.phase if isinstance(out, Outgoing) else pb.PHASE_SHARD  # as node.exchange
            have = sorted(node.book_for(phase).contributors(own.round_id))
            rounds = {p.node_id: p.round for p in node.table.alive()}
            raise TimeoutError(f"round {own.round_id}: exchange (phase {phase}) timed out with "
                               f"contributions from {have}; live peers at rounds {rounds}") from None

    async def all_to_all(self, node: SwarmNode, round_id: int, *, deadline: float) -> Averaged:
        """Encode the whole contribution, send it to everyone, average all of them."""
        from neuronode.swarm.rounds import Contribution

        t0 = time.perf_counter()
        (enc,) = await self.off_loop(self.encoder.encode_parts, self.delta, [(0, self.cfg.params)],
                                     node.push_rate / (self.cfg.nodes - 1), self.feedback)
        t1 = time.perf_counter()
        own = Contribution(self.node_id, round_id, self.cfg.codec, enc.weight, enc.own)
        got = await self.exchange(node, self.outgoing(round_id, enc), own, deadline=deadline)
        t2 = time.perf_counter()
        avg = await self.off_loop(average_of, pieces_of(got))
        t3 = time.perf_counter()
        return Averaged(average=avg, contributors=len(got), encoded=[enc],
                        payload_bytes=frame_bytes([enc]), encode_s=t1 - t0, exchange_s=t2 - t1,
                        decode_average_s=t3 - t2)

    async def reduce_scatter(self, node: SwarmNode, round_id: int, *, deadline: float) -> Averaged:
        """Daemon.reduce_scatter: shard j to member j, average my shard, send it to all, concatenate."""
        from neuronode.codec import shard_ranges
        from neuronode.daemon import assemble_shards
        from neuronode.swarm.rounds import Contribution
        from neuronode.v1 import node_pb2 as pb

        members, codec = self.members, self.cfg.codec
        me = members.index(self.node_id)
        ranges = shard_ranges(self.cfg.params, len(members), codec)
        t0 = time.perf_counter()
        shards = await self.off_loop(self.encoder.encode_parts, self.delta, ranges, node.push_rate,
                                     self.feedback)
        t1 = time.perf_counter()
        outs = {m: self.outgoing(round_id, shards[j], phase=pb.PHASE_SHARD, shard_index=j,
                                 members=members)
                for j, m in enumerate(members) if m != self.node_id}
        own = Contribution(self.node_id, round_id, codec, shards[me].weight, shards[me].own,
                           members=members, shard_index=me)
        pieces = await self.exchange(node, outs, own, deadline=deadline, members=members)
        t2 = time.perf_counter()
        reduced = await self.off_loop(self.encoder.reduce, pieces_of(pieces), node.push_rate)
        t3 = time.perf_counter()
        contributors = tuple(sorted(pieces))
        out = self.outgoing(round_id, reduced, phase=pb.PHASE_AVERAGED, shard_index=me,
                            members=members, contributors=contributors)
        own_avg = Contribution(self.node_id, round_id, codec, reduced.weight, reduced.own,
                               members=members, contributors=contributors, shard_index=me)
        averaged = await self.exchange(node, out, own_avg, deadline=deadline, members=members)
        averaged = await node.keep_agreed_shards(round_id, members, averaged)  # as the daemon
        t4 = time.perf_counter()
        result = await self.off_loop(assemble_shards, averaged, members, ranges, self.cfg.params,
                                     round_id)
        t5 = time.perf_counter()
        complete = len(averaged) == len(members)  # a missing shard is zeros: no full average
        fewest = min(len(c.contributors) for c in averaged.values()) if complete else 0
        return Averaged(average=result.average, contributors=fewest, encoded=[*shards, reduced],
                        payload_bytes=frame_bytes(shards), encode_s=t1 - t0,
                        exchange_s=(t2 - t1) + (t4 - t3), decode_average_s=(t3 - t2) + (t5 - t4))


@dataclass(frozen=True)
class Usage:
    """A node's cumulative counters at one barrier."""

    bytes_sent: int
    cpu_s: float
    page_faults: int

    @classmethod
    def now(cls, bytes_sent: int) -> Usage:
        return cls(bytes_sent, time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


def used_between(before: Usage, after: Usage) -> dict[str, Any]:
    """Bytes sent (message framing included), CPU seconds and minor page faults between two barriers."""
    return {"bytes_sent": after.bytes_sent - before.bytes_sent, "cpu_s": after.cpu_s - before.cpu_s,
            "page_faults": after.page_faults - before.page_faults}


def gloo_worker(cfg: SyncBenchConfig, *, index: int, port: int) -> dict[str, Any]:
    """Reference: all_reduce(SUM) then divide, one untimed warm-up, the same rounds."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index,
                            world_size=cfg.nodes, timeout=timedelta(seconds=cfg.round_timeout_s))
    try:
        delta = pseudo_gradient(cfg.params, seed=1000 + index)
        seconds, cpu_s = [], []
        for _ in range(1 + cfg.rounds):
            buf = delta.clone()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            dist.all_reduce(buf, op=dist.ReduceOp.SUM)
            buf.div_(cfg.nodes)
            seconds.append(time.perf_counter() - t0)
            cpu_s.append(time.process_time() - c0)
        digest = digest_of(buf)
    finally:
        dist.destroy_process_group()
    return {"index": index, "seconds": seconds[1:], "cpu_s": cpu_s[1:], "digest": digest,
            "peak_rss_bytes": peak_rss_bytes()}


def worker_main(argv: Sequence[str] | None = None) -> int:
    """`python -m neuronode.bench.sync {node,gloo} ...`: one worker; writes {kind}-{index}.json."""
    parser = argparse.ArgumentParser(prog="python -m neuronode.bench.sync")
    parser.add_argument("kind", choices=("node", "gloo", "floor"))
    parser.add_argument("--dir", required=True, type=Path)
    parser.add_argument("--index", required=True, type=int)
    parser.add_argument("--config", required=True, help="SyncBenchConfig as JSON")
    parser.add_argument("--port", type=int, default=0, help="gloo rendezvous port")
    parser.add_argument("--ports", default="", help="floor workers' ports, comma-separated")
    parser.add_argument("--bytes-per-peer", type=int, default=0, help="floor: bytes to each peer a round")
    opts = parser.parse_args(argv)
    from neuronode.memory import keep_freed_buffers

    keep_freed_buffers()  # as the daemon does (node and gloo workers alike), before any thread
    exit_with_parent()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch

    torch.set_num_threads(1)
    cfg = SyncBenchConfig(**json.loads(opts.config))
    if opts.kind == "node":
        from neuronode.daemon import run_async

        worker = NodeWorker(cfg, workdir=opts.dir, index=opts.index)
        result = run_async(worker.run)
    elif opts.kind == "floor":
        from neuronode.bench.floor import floor_worker
        from neuronode.daemon import run_async

        result = run_async(lambda: floor_worker(
            workdir=opts.dir, index=opts.index, ports=[int(p) for p in opts.ports.split(",")],
            bytes_per_peer=opts.bytes_per_peer, chunk_bytes=cfg.chunk_bytes, rounds=cfg.rounds,
            round_timeout_s=cfg.round_timeout_s))
    else:
        result = gloo_worker(cfg, index=opts.index, port=opts.port)
    write_atomic(opts.dir / f"{opts.kind}-{opts.index}.json", json.dumps(result))
    return 0


if __name__ == "__main__":
    code = worker_main()
    # The node is stopped and the result written; skip interpreter teardown (torch, grpc), which
    # took 1-3 s per worker on 2 busy cores and would only lengthen the benchmark.
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)
