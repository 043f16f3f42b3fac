"""`neuronode bench statesync`: how long a joiner takes to download the swarm's state, against
the state's size and how many donors serve it, each donor's uplink capped (`--max-upload-mbps`,
the daemon's own limiter; 20 Mbit/s by default, a home uplink).

For every `--params` size and every `--donors` count it starts that many donors and a joiner
(real SwarmNodes: grpc.aio servers on 127.0.0.1, all in this process, no training), every donor
holding and publishing the same state (random parameters and momentum: zstd cannot shrink them),
and times the joiner's download (`SwarmNode.fetch_state`, from its first request to the
verified state). The reference is the same download from one donor, in the same run: the
figure that matters is how close k donors come to k times its rate.

JSON keys: `max_upload_mbps`, `seconds` (the whole run), and `runs`, one per (size, donors):
`params`, `state_bytes` (parameters and momentum, fp32), `donors`, `seconds`, `mb_per_s`
(state bytes over seconds, MB = 1e6 bytes), `uplink_use` (that rate over the donors' summed
caps), `speedup_vs_one_donor` (the one-donor run's seconds over these, same size),
`chunks_by_donor` and `donors_at_once` (the joiner's `state_downloaded` event).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from neuronode.bench.common import BenchError, check, entry_points

SWARM_ID = "bench-statesync"
MANIFEST = "c3" * 32
MEET_TIMEOUT_S = 60.0


def make_state(params: int) -> Any:
    import hashlib

    import torch

    from neuronode.state import GlobalState

    p = torch.randn(params, generator=torch.Generator().manual_seed(1))
    m = torch.randn(params, generator=torch.Generator().manual_seed(2))
    return GlobalState(round=5, param_digest=hashlib.sha256(p.numpy().tobytes()).hexdigest(), params=p,
                       momentum=m, inner_steps_total=500)


async def one_download(state: Any, donors: int, mbps: float, executor: ThreadPoolExecutor) -> dict[str, Any]:
    """`donors` donors of `state` (uplinks capped at `mbps`) and a joiner: the joiner's download."""
    from neuronode.state import state_digest
    from neuronode.swarm.node import SwarmConfig, SwarmNode

    n = state.params.numel()
    chunks_root = (await asyncio.get_running_loop().run_in_executor(executor, state_digest, state))[1]

    def config(node_id: str, peers: tuple[str, ...], upload: float) -> SwarmConfig:
        return SwarmConfig(node_id=node_id, swarm_id=SWARM_ID, manifest_hash=MANIFEST, n_elements=n,
                           listen="127.0.0.1:0", advertise="", peers=peers, heartbeat_s=0.5,
                           max_upload_mbps=upload, max_ids_per_host=donors + 2)

    joiner = SwarmNode(config("joiner", (), 0.0), executor=executor)
    nodes = [joiner]
    try:
        address = await joiner.start()
        for i in range(donors):
            donor = SwarmNode(config(f"donor{i}", (address,), mbps), executor=executor, state_provider=lambda: state)
            nodes.append(donor)
            await donor.start()
            donor.state.adopted(state.round, state.param_digest, chunks_root, listen=False)
        names = {f"donor{i}" for i in range(donors)}
        deadline = time.monotonic() + MEET_TIMEOUT_S
        while {p.node_id for p in joiner.table.alive() if state.round in p.digests} < names:
            if time.monotonic() > deadline:
                raise BenchError(f"the joiner did not hear all {donors} donors within {MEET_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.05)
        started = time.monotonic()
        got = await joiner.fetch_state(sorted(names))
        took = time.monotonic() - started
        if got is None:
            raise BenchError(f"the download from {donors} donors failed")
        return {"seconds": round(took, 3), **{k: joiner.fetcher.downloaded[k] for k in ("chunks_by_donor", "donors_at_once")}}
    finally:
        await asyncio.gather(*(node.stop(grace_s=0.2) for node in nodes), return_exceptions=True)


def numbers(text: str) -> list[int]:
    """A comma-separated list of counts ("1e6,10e6", "1,2,4")."""
    try:
        return [int(float(part)) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated numbers, such as 1,2,4") from None


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes, counts = args.params, args.donors
    check((all(p >= 10_000 for p in sizes), f"--params {sizes}: at least 10000 each"),
          (all(1 <= d <= 16 for d in counts), f"--donors {counts}: from 1 to 16 each"),
          (args.max_upload_mbps > 0, "--max-upload-mbps: a cap above 0 (the point of the benchmark)"))
    counts = sorted(set(counts) | {1})  # the one-donor reference
    began = time.monotonic()
    runs: list[dict[str, Any]] = []
    with ThreadPoolExecutor(2) as executor:
        for params in sizes:
            state = make_state(params)
            state_bytes = 2 * params * 4
            reference = 0.0
            for donors in counts:
                got = asyncio.run(one_download(state, donors, args.max_upload_mbps, executor))
                reference = reference or got["seconds"]
                rate = state_bytes / got["seconds"]
                runs.append({"params": params, "state_bytes": state_bytes, "donors": donors, **got,
                             "mb_per_s": round(rate / 1e6, 3),
                             "uplink_use": round(rate / (donors * args.max_upload_mbps * 1e6 / 8), 3),
                             "speedup_vs_one_donor": round(reference / got["seconds"], 3)})
    return {"max_upload_mbps": args.max_upload_mbps, "runs": runs, "seconds": round(time.monotonic() - began, 3)}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", type=numbers, default=[1_000_000, 10_000_000],
                        help="state sizes in parameters, comma-separated (default: 1e6,10e6)")
    parser.add_argument("--donors", type=numbers, default=[1, 2, 4], help="donor counts, comma-separated (default: 1,2,4)")
    parser.add_argument("--max-upload-mbps", type=float, default=20.0,
                        help="every donor's upload cap in Mbit/s, as the daemon's flag (default: 20)")
    parser.add_argument("--json", action="store_true", help="print JSON (the only output format)")


add_parser, main = entry_points("statesync", "a joiner's state download against the state size and the number of "
                                "donors, each uplink capped", configure, run)

if __name__ == "__main__":
    sys.exit(main(None))
