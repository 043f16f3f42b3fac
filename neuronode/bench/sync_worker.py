"""The workers of `neuronode bench sync` (`python -m neuronode.bench.sync_worker {node,gloo,floor}`).

A node worker is a SwarmNode plus the averaging protocol a node runs (neuronode.averaging:
AllToAll or ReduceScatter) with a node's encoder and error feedback, averaging the same random
pseudo-gradient every round: no second implementation of either protocol. neuronode.bench.sync
(the parent) says how rounds are timed and what the JSON keys mean.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import resource
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from neuronode.bench.sync import START_TIMEOUT_S, SyncBenchConfig
from neuronode.memory import keep_freed_buffers

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
POLL_S = 0.005


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
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen) * 1e-3  # (P,) float32, a pseudo-gradient's scale


def digest_of(t: torch.Tensor) -> str:
    """BLAKE3 of a float32 vector's bytes, read in place (no copy)."""
    import blake3

    return blake3.blake3(memoryview(t.contiguous().numpy()).cast("B")).hexdigest()  # type: ignore[arg-type]


class PoolClock:
    """The CPU seconds the threads of one pool have used: each thread registers itself as the
    pool starts it (the pool's initializer), and its own clock is read from any thread."""

    def __init__(self) -> None:
        self.threads: list[int] = []

    def register(self) -> None:
        self.threads.append(threading.get_ident())

    def seconds(self) -> float:
        return sum(time.clock_gettime(time.pthread_getcpuclockid(t)) for t in self.threads)


@dataclass(frozen=True)
class Usage:
    """A node's cumulative counters at one barrier."""

    bytes_sent: int
    cpu_s: float
    page_faults: int
    encode_cpu_s: float = 0.0  # the encoder thread's (encoding, error feedback)
    codec_cpu_s: float = 0.0  # the two codec threads' (taking in chunks, averaging)

    @classmethod
    def now(cls, bytes_sent: int, encode: PoolClock, codec: PoolClock) -> Usage:
        return cls(bytes_sent, time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
                   encode.seconds(), codec.seconds())


def used_between(before: Usage, after: Usage) -> dict[str, Any]:
    """Bytes sent (message framing included), CPU seconds (all, the encoder's, the codec
    threads') and minor page faults between two barriers."""
    return {"bytes_sent": after.bytes_sent - before.bytes_sent, "cpu_s": after.cpu_s - before.cpu_s,
            "page_faults": after.page_faults - before.page_faults,
            "encode_cpu_s": after.encode_cpu_s - before.encode_cpu_s,
            "decode_cpu_s": after.codec_cpu_s - before.codec_cpu_s}


