"""`neuronode bench utilization`: the share of wall time a node spends in inner steps, with two
(or `--nodes`) local `neuronode start` processes on the built-in task, with or without
`--overlap` and `--max-upload-mbps`.

The swarm is the one of `neuronode bench quality` (fixed node ids and seed, `--min-peers N`, one
torch thread each, JSON logs); see `neuronode.bench.quality`.

Definition. A node's round cycle runs from one `round k: contribution ready` log line to the next
(`k + 1`). Each such cycle holds exactly one round of inner steps and one of everything else
(encoding, waiting for the exchange, averaging and the outer step, validation, the checkpoint
write), with or without --overlap: without it, the line comes after the round's training and
encoding; with it, after the previous round was applied, just as the next round's training
starts. The timed window is from `ready 0` to `ready R-1`, i.e. rounds 1 .. R-1: the first round
(process start, first contact, compiling) and, with --overlap, the final flush of the last
round's sync are left out. Time in inner steps comes from the daemon's own throughput figure,
`tokens_per_s` (tokens of the round / time from its first to its last step), which every
checkpoint records for the round trained last (which one: its `inner_steps` / H), hence
`--keep-checkpoints R+1`:

    train_s(k)  = H × batch_size × seq_len / tokens_per_s(k)
    utilization = Σ_{k=1..R-1} train_s(k) / (ts(ready R-1) − ts(ready 0))

per node; `utilization` is the mean over nodes (`utilization_per_node` lists them). Timestamps
are those of the JSON log lines (ms). `round_seconds`, `train_seconds` and `other_seconds` are
medians over nodes and timed rounds of the cycle, its inner steps, and the rest (the overhead a
node pays per round); `sync_seconds` and `waited_seconds` are medians of the `round N done`
line's figures (`waited`: from the training thread asking for the round's result to the log
line, i.e. waiting plus averaging, outer step, validation and checkpoint).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from neuronode.bench.common import BenchError, check, entry_points
from neuronode.bench.processes import NodeRun
from neuronode.bench.quality import (
    READY,
    ModelFlags,
    SwarmSpec,
    add_swarm_arguments,
    check_finished,
    device_flags,
    rounds_done,
    run_swarm,
    settings_flags,
)


def spec_from_args(args: argparse.Namespace) -> SwarmSpec:
    check((args.nodes >= 2, f"--nodes {args.nodes}: a swarm needs at least 2 nodes"),
          (args.rounds >= 2, f"--rounds {args.rounds}: the first round is not timed; run at least 2"),
          (args.max_upload_mbps >= 0, f"--max-upload-mbps {args.max_upload_mbps}: must be >= 0 (0: no cap)"))
    extra = [*device_flags(args), *settings_flags(args)]
    if args.max_upload_mbps:
        extra += ["--max-upload-mbps", str(args.max_upload_mbps)]
    return SwarmSpec(nodes=args.nodes, rounds=args.rounds, inner_steps=args.inner_steps,
                     codec=args.codec, overlap=args.overlap, seed=args.seed,
                     model=ModelFlags.from_args(args), extra=tuple(extra), timeout_s=args.timeout)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by the `bench utilization` flags; returns the JSON object."""
    spec = spec_from_args(args)
    with tempfile.TemporaryDirectory(prefix="neuronode-bench-utilization-") as tmp:
        runs, seconds = run_swarm(spec, Path(tmp))
        statuses = [node.status() for node in runs]
        check_finished(spec, runs, statuses)
        per_node = [node_timings(spec, node) for node in runs]
    result = summarize(spec, per_node)
    result.update(seconds=round(seconds, 3), max_upload_mbps=args.max_upload_mbps)
    return result


def node_timings(spec: SwarmSpec, node: NodeRun) -> dict[str, Any]:
    """One node's timed rounds: cycle and training seconds per round, and its utilization."""
    events = node.events()
    ready: dict[int, float] = {}
    for ts, msg in events:
        match = READY.search(msg)
        if match:
            ready.setdefault(int(match.group(1)), ts)
    timed = range(1, spec.rounds)
    if any(k not in ready for k in (0, *timed)):
        raise BenchError(f"node {node.node_id}: 'contribution ready' lines missing for rounds "
                         f"{sorted(set(range(spec.rounds)) - set(ready))} (did it catch up from a peer?)")
    train = train_seconds(spec, node)
    if any(k not in train for k in timed):
        raise BenchError(f"node {node.node_id}: no checkpoint records the throughput of rounds "
                         f"{sorted(set(timed) - set(train))}")
    cycles = [ready[k] - ready[k - 1] for k in timed]
    trains = [train[k] for k in timed]
    done = rounds_done(events)[1:]  # the first round closes at startup
    return {"utilization": sum(trains) / (ready[spec.rounds - 1] - ready[0]), "cycles": cycles,
            "trains": trains, "sync": [r["sync_s"] for r in done], "waited": [r["waited_s"] for r in done]}


def train_seconds(spec: SwarmSpec, node: NodeRun) -> dict[int, float]:
    """Seconds of inner steps per trained round (0-based), from the checkpoints' metadata."""
    from neuronode.node import checkpoint  # imports torch: only once the nodes are done

    tokens_per_round = spec.inner_steps * spec.model.tokens_per_step()
    out: dict[int, float] = {}
    for path in checkpoint.list_checkpoints(node.data_dir):
        meta, _ = checkpoint.decode(path.read_bytes(), name=str(path), meta_only=True)
        trained = round(meta.get("inner_steps", 0) / spec.inner_steps) - 1
        if trained >= 0 and meta.get("tokens_per_s"):
            out[trained] = tokens_per_round / float(meta["tokens_per_s"])
    return out


def summarize(spec: SwarmSpec, per_node: list[dict[str, Any]]) -> dict[str, Any]:
    def median(key: str) -> float:
        values = [v for node in per_node for v in node[key]]
        return round(statistics.median(values), 4) if values else 0.0

    others = [c - t for node in per_node for c, t in zip(node["cycles"], node["trains"], strict=True)]
    return {
        "utilization": round(statistics.fmean(n["utilization"] for n in per_node), 4),
        "utilization_per_node": [round(n["utilization"], 4) for n in per_node],
        "round_seconds": median("cycles"), "train_seconds": median("trains"),
        "other_seconds": round(statistics.median(others), 4),
        "sync_seconds": median("sync"), "waited_seconds": median("waited"),
        "step_seconds": round(median("trains") / spec.inner_steps, 4),
        "inner_steps": spec.inner_steps, "overlap": spec.overlap, "rounds": spec.rounds,
        "timed_rounds": spec.rounds - 1, "nodes": spec.nodes, "codec": spec.codec,
    }


# ---- command line ---------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    add_swarm_arguments(parser, inner_steps=50, rounds=4)
    parser.add_argument("--max-upload-mbps", type=float, default=0.0,
                        help="upload cap of every node in Mbit/s (default: 0, none)")


add_parser, main = entry_points(
    "utilization", "share of wall time in inner steps (with/without --overlap, upload cap)", configure, run)

if __name__ == "__main__":
    sys.exit(main(None))
