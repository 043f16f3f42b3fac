"""hivemind's averager on `neuronode bench sync`'s work: N local processes average a P-element
float32 vector (seeded as bench sync's workers seed theirs) with hivemind's
DecentralizedAverager (butterfly all-reduce over libp2p, no compression), one group of N.

The reference for `bench sync`'s reduce-scatter (docs/benchmarks.md). hivemind is not a
dependency of neuronode: run this from a separate virtual environment that has it
(`pip install hivemind`, whose wheel carries its p2pd daemon):

    python scripts/hivemind_sync.py --nodes 4 --params 25e6 --rounds 5

Each round, every process asks to average with a trigger (so the group forms first, untimed),
waits until the group is formed, meets the others at a barrier, then triggers the all-reduce
and waits for its result: the round's time is the slowest process's, from the trigger to its
averaged vector, as bench sync times its rounds; the median over rounds is reported. One
untimed warm-up round. Prints one JSON object (`seconds`, `round_seconds`, `nodes`, `params`).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

GROUP_TIMEOUT_S = 120.0


def worker(index: int, nodes: int, params: int, rounds: int, maddrs: Any, barrier: Any, results: Any) -> None:
    import hivemind
    import torch
    from hivemind.averaging import DecentralizedAverager
    from hivemind.averaging.control import AveragingStage

    torch.set_num_threads(1)
    peers = [] if index == 0 else list(maddrs[:1])
    dht = hivemind.DHT(start=True, initial_peers=peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    if index == 0:
        maddrs.extend([str(a) for a in dht.get_visible_maddrs()])
    tensor = torch.randn(params, generator=torch.Generator().manual_seed(1000 + index)) * 1e-3
    averager = DecentralizedAverager([tensor], dht, start=True, prefix="bench", target_group_size=nodes,
                                     min_group_size=nodes, min_matchmaking_time=2.0, request_timeout=1.5)
    seconds = []
    for round_id in range(1 + rounds):
        barrier.wait()
        control = averager.step(require_trigger=True, wait=False, timeout=GROUP_TIMEOUT_S, allow_retries=False)
        deadline = time.monotonic() + GROUP_TIMEOUT_S
        while control.stage != AveragingStage.AWAITING_TRIGGER:
            if control.done() or time.monotonic() > deadline:
                raise RuntimeError(f"process {index}: no group of {nodes} in round {round_id}: {control}")
            time.sleep(0.005)
        barrier.wait()
        started = time.perf_counter()
        control.allow_allreduce()
        control.result()
        seconds.append(time.perf_counter() - started)
    averager.shutdown()
    dht.shutdown()
    results[index] = seconds[1:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--params", type=float, default=25e6)
    parser.add_argument("--rounds", type=int, default=5)
    opts = parser.parse_args(argv)
    ctx = mp.get_context("fork")  # hivemind forks its averager from each worker
    with ctx.Manager() as manager:
        maddrs, results, barrier = manager.list(), manager.dict(), ctx.Barrier(opts.nodes)
        procs = [ctx.Process(target=worker, args=(i, opts.nodes, int(opts.params), opts.rounds, maddrs, barrier, results))
                 for i in range(opts.nodes)]
        procs[0].start()
        deadline = time.monotonic() + GROUP_TIMEOUT_S
        while not maddrs:
            if not procs[0].is_alive() or time.monotonic() > deadline:
                print("process 0 did not start its DHT", file=sys.stderr)
                return 1
            time.sleep(0.05)
        for p in procs[1:]:
            p.start()
        for p in procs:
            p.join(timeout=600)
        if len(results) != opts.nodes:
            print(f"only {len(results)} of {opts.nodes} processes finished", file=sys.stderr)
            return 1
        per_round = [max(results[i][r] for i in range(opts.nodes)) for r in range(opts.rounds)]
    print(json.dumps({"nodes": opts.nodes, "params": int(opts.params), "rounds": opts.rounds,
                      "seconds": round(statistics.median(per_round), 4),
                      "round_seconds": [round(s, 4) for s in per_round]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
