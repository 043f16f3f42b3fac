"""`neuronode bench quality`: the validation loss a local swarm of real `neuronode start`
processes reaches on the built-in task (`bytelm`) after R rounds, for one codec, aggregator and
overlap setting.

The swarm: N processes on 127.0.0.1, node `bench-0` alone and the others with `--peers` naming
it, each with its own temporary data dir, one torch thread, a fixed node id (which fixes its data
stream), the same `--seed` (which fixes the initial weights) and `--min-peers N`, so every round
averages all N contributions. Two runs with the same flags, torch and Python (the stdlib source is
the corpus) give the same figures. The nodes stop by themselves after `--rounds`; the bench waits
for them with a deadline and kills whatever is left; a node also gets SIGTERM when the bench dies.

Figures (one JSON object):
- `val_loss`: mean over nodes of the final `val_loss` of `neuronode status --data-dir`. The
  replicas should be bit-identical: `replicas_identical` says whether every node's final
  `param_digest` is the same (then their val_losses are equal too).
- `val_loss_by_round`: bench-0's validation loss before training, then after each round (from
  its `round 0: val_loss ...` and `round N done: ...` log lines).
- `payload_bytes_per_param`: bytes sent per parameter, per contribution and receiver:
  `bytes_sent / (rounds × (N − 1) × P)` averaged over nodes, with P from the `node X: P
  parameters` log line. It is the codec after zstd plus framing, gRPC and heartbeat overhead.
- `contributors_min`: the fewest contributions a node averaged in a round (N: every round full).
- `opposed_left_out`: contributions the first node's aggregator left out over the run (`norm-clip`:
  members pointing against the sum of the others; 0 in an honest swarm is what one hopes for).
- `seconds`: wall time from the first node's start to the last node's exit.

The swarm machinery here (`SwarmSpec`, `run_swarm`, the log parsing; the processes in
neuronode.bench.processes) is shared with `neuronode bench utilization`.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuronode.bench.common import (
    BenchError,
    check,
    entry_points,
    free_port,
    log_tail,
    wait_all,
)
from neuronode.bench.processes import NodeRun, start_process, stop_all
from neuronode.config import AGGREGATORS, AVERAGINGS, CODECS, NodeConfig, flag_name
from neuronode.errors import ConfigError

# Swarm settings a bench may give its nodes (`neuronode start` flags of these names); the
# daemon's defaults where not given.
SETTINGS = ("outer_lr", "outer_momentum", "sparse_k", "sparse_bits", "sparse_block", "sparse_decay")
# Deadline of a whole run, generous for 2 busy cores: process start (torch import, corpus, first
# contact), per round (exchange, validation, checkpoint) and per inner step for every 2 nodes
# (the default model takes ~0.3 s a step here with one thread).
START_BUDGET_S = 180.0
ROUND_BUDGET_S = 60.0
STEP_BUDGET_S = 2.0

ROUND_DONE = re.compile(
    r"round (\d+) done: loss (\S+) val_loss (\S+) contributors (\d+) sync ([\d.]+)s "
    r"waited ([\d.]+)s digest (\w+)")
ROUND_ZERO = re.compile(r"round 0: val_loss (\S+) before training")
PARAMETERS = re.compile(r"node \S+: (\d+) parameters")
READY = re.compile(r"round (\d+): contribution ready")


# ---- the local swarm ------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelFlags:
    """Size flags of the built-in task passed to every node; None keeps the daemon's default."""

    d_model: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    seq_len: int | None = None
    batch_size: int | None = None
    val_windows: int | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ModelFlags:
        return cls(d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                   seq_len=args.seq_len, batch_size=args.batch_size, val_windows=args.val_windows)

    def argv(self) -> list[str]:
        out: list[str] = []
        for name in ("d_model", "n_layers", "n_heads", "seq_len", "batch_size"):
            value = getattr(self, name)
            if value is not None:
                out += [f"--{name.replace('_', '-')}", str(value)]
        if self.val_windows is not None:
            out += ["--task-option", f"val_windows={self.val_windows}"]
        return out

    def tokens_per_step(self) -> int:
        defaults = NodeConfig()
        return (self.batch_size or defaults.batch_size) * (self.seq_len or defaults.seq_len)