class NodeWorker:
    """One benchmark node: a SwarmNode, the averaging protocol and the round loop."""

    def __init__(self, cfg: SyncBenchConfig, *, workdir: Path, index: int) -> None:
        self.cfg = cfg
        self.workdir = workdir
        self.index = index
        self.node_id = f"bench-{index}"
        self.delta = pseudo_gradient(cfg.params, seed=1000 + index)
        # As in a node: one thread for the encoder, two for the swarm's chunk decoding and averaging.
        self.encode_clock, self.codec_clock = PoolClock(), PoolClock()
        self.encode_pool = ThreadPoolExecutor(1, thread_name_prefix="encode", initializer=self.encode_clock.register)
        self.codec_pool = ThreadPoolExecutor(2, thread_name_prefix="codec", initializer=self.codec_clock.register)
        self.hash_pool = ThreadPoolExecutor(1, thread_name_prefix="hash")

    async def run(self) -> dict[str, Any]:
        from neuronode.security.auth import load_secret
        from neuronode.swarm.guard.proofs import Security
        from neuronode.swarm.node import SwarmConfig, SwarmNode

        deadline = time.monotonic() + START_TIMEOUT_S
        peers: tuple[str, ...] = ()
        if self.index > 0:
            first = self.workdir / "address-0"
            await wait_until("worker 0's address", first.exists, deadline=deadline)
            peers = (first.read_text().strip(),)
        secret = load_secret(self.cfg.secret_file) if self.cfg.secret_file else b""
        node = SwarmNode(SwarmConfig(
            node_id=self.node_id, swarm_id="bench", manifest_hash=f"bench-{self.cfg.params}",
            n_elements=self.cfg.params, listen="127.0.0.1:0", advertise="", peers=peers,
            sync_timeout_s=self.cfg.round_timeout_s, min_contributors=self.cfg.nodes, heartbeat_s=HEARTBEAT_S,
            settings=self.settings(), max_upload_mbps=self.cfg.max_upload_mbps,
        ), executor=self.codec_pool, security=Security(node_id=self.node_id, swarm_id="bench", secret=secret))
        address = await node.start()
        try:
            write_atomic(self.workdir / f"address-{self.index}", address)
            rounds = await self.rounds(node, self.averaging(node), start_deadline=deadline)
        finally:
            await node.drain(timeout_s=5.0)
            await node.stop(grace_s=1.0)
            for pool in (self.encode_pool, self.codec_pool, self.hash_pool):
                pool.shutdown(wait=True)
        return {"index": self.index, "address": address, "rounds": rounds, "peak_rss_bytes": peak_rss_bytes(),
                **self.codec_reference()}

    def settings(self) -> Any:
        from neuronode.swarm.context import Settings

        cfg = self.cfg
        return Settings(codec=cfg.codec, averaging=cfg.averaging, sparse_k=cfg.sparse_k, sparse_bits=cfg.sparse_bits,
                        sparse_block=cfg.sparse_block, sparse_decay=cfg.sparse_decay)

    def codec_reference(self) -> dict[str, float]:
        """CPU seconds (this thread's) to encode and decode our vector once with the run's codec
        and with int8, measured here after the rounds: a ratio under the same load."""
        from neuronode.codec import get_codec

        out = {}
        for key, spec in (("codec_cpu_s", self.settings().codec_spec), ("int8_codec_cpu_s", "int8")):
            codec, decoded = get_codec(spec), torch.empty_like(self.delta)
            started = time.thread_time()
            codec.decode_into(codec.encode(self.delta), self.delta.numel(), decoded)
            out[key] = time.thread_time() - started
        return out

    def averaging(self, node: Any) -> Any:
        from neuronode.averaging import PROTOCOLS, AveragingConfig
        from neuronode.codec import ContributionEncoder, EncoderConfig
        from neuronode.diloco import average

        cfg, settings = self.cfg, self.settings()
        encoder = ContributionEncoder(EncoderConfig(codec=settings.codec_spec, chunk_bytes=cfg.chunk_bytes,
                                                    zstd_level=cfg.zstd_level, byte_shuffle=cfg.byte_shuffle,
                                                    capped=cfg.max_upload_mbps > 0,
                                                    feedback_decay=settings.sparse_decay or 1.0),
                                      n_elements=cfg.params, sender_id=self.node_id)
        return PROTOCOLS[cfg.averaging](
            AveragingConfig(node_id=self.node_id, codec=settings.codec_spec, n_elements=cfg.params,
                            sync_timeout_s=cfg.round_timeout_s, min_contributors=cfg.nodes),
            transport=node.transport, encoder=encoder, encoder_pool=self.encode_pool, aggregate=average,
            executor=self.codec_pool)

    async def rounds(self, node: Any, averaging: Any, *, start_deadline: float) -> list[dict[str, Any]]:
        """Warm-up and timed rounds; each result gets the bytes sent and the CPU time used
        between its barriers (all threads of this process, so the swarm's work is counted)."""
        total = self.cfg.warmup_rounds + self.cfg.rounds
        results: list[dict[str, Any]] = []
        usage: list[Usage] = []
        deadline = start_deadline
        unhashed: torch.Tensor | None = None  # the last round's average
        for round_id in range(total + 1):
            await self.barrier(node, round_id, deadline=deadline)
            usage.append(self.usage(node))
            if unhashed is not None:
                # After the barrier: every worker is done with that round, so hashing steals no
                # CPU from a slower worker's timed work (and its CPU time is not counted).
                results[-1]["digest"] = await asyncio.get_running_loop().run_in_executor(
                    self.hash_pool, digest_of, unhashed)
                usage[-1] = self.usage(node)
                unhashed = None
            if round_id < total:
                deadline = time.monotonic() + self.cfg.round_timeout_s
                result, unhashed = await self.one_round(node, averaging, round_id, deadline=deadline)
                results.append(result)
        for result, before, after in zip(results, usage, usage[1:], strict=False):
            result.update(used_between(before, after))
        return results

    def usage(self, node: Any) -> Usage:
        return Usage.now(node.counters.bytes_sent, self.encode_clock, self.codec_clock)

    async def barrier(self, node: Any, round_id: int, *, deadline: float) -> None:
        """Every peer at `round_id` in our table (so we push to and wait for all of them), then
        every worker says so (so rounds start together)."""
        others = self.cfg.nodes - 1
        await wait_until(f"{others} peers at round {round_id}",
                         lambda: sum(p.round >= round_id for p in node.table.alive()) >= others, deadline=deadline)
        (self.workdir / f"barrier-{round_id}-{self.index}").touch()
        names = [self.workdir / f"barrier-{round_id}-{i}" for i in range(self.cfg.nodes)]
        await wait_until(f"all workers at the round {round_id} barrier",
                         lambda: all(n.exists() for n in names), deadline=deadline)

    async def one_round(self, node: Any, averaging: Any, round_id: int, *,
                        deadline: float) -> tuple[dict[str, Any], torch.Tensor]:
        """Average one round and tell the peers; returns the result and the average, which
        `rounds` hashes after the next barrier (untimed)."""
        from neuronode.codec import Phase

        prepared = await averaging.prepare(round_id, self.delta, base_digest="", weight=1.0)
        try:
            avg = await asyncio.wait_for(averaging.exchange(prepared), deadline - time.monotonic())
        except TimeoutError:
            rounds = {p.node_id: p.round for p in node.table.alive()}
            raise TimeoutError(f"round {round_id}: exchange timed out; live peers at rounds {rounds}") from None
        node.state.completed(round_id, f"round-{round_id}")  # the bench compares digests itself
        payload = sum(c.frame_bytes for c in avg.sent if c.phase != Phase.AVERAGED)
        return {"round_id": round_id, "encode_s": avg.encode_s, "exchange_s": avg.exchange_s,
                "decode_average_s": avg.average_s, "seconds": avg.encode_s + avg.exchange_s + avg.average_s,
                "contributors": avg.fewest, "digest": "", "payload_bytes": payload,
                "zstd_levels": sorted({c.zstd_level for c in avg.sent}),
                "shuffled": all(c.shuffled for c in avg.sent)}, avg.vector


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
    """One worker; writes {kind}-{index}.json into --dir."""
    parser = argparse.ArgumentParser(prog="python -m neuronode.bench.sync_worker")
    parser.add_argument("kind", choices=("node", "gloo", "floor"))
    parser.add_argument("--dir", required=True, type=Path)
    parser.add_argument("--index", required=True, type=int)
    parser.add_argument("--config", required=True, help="SyncBenchConfig as JSON")
    parser.add_argument("--port", type=int, default=0, help="gloo rendezvous port")
    parser.add_argument("--ports", default="", help="floor workers' ports, comma-separated")
    parser.add_argument("--bytes-per-peer", type=int, default=0, help="floor: bytes to each peer a round")
    opts = parser.parse_args(argv)
    keep_freed_buffers()  # as a node does (node and gloo workers alike), before any thread
    exit_with_parent()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    cfg = SyncBenchConfig(**json.loads(opts.config))
    if opts.kind == "node":
        result = run_loop(NodeWorker(cfg, workdir=opts.dir, index=opts.index).run)
    elif opts.kind == "floor":
        from neuronode.bench.floor import floor_worker

        result = run_loop(lambda: floor_worker(
            workdir=opts.dir, index=opts.index, ports=[int(p) for p in opts.ports.split(",")],
            bytes_per_peer=opts.bytes_per_peer, chunk_bytes=cfg.chunk_bytes, rounds=cfg.rounds,
            round_timeout_s=cfg.round_timeout_s))
    else:
        result = gloo_worker(cfg, index=opts.index, port=opts.port)
    write_atomic(opts.dir / f"{opts.kind}-{opts.index}.json", json.dumps(result))
    return 0


def run_loop(main: Callable[[], Any]) -> Any:
    """Run `main` on uvloop where it is installed, as a node does."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())


if __name__ == "__main__":
    code = worker_main()
    # The node is stopped and the result written; skip interpreter teardown (torch, grpc), which
    # took 1-3 s per worker on 2 busy cores and would only lengthen the benchmark.
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)
