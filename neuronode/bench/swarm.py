"""`neuronode bench swarm`: what one member of an N-member swarm costs per round (memory, control
messages, CPU), with all N members in this one process.

Why one process: a swarm of hundreds of `neuronode start` processes does not fit a development
machine, yet what grows with N (receipts, deliveries, the agreement rule) is all in the averaging
objects. So each member here is what a node runs, minus the network and the model: a RoundState,
a RoundBook and a LocalTransport of one `neuronode.averaging.local.LocalSwarm` (members hand each
other their records; under gather they forward them down each maker's tree), and the protocol
object (AllToAll, ReduceScatter or Gather) with its own ContributionEncoder (with --codec sparse
the daemon's default --sparse-* settings and error feedback), averaging with the real
`neuronode.diloco.average`. All members share one encoder thread and one codec/aggregate
executor (a node has one of each; hundreds of threads would measure the scheduler). zstd is off:
no frame leaves the process.

Stand-in training: member i's pseudo-gradient of round r is a seeded random vector of P float32
(seed r x N + i), so two runs with the same flags average the same numbers. Every member's inner
steps end together: all prepare, then all exchange (arrivals come in batches, so members wake
less often than in a real swarm, where they trickle in). The real Clock with a 600 s
--sync-timeout: every member delivers, so no deadline is ever reached. After every round each
member must hold the same averaged vector (bit for bit) averaging all N contributions (under
gather: the same min(N, --gather-makers) makers, the lowest tickets of the round), or the bench
fails naming the round.

JSON keys: `members`, `rounds`, `params`, `averaging`, `codec`; `seconds` (wall, building the
members included), `round_seconds` (median wall time of a round), `cpu_seconds_per_member_per_round`
(process CPU of the rounds, every thread, / members / rounds), `peak_rss_bytes` (VmHWM),
`rss_bytes_per_member` (peak RSS minus RSS before the members were built, / members),
`control_messages_per_member_per_round` (receipts: each published one counted once per other
member that may read it, plus fetches), `contributions_per_member_per_round` (records the
LocalSwarm delivered), `identical` (the check passed); `bytes_up_per_member_per_round` and
`bytes_down_per_member_per_round` (medians over members of what each sent and received, as
neuronode.averaging.local counts wire bytes: contributions delivered, forwarded or fetched with
their chunk headers, receipts with their lists whole), `bytes_up_max_per_member_per_round` and
`bytes_down_max_per_member_per_round` (the busiest member's), `control_messages_median_per_member_per_round`
(receipts received and fetches answered, median over members), `makers` (gather's K, else N).

In-process members share what a real node would copy (a delivered record shares its payload with
its sender's, a receipt is one object every member reads), so `rss_bytes_per_member` is what one
more member costs this process, less than a node's own RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import sys
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuronode.bench.common import BenchError, check, entry_points
from neuronode.config import AVERAGINGS, NodeConfig, check_averaging

if TYPE_CHECKING:
    import torch

    from neuronode.averaging import Average, Averaging, RoundState
    from neuronode.averaging.local import LocalSwarm

AVERAGING = AVERAGINGS
DEFAULT_MAKERS = NodeConfig.gather_makers
CODECS = ("fp32", "fp16", "bf16", "int8", "int4", "sparse")  # neuronode.codec.CODECS, without importing torch
SYNC_TIMEOUT_S = 600.0  # never reached: every member delivers, however slow the machine
CHUNK_BYTES = 1 << 20  # the daemon's default --chunk-bytes


@dataclass
class SimMember:
    """One member: its round state and the averaging protocol over its LocalTransport."""

    index: int
    node_id: str
    state: RoundState
    protocol: Averaging


class SimSwarm:
    """N members of one LocalSwarm, built as a node builds its averaging, sharing two pools."""

    def __init__(self, args: argparse.Namespace, encode_pool: Executor, codec_pool: Executor) -> None:
        from neuronode.averaging.local import LocalSwarm

        self.args = args
        gather = args.averaging == "gather"
        self.local: LocalSwarm = LocalSwarm(gather_makers=args.gather_makers if gather else 0)  # the real Clock
        width = len(str(args.members - 1))
        self.members = [self.join(i, f"m{i:0{width}d}", encode_pool, codec_pool) for i in range(args.members)]

    def join(self, index: int, node_id: str, encode_pool: Executor, codec_pool: Executor) -> SimMember:
        from neuronode.averaging import PROTOCOLS, AveragingConfig, RoundState
        from neuronode.codec import ContributionEncoder, EncoderConfig
        from neuronode.codec.registry import codec_spec
        from neuronode.diloco import average

        args = self.args
        state = RoundState()
        transport = self.local.join(node_id, state=state)
        sparse = args.codec == "sparse"  # the daemon's default --sparse-* settings
        spec = codec_spec(args.codec, k=NodeConfig.sparse_k, bits=NodeConfig.sparse_bits, block=NodeConfig.sparse_block)
        encoder = ContributionEncoder(EncoderConfig(codec=spec, chunk_bytes=CHUNK_BYTES, zstd_level=0, byte_shuffle=False,
                                                    feedback_decay=NodeConfig.sparse_decay if sparse else 1.0),
                                      n_elements=args.params, sender_id=node_id)
        protocol = PROTOCOLS[args.averaging](
            AveragingConfig(node_id=node_id, codec=spec, n_elements=args.params, sync_timeout_s=SYNC_TIMEOUT_S,
                            makers=args.gather_makers),
            transport=transport, encoder=encoder, encoder_pool=encode_pool, aggregate=average, executor=codec_pool)
        return SimMember(index=index, node_id=node_id, state=state, protocol=protocol)

    def pseudo_gradient(self, member: SimMember, round_id: int) -> torch.Tensor:
        """Stand-in training: a fixed-seed random vector per member and round."""
        import torch

        seed = round_id * len(self.members) + member.index
        return torch.randn(self.args.params, generator=torch.Generator().manual_seed(seed)) * 1e-3

    async def round(self, round_id: int) -> list[Average]:
        """Every member prepares its contribution of `round_id`, then every member exchanges it."""
        base = f"stand-in-{round_id}"  # the parameters every member starts the round from
        prepared = await asyncio.gather(*(
            m.protocol.prepare(round_id, self.pseudo_gradient(m, round_id), base_digest=base, weight=1.0)
            for m in self.members))
        return list(await asyncio.gather(*(m.protocol.exchange(p) for m, p in zip(self.members, prepared, strict=True))))

    def advance(self, round_id: int) -> None:
        """Every member completed `round_id`: its state moves to the next round, as the daemon's
        RoundState.completed does, without the change callbacks (each one makes every transport
        re-push its open sends; with every member moving together nobody is owed anything, and
        N of them cost O(N^3)). Receipts of earlier rounds are dropped, as a node drops old ones
        (LocalSwarm keeps them all: RSS would grow with --rounds)."""
        for m in self.members:
            m.state.round = round_id + 1
        for member in self.local.members.values():
            for key in [k for k in member.receipts if k[0] < round_id]:
                del member.receipts[key]
        for key in [k for k in self.local.published if k[0] < round_id]:
            del self.local.published[key]

    def expected(self, round_id: int) -> list[str]:
        """Who a round averages: every member, or under gather the makers of the round's draw."""
        if self.args.averaging != "gather":
            return [m.node_id for m in self.members]
        from neuronode.averaging.sortition import draw

        return sorted(draw(round_id, f"stand-in-{round_id}", [m.node_id for m in self.members],
                           self.args.gather_makers).makers)