@dataclass(frozen=True)
class SwarmSpec:
    """N `neuronode start` processes that differ only in node id, port and data dir."""

    nodes: int
    rounds: int
    inner_steps: int
    codec: str = "bf16"
    overlap: bool = False
    seed: int = 0
    model: ModelFlags = ModelFlags()
    extra: tuple[str, ...] = ()  # further `neuronode start` flags, the same on every node
    timeout_s: float = 0.0  # 0: from the sizes (see deadline_s)

    def __post_init__(self) -> None:
        check((self.nodes >= 1, f"--nodes {self.nodes}: start at least 1 node"),
              (self.rounds >= 1, f"--rounds {self.rounds}: run at least 1 round"),
              (self.inner_steps >= 1, f"--inner-steps {self.inner_steps}: must be at least 1"),
              (self.codec in CODECS, f"--codec {self.codec}: choose one of {', '.join(CODECS)}"))
        if self.timeout_s < 0:
            raise ConfigError(f"--timeout {self.timeout_s}: must be >= 0 (0: automatic)")

    @property
    def deadline_s(self) -> float:
        """Bound on the whole run; a bigger model than the default may need --timeout."""
        if self.timeout_s:
            return self.timeout_s
        steps = self.rounds * self.inner_steps * STEP_BUDGET_S * max(1.0, self.nodes / 2)
        return START_BUDGET_S + self.rounds * ROUND_BUDGET_S + steps

    def node_argv(self, index: int, *, data_dir: Path, port: int, bootstrap: str) -> list[str]:
        argv = [sys.executable, "-m", "neuronode.cli", "start", "--data-dir", str(data_dir),
                "--listen", f"127.0.0.1:{port}", "--node-id", f"bench-{index}", "--threads", "1",
                "--seed", str(self.seed), "--rounds", str(self.rounds),
                "--inner-steps", str(self.inner_steps), "--codec", self.codec,
                "--min-peers", str(self.nodes), "--keep-checkpoints", str(self.rounds + 1),
                # every node calls from 127.0.0.1: past 16 (the default) the rest would be turned away
                "--max-ids-per-host", str(max(self.nodes, NodeConfig.max_ids_per_host)),
                "--overlap" if self.overlap else "--no-overlap",
                "--log-format", "json", "--log-level", "info", *self.model.argv(), *self.extra]
        if index:
            argv += ["--peers", bootstrap]
        return argv


def run_swarm(spec: SwarmSpec, workdir: Path) -> tuple[list[NodeRun], float]:
    """Start the swarm and wait until every node exited 0 (each stops after `spec.rounds`).

    Returns the nodes and the wall time. Raises BenchError when a node fails or the deadline
    passes; no node outlives this call."""
    runs = [NodeRun(f"bench-{i}", workdir / f"bench-{i}", workdir / f"bench-{i}.log")
            for i in range(spec.nodes)]
    ports = [free_port() for _ in runs]
    procs: list[subprocess.Popen[bytes]] = []
    started = time.monotonic()
    try:
        for index, node in enumerate(runs):
            argv = spec.node_argv(index, data_dir=node.data_dir, port=ports[index],
                                  bootstrap=f"127.0.0.1:{ports[0]}")
            procs.append(start_process(argv, node.log_path))
        wait_all(procs, [f"node {r.node_id}" for r in runs], [r.log_path for r in runs],
                 deadline=started + spec.deadline_s, hint="pass a larger --timeout for big models; ")
    finally:
        stop_all(procs)
    return runs, time.monotonic() - started


def parameter_count(events: list[tuple[float, str]]) -> int:
    for _, msg in events:
        match = PARAMETERS.search(msg)
        if match:
            return int(match.group(1))
    raise BenchError("no 'node X: P parameters' line in the node's log")


