"""Count the neuronode modules one pseudo-gradient's round passes through on the happy path.

Three real members (SwarmNodes on 127.0.0.1, real gRPC), all-to-all, one round: each prepares
its contribution with the node's encoder (error feedback, codec, frames), exchanges it (push,
receive, collect, receipts, agreement) and averages (the aggregator). Every Python function
called meanwhile, on every thread, is recorded by module (sys.setprofile); the nodes' background
loops (heartbeats, reachability checks, sessions, the stream watch) are stopped first, so what is
left is what the round itself runs, both ends of each push included. The path's two ends, which
run in the node's training thread (node/trainer.py: `pseudo_gradient`, `apply_average`;
diloco/engine.py: the outer step) and its caller (node/rounds.py), are added as they are.
Generated code (neuronode.v1) does not count.

Usage: PYTHONPATH=. python scripts/happy_path.py   (prints JSON: count, modules)
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

ENDS = {"neuronode.node.trainer", "neuronode.node.rounds", "neuronode.diloco.engine"}
N = 50_000


async def one_round(seen: set[str]) -> None:
    import torch

    from neuronode.averaging import AllToAll, AveragingConfig
    from neuronode.codec import ContributionEncoder, EncoderConfig
    from neuronode.diloco import average
    from neuronode.swarm.context import Settings
    from neuronode.swarm.node import SwarmConfig, SwarmNode

    pool = ThreadPoolExecutor(2)
    nodes: list[Any] = []
    for name in ("a", "b", "c"):
        cfg = SwarmConfig(node_id=name, swarm_id="path", manifest_hash="a1" * 32, n_elements=N, listen="127.0.0.1:0",
                          advertise="", peers=(nodes[0].advertise,) if nodes else (), heartbeat_s=0.2,
                          sync_timeout_s=30.0, reachable="yes", settings=Settings(codec="bf16"))
        node = SwarmNode(cfg, executor=pool)
        await node.start()
        nodes.append(node)
    for _ in range(600):  # the members meet (heartbeats every 0.2 s)
        if all(len(n.table.alive()) == 2 for n in nodes):
            break
        await asyncio.sleep(0.05)
    for node in nodes:  # the background loops: not the round's path
        for prefix in ("heartbeats", "stream-watch", "reachability", "sessions"):
            for task in node.ctx.tasks.named(prefix):
                task.cancel()
    await asyncio.sleep(0.1)
    protocols = []
    for node in nodes:
        encoder = ContributionEncoder(EncoderConfig(codec="bf16", chunk_bytes=1 << 14, zstd_level=1, byte_shuffle=True),
                                      n_elements=N, sender_id=node.cfg.node_id)
        protocols.append(AllToAll(AveragingConfig(node_id=node.cfg.node_id, codec="bf16", n_elements=N,
                                                  sync_timeout_s=30.0, min_contributors=3),
                                  transport=node.transport, encoder=encoder, encoder_pool=pool, aggregate=average,
                                  executor=pool))
    deltas = [torch.randn(N, generator=torch.Generator().manual_seed(i)) for i in range(3)]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            module = frame.f_globals.get("__name__", "")
            if module.startswith("neuronode.") and not module.startswith("neuronode.v1"):
                seen.add(module)

    assert not pool._threads, "worker threads started before the profile: they would go unseen"
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        prepared = await asyncio.gather(*(p.prepare(0, d, base_digest="", weight=1.0)
                                          for p, d in zip(protocols, deltas, strict=True)))
        results = await asyncio.gather(*(p.exchange(x) for p, x in zip(protocols, prepared, strict=True)))
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    assert all(r.contributors == ["a", "b", "c"] for r in results), [r.contributors for r in results]
    for node in nodes:
        await node.stop(grace_s=0.2)
    pool.shutdown()


def main() -> None:
    seen: set[str] = set()
    asyncio.run(one_round(seen))
    modules = sorted(seen | ENDS)
    print(json.dumps({"count": len(modules), "swarm": sum(m.startswith("neuronode.swarm") for m in modules),
                      "modules": [m.removeprefix("neuronode.") for m in modules]}, indent=1))


if __name__ == "__main__":
    main()
