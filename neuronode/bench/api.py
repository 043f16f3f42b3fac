"""`neuronode bench api`: what `neuronode.Swarm.step()` adds to an inner step between rounds.

The built-in model (the bytelm task at `--d-model/--n-layers/--n-heads`, `--batch-size` x
`--seq-len` tokens a step) trains with the built-in inner step (AdamW, schedule, clipping: what
`neuronode start` runs), in one process on `--threads` torch threads, twice over, interleaved
in blocks of `--block` steps so that drift (other load, thermal) falls on both alike:

- the reference: the inner step alone;
- the API: the same inner step, then `swarm.step(samples)` of a Swarm alone (no peers) whose
  round is longer than the run, so every timed call is a step between rounds.

Reported: the median seconds of a step of each (`reference_step_s`, `api_step_s`) and their
ratio (`ratio`: the loop with step() over the loop without), and the time inside `step()`
itself, measured around each call (`step_call_us`, its mean; `step_share`: its mean over the
reference step's median). The target is `step_share <= 0.01` (`within_target`); the loop ratio
carries the run's noise (a few per cent on a loaded machine), the share does not.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

from neuronode.bench.common import check, entry_points

TARGET_SHARE = 0.01


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=60, help="inner steps timed for each loop (default: 60)")
    parser.add_argument("--block", type=int, default=5, help="steps per block; the loops alternate (default: 5)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps of each loop first (default: 5)")
    parser.add_argument("--d-model", type=int, default=128, help="model width (default: 128, neuronode start's)")
    parser.add_argument("--n-layers", type=int, default=4, help="transformer blocks (default: 4)")
    parser.add_argument("--n-heads", type=int, default=4, help="attention heads (default: 4)")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step (default: 16)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default: 128)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--json", action="store_true", help="print JSON (the only output format)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    check((args.steps >= args.block >= 1, f"--steps {args.steps} and --block {args.block}: need steps >= block >= 1"),
          (args.warmup >= 0, f"--warmup {args.warmup}: must be >= 0"))
    import torch

    import neuronode
    from neuronode.diloco.inner import InnerConfig, adamw, inner_step
    from neuronode.training import TaskConfig, create_task

    torch.set_num_threads(args.threads)
    task = create_task("bytelm", TaskConfig(seed=1, data_seed=2, batch_size=args.batch_size, seq_len=args.seq_len,
                                            d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                                            options={"corpus_mb": "1", "val_windows": "4"}))
    model, config = task.model, InnerConfig(total_steps=10_000, warmup_steps=0)
    optimizer = adamw(list(model.parameters()), config)
    model.train()
    rounds_after = 10 * (args.steps + args.warmup)  # no round during the run: steps between rounds only
    calls: list[float] = []
    with tempfile.TemporaryDirectory(prefix="neuronode-bench-api-") as data_dir:
        swarm = neuronode.Swarm(model, optimizer, data_dir=data_dir, listen="127.0.0.1:0",
                                inner_steps=rounds_after, batch_size=args.batch_size)
        step_index = 0

        def one(with_swarm: bool) -> float:
            nonlocal step_index
            started = time.perf_counter()
            inner_step(model, optimizer, config, [next(task.batches)], task.loss_fn, step=step_index)
            if with_swarm:
                before = time.perf_counter()
                swarm.step(task.samples_per_batch)
                calls.append(time.perf_counter() - before)
            step_index += 1
            return time.perf_counter() - started

        try:
            for _ in range(args.warmup):
                one(False)
                one(True)
            calls.clear()
            reference: list[float] = []
            api: list[float] = []
            for _ in range(args.steps // args.block):
                reference += [one(False) for _ in range(args.block)]
                api += [one(True) for _ in range(args.block)]
        finally:
            swarm.close(abandon=True)
    reference_s, api_s = statistics.median(reference), statistics.median(api)
    call_s = statistics.fmean(calls)
    return {"bench": "api", "steps": len(reference), "block": args.block, "threads": args.threads,
            "n_params": sum(p.numel() for p in model.parameters()),
            "reference_step_s": round(reference_s, 6), "api_step_s": round(api_s, 6),
            "ratio": round(api_s / reference_s, 4), "step_call_us": round(call_s * 1e6, 2),
            "step_call_max_us": round(max(calls) * 1e6, 2), "step_share": round(call_s / reference_s, 6),
            "target_share": TARGET_SHARE, "within_target": call_s / reference_s <= TARGET_SHARE}


add_parser, main = entry_points("api", "what neuronode.Swarm.step() adds to an inner step of the built-in model",
                                configure, run)

if __name__ == "__main__":
    raise SystemExit(main())