def rounds_done(events: list[tuple[float, str]]) -> list[dict[str, Any]]:
    """The `round N done: ...` lines as dicts, in order."""
    out = []
    for ts, msg in events:
        match = ROUND_DONE.search(msg)
        if match:
            out.append({"ts": ts, "round": int(match.group(1)), "loss": float(match.group(2)),
                        "val_loss": float(match.group(3)), "contributors": int(match.group(4)),
                        "sync_s": float(match.group(5)), "waited_s": float(match.group(6)),
                        "digest": match.group(7)})
    return out


def check_finished(spec: SwarmSpec, runs: list[NodeRun], statuses: list[dict[str, Any]]) -> None:
    """Every node completed `rounds` rounds of exactly `inner_steps` steps each."""
    steps = spec.rounds * spec.inner_steps
    for node, status in zip(runs, statuses, strict=True):
        if status.get("round") != spec.rounds:
            raise BenchError(f"node {node.node_id} stopped at round {status.get('round')} of "
                             f"{spec.rounds}: {log_tail(node.log_path)}")
        if status.get("inner_steps") != steps:
            raise BenchError(f"node {node.node_id} took {status.get('inner_steps')} inner steps in "
                             f"{spec.rounds} rounds of {spec.inner_steps}, not {steps} (a daemon bug)")


# ---- quality --------------------------------------------------------------------------------


def spec_from_args(args: argparse.Namespace) -> SwarmSpec:
    if args.nodes < 2:
        raise ConfigError(f"--nodes {args.nodes}: a swarm needs at least 2 nodes")
    extra = [*device_flags(args), *settings_flags(args), "--aggregator", args.aggregator,
             "--averaging", args.averaging, *(["--gather-makers", str(args.gather_makers)] if args.gather_makers else [])]
    for option in args.aggregator_option or ():
        extra += ["--aggregator-option", option]
    return SwarmSpec(nodes=args.nodes, rounds=args.rounds, inner_steps=args.inner_steps,
                     codec=args.codec, overlap=args.overlap, seed=args.seed,
                     model=ModelFlags.from_args(args), extra=tuple(extra), timeout_s=args.timeout)


def device_flags(args: argparse.Namespace) -> list[str]:
    return ["--device", args.device] if args.device else []


def node_config(args: argparse.Namespace) -> NodeConfig:
    """What the nodes run of the settings a bench takes (checked here: a bad value is one line,
    not a node failing at start)."""
    given = {name: getattr(args, name) for name in SETTINGS if getattr(args, name, None) is not None}
    return NodeConfig(codec=args.codec, **given)


def settings_flags(args: argparse.Namespace) -> list[str]:
    """The settings given on the bench's command line, as the nodes' flags."""
    node_config(args)
    return [arg for name in SETTINGS if getattr(args, name, None) is not None
            for arg in (flag_name(name), str(getattr(args, name)))]