def check_identical(round_id: int, averages: list[Average], node_ids: list[str],
                    expected: list[str] | None = None) -> None:
    """Raise a BenchError unless every member averaged the same vector of the `expected`
    contributions (all N, or gather's makers)."""
    import torch

    expected = node_ids if expected is None else expected
    first = averages[0]
    for node_id, avg in zip(node_ids, averages, strict=True):
        if avg.contributors != expected:
            raise BenchError(f"round {round_id}: {node_id} averaged {len(avg.contributors)} of "
                             f"{len(expected)} contributions (not the round's: {', '.join(expected[:8])}...)")
        if not torch.equal(avg.vector, first.vector):
            raise BenchError(f"round {round_id}: {node_id}'s averaged vector differs from {node_ids[0]}'s")


def rss_bytes(field: str) -> int:
    """VmRSS or VmHWM of this process (Linux); elsewhere the peak from getrusage."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def reset_peak_rss() -> None:
    """Start the peak (VmHWM) from the current RSS, so an earlier peak of this process (a test
    run before us) does not hide ours. Best effort: Linux only."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


async def warm_up(args: argparse.Namespace, encode_pool: Executor, codec_pool: Executor) -> None:
    """One round of a 2-member swarm first: libraries imported, pool threads started, every
    code path run once, so the RSS measured before the members are built holds all of that and
    the growth after it is the members' own."""
    await SimSwarm(argparse.Namespace(**{**vars(args), "members": 2}), encode_pool, codec_pool).round(0)


