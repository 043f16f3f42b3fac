"""`neuronode bench catchup`: what catching up by rounds costs a member, per codec, and how
long a joiner takes from its start to its first contribution the swarm counts.

For each codec, real `neuronode start` processes on 127.0.0.1: members a and b train (a sleep of
`--step-delay` per inner step keeps rounds long enough to follow, and holds the swarm still
while j comes back); once a finished round 2, a fresh member j starts. Measured: the seconds
from j's start to the first round a averages j's contribution in (`joiner_first_counted_s`),
and how j reached the swarm (`joiner_reached_by`: "rounds" or "state"). Then j stops (SIGTERM)
and comes back from its checkpoint once the swarm finished 3 more rounds: it applies them
itself. Measured: the bytes j received for the first k of them (`bytes_by_rounds`, k = 1, 2, 3,
from its `replayed` events), what they were (`source`: the members' averaged updates, or the
rounds' agreed contributions, whichever the members kept as fewer bytes), and the ratio to the
state a download moves (parameters and momentum in fp32: `state_bytes`).

JSON keys: `params`, `state_bytes`, `codecs` (per codec: `source`, `bytes_by_rounds`,
`ratio_vs_state`, `joiner_first_counted_s`, `joiner_reached_by`, `joiner_bytes`), `members`,
`inner_steps`, `seconds`.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from neuronode.bench.common import POLL_S, BenchError, check, entry_points, free_port, log_tail
from neuronode.bench.processes import NodeRun, start_process, stop_all
from neuronode.config import CODECS

BEHIND = 3  # rounds j comes back behind (what the members keep for catching up)
STALL_STEP_S = 2.0  # the step delay that holds the swarm still while j comes back


class Member:
    """One member of the bench: its `neuronode start` process (started again from its data dir
    when it comes back), and the JSON logs of every start."""

    def __init__(self, workdir: Path, name: str, argv: list[str]) -> None:
        self.name, self.workdir = name, workdir
        self.argv = [*argv, "--data-dir", str(workdir / name), "--node-id", name]
        self.logs: list[Path] = []
        self.proc: Any = None
        self.started = 0.0

    def start(self) -> None:
        self.logs.append(self.workdir / f"{self.name}-{len(self.logs)}.log")
        self.started = time.time()
        self.proc = start_process(self.argv, self.logs[-1])

    def events(self, name: str) -> list[dict[str, Any]]:
        return [r for log in self.logs for r in NodeRun(self.name, self.workdir / self.name, log).records()
                if r.get("event") == name]


def wait_for(what: str, predicate: Callable[[], Any], *, deadline: float, member: Member) -> Any:
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if member.proc is not None and member.proc.poll() not in (None, 0):
            raise BenchError(f"{member.name} exited with status {member.proc.poll()}: {log_tail(member.logs[-1])}")
        time.sleep(POLL_S)
    raise BenchError(f"timed out waiting for {what}: {log_tail(member.logs[-1])}")


def pace(path: Path, step_delay_s: float) -> None:
    path.write_text(json.dumps({"step_delay_s": step_delay_s}))


def one_codec(args: argparse.Namespace, codec: str, workdir: Path) -> dict[str, Any]:
    fault = workdir / "pace.json"
    pace(fault, args.step_delay)
    port_a = free_port()
    common = [sys.executable, "-m", "neuronode.cli", "start", "--codec", codec, "--rounds", "1000",
              "--inner-steps", str(args.inner_steps), "--sync-timeout", "30", "--threads", "1",
              "--heartbeat-s", "0.5", "--log-format", "json", "--fault-file", str(fault), "--min-peers", "2",
              "--d-model", str(args.d_model), "--n-layers", str(args.n_layers), "--device", "cpu"]
    a = Member(workdir, "a", [*common, "--listen", f"127.0.0.1:{port_a}"])
    b = Member(workdir, "b", [*common, "--listen", f"127.0.0.1:{free_port()}", "--peers", f"127.0.0.1:{port_a}"])
    j = Member(workdir, "j", [*common, "--listen", f"127.0.0.1:{free_port()}", "--peers", f"127.0.0.1:{port_a}"])
    deadline = time.monotonic() + args.timeout

    def a_done(round_no: int) -> bool:
        return any(e["round"] >= round_no for e in a.events("round_done"))

    try:
        a.start()
        b.start()
        wait_for("a to finish round 2", lambda: a_done(2), deadline=deadline, member=a)
        j.start()
        joined_at = j.started
        first = wait_for("a to count j's contribution", lambda: next(
            (e for e in a.events("round_done") if "j" in e["contributors"]), None), deadline=deadline, member=a)
        reached = "state" if j.events("adopted") else "rounds"
        joined_bytes = sum(e["payload_bytes"] for e in j.events("caught_up")) + sum(
            e.get("bytes", 0) for e in j.events("state_downloaded"))
        j.proc.send_signal(signal.SIGTERM)
        j.proc.wait(timeout=60)
        left = max(e["round_id"] for e in j.events("stopped"))
        wait_for(f"a to finish round {left + BEHIND}", lambda: a_done(left + BEHIND), deadline=deadline, member=a)
        pace(fault, STALL_STEP_S)
        j.start()
        wait_for("j to catch up", lambda: j.events("caught_up") and any(
            e["round_id"] == left for e in j.events("caught_up")) or j.events("adopted")[1:], deadline=deadline,
            member=j)
        pace(fault, args.step_delay)
    finally:
        stop_all([m.proc for m in (a, b, j) if m.proc is not None])
    replayed = [e for e in j.events("replayed") if e["round_id"] >= left]
    if len(replayed) < BEHIND:
        raise BenchError(f"{codec}: j replayed rounds {[e['round_id'] for e in replayed]}, not {BEHIND}: "
                         f"{log_tail(j.logs[-1])}")
    cumulative, total = [], 0
    for e in sorted(replayed, key=lambda e: e["round_id"])[:BEHIND]:
        total += int(e["payload_bytes"])
        cumulative.append(total)
    params = int(a.events("joined")[0]["n_params"])
    return {"source": sorted({e["source"] for e in replayed}), "bytes_by_rounds": cumulative,
            "ratio_vs_state": [round(b / (8 * params), 3) for b in cumulative],
            "joiner_first_counted_s": round(float(first["ts"]) - joined_at, 3), "joiner_reached_by": reached,
            "joiner_bytes": joined_bytes, "params": params}


def run(args: argparse.Namespace) -> dict[str, Any]:
    check((args.inner_steps >= 1, f"--inner-steps {args.inner_steps}: at least 1"),
          (args.step_delay > 0, f"--step-delay {args.step_delay}: more than 0"))
    started = time.monotonic()
    out: dict[str, Any] = {}
    for codec in args.codecs:
        with tempfile.TemporaryDirectory(prefix=f"neuronode-bench-catchup-{codec}-") as tmp:
            out[codec] = one_codec(args, codec, Path(tmp))
    params = next(iter(out.values()))["params"]
    return {"params": params, "state_bytes": 8 * params, "codecs": {c: {k: v for k, v in r.items() if k != "params"}
                                                                   for c, r in out.items()},
            "members": 2, "inner_steps": args.inner_steps, "seconds": round(time.monotonic() - started, 1)}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--codecs", nargs="+", default=["fp32", "bf16", "int8", "sparse"], choices=CODECS,
                        help="codecs to run, one swarm each (default: fp32 bf16 int8 sparse)")
    parser.add_argument("--d-model", type=int, default=256, help="--d-model of the members (default: 256)")
    parser.add_argument("--n-layers", type=int, default=4, help="--n-layers of the members (default: 4)")
    parser.add_argument("--inner-steps", type=int, default=10, help="inner steps per round (default: 10)")
    parser.add_argument("--step-delay", type=float, default=0.05,
                        help="seconds every member sleeps per inner step, so rounds can be followed (default: 0.05)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per codec before failing (default: 600)")
    parser.add_argument("--json", action="store_true", help="print JSON (the only output format)")


add_parser, main = entry_points(
    "catchup", "bytes a member catching up k rounds fetches per codec; a joiner's time to its first counted round",
    configure, run)

if __name__ == "__main__":
    sys.exit(main(None))
