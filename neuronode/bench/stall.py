"""`neuronode bench stall`: what a member that stalls its contribution streams costs an honest
node's memory.

An honest node (a real SwarmNode in its own process, `neuronode.bench.stall_node`) and a member
of the same swarm (a real SwarmNode here) on 127.0.0.1. For `--rounds` rounds the member streams
a P-parameter contribution to the honest node, then the honest node closes the round (as its
deadline would). Reference: the member sends every chunk. Attack: it sends all but the last
chunk and stalls, keeping the stream open. After each round the honest node reports its RSS
(VmRSS) and `buffered_bytes`. Without the round book's limits the attack kept one decompressed
contribution a round; with them every stalled stream is cut when its round closes.

JSON keys: `rss_bytes_per_round` and `reference_rss_bytes_per_round` (the honest node after each
round, attack and reference), `peak_rss_bytes`, `reference_peak_rss_bytes`, `ratio_vs_reference`
(peak over reference peak), `rss_growth_bytes` (last round minus first, attack),
`buffered_bytes_max` (while a stream was open), `buffered_bytes_after_close` (the most left after
a round closed), `buffered_bytes_bound`, `params`, `codec`, `rounds`, `seconds`.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from neuronode.bench.common import BenchError, check, entry_points, log_tail

SWARM_ID = "bench-stall"
MANIFEST = "b" * 64


def run(args: argparse.Namespace) -> dict[str, Any]:
    check((args.rounds >= 2, f"--rounds {args.rounds}: run at least 2"),
          (args.params >= 100_000, f"--params {args.params}: at least 100000"))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="neuronode-bench-stall-") as tmp:
        log = Path(tmp) / "honest.log"
        with log.open("wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "neuronode.bench.stall_node", "--params", str(args.params),
                 "--codec", args.codec], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        try:
            reports = asyncio.run(attack(args, proc, log))
        finally:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
    return summarize(args, reports, time.monotonic() - started)


async def attack(args: argparse.Namespace, proc: subprocess.Popen[bytes], log: Any) -> dict[str, list[dict[str, int]]]:
    """The member's side: reference rounds, then stalled ones; the honest node's reports."""
    from concurrent.futures import ThreadPoolExecutor

    from neuronode.swarm.context import Settings, SwarmConfig
    from neuronode.swarm.node import SwarmNode

    assert proc.stdout is not None
    address = (await asyncio.get_running_loop().run_in_executor(None, proc.stdout.readline)).decode().strip()
    if not address:
        raise BenchError(f"the honest node did not start: {log_tail(log)}")
    pool = ThreadPoolExecutor(2)
    member = SwarmNode(SwarmConfig(node_id="member", swarm_id=SWARM_ID, manifest_hash=MANIFEST,
                                   n_elements=args.params, listen="127.0.0.1:0", advertise="",
                                   peers=(address,), heartbeat_s=0.5, sync_timeout_s=600.0,
                                   settings=Settings(codec=args.codec)), executor=pool)
    await member.start()
    try:
        deadline = time.monotonic() + 30
        while "honest" not in {p.node_id for p in member.table.alive()}:  # noqa: ASYNC110 - polling a table
            if time.monotonic() > deadline:
                raise BenchError(f"the member never met the honest node: {log_tail(log)}")
            await asyncio.sleep(0.05)
        frames = await asyncio.get_running_loop().run_in_executor(pool, contribution, member, args)
        released = asyncio.Event()  # lets the stalled request iterators end when we are done
        reports: dict[str, list[dict[str, int]]] = {}
        for mode, first in (("reference", 0), ("stall", args.rounds)):
            reports[mode] = []
            for round_id in range(first, first + args.rounds):
                push = asyncio.ensure_future(send(member, address, frames(round_id),
                                                  stall=released if mode == "stall" else None))
                reports[mode].append(await close_round(proc, round_id))
                try:
                    await asyncio.wait_for(push, timeout=30)
                except Exception:  # noqa: BLE001 - the stalled push ends ABORTED, as it should
                    pass
        released.set()
        await asyncio.sleep(0.1)
        return reports
    finally:
        await member.stop(grace_s=0.2)
        pool.shutdown()


def contribution(member: Any, args: argparse.Namespace) -> Any:
    """A function of the round id: the member's serialized chunks of one P-parameter contribution."""
    import torch

    from neuronode.codec import VectorEncoder
    from neuronode.swarm.transport import WireCache

    encoder = VectorEncoder(codec=args.codec, chunk_bytes=1 << 20, zstd_level=0, byte_shuffle=False)
    delta = torch.randn(args.params, generator=torch.Generator().manual_seed(0)) * 1e-3

    def frames(round_id: int) -> list[bytes]:
        out = encoder.encode(delta, 0.0, round_id=round_id, sender_id="member", weight=1.0)
        member.transport.sign(out)
        wire = WireCache()
        return [member.transport.serialize(out, wire, f.index, f.compressed, f.data) for f in out.frames]

    return frames


async def send(member: Any, address: str, chunks: list[bytes], *, stall: Any) -> None:
    """Stream `chunks`; with `stall` (an asyncio.Event) all but the last, then wait for it."""

    async def stream() -> Any:
        for data in chunks[:-1] if stall is not None else chunks:
            yield data
        if stall is not None:
            await stall.wait()  # the stream stays open, its last chunk never comes

    await member.ctx.channels.push_call(address)(stream(), timeout=120)


async def close_round(proc: subprocess.Popen[bytes], round_id: int) -> dict[str, int]:
    """Ask the honest node to close `round_id` once the member's stream is in; its report."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(f"{round_id}\n".encode())
    proc.stdin.flush()
    line = await asyncio.get_running_loop().run_in_executor(None, proc.stdout.readline)
    if not line:
        raise BenchError("the honest node exited during the benchmark")
    peak, after, bound, rss = (int(x) for x in line.split())
    return {"buffered_peak": peak, "buffered_after": after, "bound": bound, "rss": rss}


def summarize(args: argparse.Namespace, reports: dict[str, list[dict[str, int]]], seconds: float) -> dict[str, Any]:
    stall, ref = reports["stall"], reports["reference"]
    peak, ref_peak = max(r["rss"] for r in stall), max(r["rss"] for r in ref)
    return {
        "params": args.params, "codec": args.codec, "rounds": args.rounds, "seconds": round(seconds, 3),
        "rss_bytes_per_round": [r["rss"] for r in stall],
        "reference_rss_bytes_per_round": [r["rss"] for r in ref],
        "peak_rss_bytes": peak, "reference_peak_rss_bytes": ref_peak,
        "ratio_vs_reference": round(peak / ref_peak, 4),
        "rss_growth_bytes": stall[-1]["rss"] - stall[0]["rss"],
        "buffered_bytes_max": max(r["buffered_peak"] for r in stall + ref),
        "buffered_bytes_after_close": max(r["buffered_after"] for r in stall + ref),
        "buffered_bytes_bound": max(r["bound"] for r in stall + ref),
    }


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", type=int, default=5_000_000, help="parameters of the contribution (default: 5e6)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds of attack, and of reference (default: 10)")
    parser.add_argument("--codec", default="fp32", choices=("fp32", "fp16", "bf16", "int8", "int4"),
                        help="the swarm's --codec (default: fp32)")
    parser.add_argument("--json", action="store_true", help="print JSON (the only output format)")


add_parser, main = entry_points("stall", "an honest node's memory while a member stalls its streams",
                                configure, run)

if __name__ == "__main__":
    sys.exit(main(None))