def settings_report(args: argparse.Namespace) -> dict[str, Any]:
    """The outer step's settings the nodes ran, and with --codec sparse the codec's."""
    cfg = node_config(args)
    outer_lr, outer_momentum = cfg.outer()
    sparse = {name: getattr(cfg, name) for name in SETTINGS[2:]} if args.codec == "sparse" else {}
    return {"outer_lr": outer_lr, "outer_momentum": outer_momentum, **sparse}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by the `bench quality` flags; returns the JSON object."""
    spec = spec_from_args(args)
    with tempfile.TemporaryDirectory(prefix="neuronode-bench-quality-") as tmp:
        runs, seconds = run_swarm(spec, Path(tmp))
        result = summarize(spec, runs)
    result.update(seconds=round(seconds, 3), aggregator=args.aggregator, averaging=args.averaging,
                  **settings_report(args))
    if args.averaging == "gather":
        result["gather_makers"] = args.gather_makers or NodeConfig.gather_makers
    return result


def summarize(spec: SwarmSpec, runs: list[NodeRun]) -> dict[str, Any]:
    """Fold the nodes' status and logs into the benchmark's figures (see the module docstring)."""
    statuses = [node.status() for node in runs]
    check_finished(spec, runs, statuses)
    events = [node.events() for node in runs]
    params = parameter_count(events[0])
    done = [rounds_done(ev) for ev in events]
    first = [float(m.group(1)) for _, msg in events[0] if (m := ROUND_ZERO.search(msg))]
    val_losses = [float(s["val_loss"]) if s.get("val_loss") is not None else math.nan for s in statuses]
    sent = [int(s.get("bytes_sent", 0)) for s in statuses]
    receivers = spec.rounds * (spec.nodes - 1) * params
    return {
        "val_loss": statistics.fmean(val_losses),
        "val_loss_per_node": val_losses,
        "val_loss_by_round": first[:1] + [r["val_loss"] for r in done[0]],
        "replicas_identical": len({s.get("param_digest") for s in statuses}) == 1,
        "param_digest": str(statuses[0].get("param_digest", ""))[:16],
        "contributors_min": min((r["contributors"] for rounds in done for r in rounds), default=0),
        # Contributions the aggregator left out (norm-clip: pointing against the others), on the first node.
        "opposed_left_out": sum(len(r.get("peers", ())) for r in runs[0].records() if r.get("event") == "opposed_left_out"),
        "payload_bytes_per_param": round(statistics.fmean(sent) / receivers, 4),
        "params": params, "nodes": spec.nodes, "rounds": spec.rounds, "codec": spec.codec,
        "inner_steps": spec.inner_steps, "overlap": spec.overlap, "seed": spec.seed,
    }


# ---- command line ---------------------------------------------------------------------------


def add_swarm_arguments(parser: argparse.ArgumentParser, *, inner_steps: int, rounds: int) -> None:
    """Flags both swarm benchmarks share."""
    parser.add_argument("--nodes", type=int, default=2, help="local node processes (default: 2)")
    parser.add_argument("--rounds", type=int, default=rounds, help=f"rounds every node runs (default: {rounds})")
    parser.add_argument("--inner-steps", type=int, default=inner_steps,
                        help=f"inner steps per round H (default: {inner_steps})")
    parser.add_argument("--codec", default="bf16", choices=CODECS, help="wire codec (default: bf16)")
    for name, kind in (("sparse_k", int), ("sparse_bits", int), ("sparse_block", int), ("sparse_decay", float),
                       ("outer_lr", float), ("outer_momentum", float)):
        parser.add_argument(flag_name(name), type=kind, default=None,
                            help=f"{flag_name(name)} of the nodes (default: the daemon's)")
    parser.add_argument("--overlap", action="store_true", help="sync in the background (--overlap of start)")
    parser.add_argument("--seed", type=int, default=0, help="model seed of every node (default: 0)")
    for name in ("d-model", "n-layers", "n-heads", "seq-len", "batch-size"):
        parser.add_argument(f"--{name}", type=int, default=None, help=f"--{name} of the nodes (default: the daemon's)")
    parser.add_argument("--val-windows", type=int, default=None,
                        help="bytelm validation windows (default: the task's, 16)")
    parser.add_argument("--device", default=None, help="--device of the nodes (default: the daemon's, auto)")
    parser.add_argument("--timeout", type=float, default=0.0,
                        help="seconds before the nodes are killed and the bench fails (default: 0, from the sizes)")
    parser.add_argument("--json", action="store_true", help="print JSON (the only output format)")


def configure(parser: argparse.ArgumentParser) -> None:
    add_swarm_arguments(parser, inner_steps=20, rounds=3)
    parser.add_argument("--aggregator", default="mean", choices=AGGREGATORS, help="aggregation rule (default: mean)")
    parser.add_argument("--aggregator-option", action="append", metavar="K=V",
                        help="--aggregator-option of the nodes (repeatable)")
    parser.add_argument("--averaging", default=NodeConfig.averaging, choices=AVERAGINGS,
                        help="--averaging of the nodes (default: the daemon's, gather)")
    parser.add_argument("--gather-makers", type=int, default=None,
                        help="--gather-makers of the nodes under gather (default: the daemon's)")


add_parser, main = entry_points(
    "quality", "validation loss of N local nodes after R rounds (codec, aggregator, overlap)", configure, run)

if __name__ == "__main__":
    sys.exit(main(None))