async def simulate(args: argparse.Namespace) -> dict[str, Any]:
    """Build the swarm, run the rounds, check each; the figures (no wall total)."""
    encode_pool = ThreadPoolExecutor(1, thread_name_prefix="encode")
    codec_pool = ThreadPoolExecutor(2, thread_name_prefix="codec")
    try:
        await warm_up(args, encode_pool, codec_pool)
        reset_peak_rss()
        rss_before = rss_bytes("VmRSS")
        swarm = SimSwarm(args, encode_pool, codec_pool)
        node_ids = [m.node_id for m in swarm.members]
        wall: list[float] = []
        cpu = 0.0
        for round_id in range(args.rounds):
            started, cpu_started = time.perf_counter(), time.process_time()
            averages = await swarm.round(round_id)
            wall.append(time.perf_counter() - started)
            cpu += time.process_time() - cpu_started
            check_identical(round_id, averages, node_ids, swarm.expected(round_id))
            del averages
            swarm.advance(round_id)
        peak = rss_bytes("VmHWM")
    finally:
        encode_pool.shutdown()
        codec_pool.shutdown()
    local, n, r = swarm.local, args.members, args.rounds
    members = list(local.members.values())
    delivered = sum(m.delivered for m in members)
    up, down = [m.bytes_up / r for m in members], [m.bytes_down / r for m in members]
    return {
        "members": n, "rounds": r, "params": args.params, "averaging": args.averaging, "codec": args.codec,
        "makers": min(n, args.gather_makers) if args.averaging == "gather" else n,
        "round_seconds": round(statistics.median(wall), 4),
        "cpu_seconds_per_member_per_round": round(cpu / n / r, 6),
        "bytes_up_per_member_per_round": round(statistics.median(up)),
        "bytes_down_per_member_per_round": round(statistics.median(down)),
        "bytes_up_max_per_member_per_round": round(max(up)),
        "bytes_down_max_per_member_per_round": round(max(down)),
        "peak_rss_bytes": peak, "rss_bytes_per_member": max(0, peak - rss_before) // n,
        "control_messages_per_member_per_round": round((local.receipts_delivered + local.fetches) / n / r, 3),
        "control_messages_median_per_member_per_round": statistics.median(m.messages / r for m in members),
        "contributions_per_member_per_round": round(delivered / n / r, 3),
        "identical": True,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by the `bench swarm` flags; returns the JSON object."""
    check((args.members >= 2, f"--members {args.members}: a swarm needs at least 2 members"),
          (args.rounds >= 1, f"--rounds {args.rounds}: run at least 1 round"),
          (args.params >= 1, f"--params {args.params}: at least 1"),
          (args.averaging in AVERAGING, f"--averaging {args.averaging}: choose one of {', '.join(AVERAGING)}"),
          (args.codec in CODECS, f"--codec {args.codec}: choose one of {', '.join(CODECS)}"),
          (2 <= args.gather_makers <= 256, f"--gather-makers {args.gather_makers}: between 2 and 256"))
    check_averaging(args.codec, args.averaging)
    started = time.perf_counter()
    result = asyncio.run(simulate(args))
    result["seconds"] = round(time.perf_counter() - started, 3)
    return result


def format_table(result: dict[str, Any]) -> str:
    """The figures as two columns, for a person (--json prints the object instead)."""
    rows = [
        ("members", result["members"]), ("averaging", result["averaging"]), ("codec", result["codec"]),
        ("params", result["params"]), ("rounds", result["rounds"]), ("seconds", result["seconds"]),
        ("round seconds (median)", result["round_seconds"]),
        ("makers a round", result["makers"]),
        ("CPU ms per member per round", round(1000 * result["cpu_seconds_per_member_per_round"], 3)),
        ("KiB up / member / round (median)", round(result["bytes_up_per_member_per_round"] / 1024, 1)),
        ("KiB down / member / round (median)", round(result["bytes_down_per_member_per_round"] / 1024, 1)),
        ("peak RSS MiB", round(result["peak_rss_bytes"] / 2**20, 1)),
        ("RSS KiB per member", round(result["rss_bytes_per_member"] / 1024, 1)),
        ("control messages per member per round", result["control_messages_per_member_per_round"]),
        ("contributions per member per round", result["contributions_per_member_per_round"]),
        ("identical", "yes" if result["identical"] else "no"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--members", type=int, default=200, help="members of the swarm, all in this process (default: 200)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds every member runs (default: 3)")
    parser.add_argument("--params", type=int, default=10_000,
                        help="elements of the stand-in pseudo-gradient (default: 10000)")
    parser.add_argument("--averaging", default=NodeConfig.averaging, choices=AVERAGING,
                        help="averaging scheme, as the daemon's --averaging (default: the daemon's, gather)")
    parser.add_argument("--codec", default="fp32", choices=CODECS,
                        help="wire codec (default: fp32; sparse with the daemon's default --sparse-* settings)")
    parser.add_argument("--gather-makers", type=int, default=DEFAULT_MAKERS,
                        help=f"--averaging gather: contributions a round averages at most (default: {DEFAULT_MAKERS})")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


add_parser, main = entry_points("swarm", "N members of one swarm in this process: memory, control messages and "
                                "CPU per member per round", configure, run)

if __name__ == "__main__":
    sys.exit(main(None))
