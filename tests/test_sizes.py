"""What a member costs at 1M, 10M and 25M parameters (issue 25; the table in docs/benchmarks.md),
each row from one command:

    NEURONODE_SIZES=1 .venv/bin/python -m pytest -s tests/test_sizes.py -k 10M

Three public members (two at 25M: four nodes of 25M parameters peak above what the 24 GB
development machine has free) in network namespaces (tests/netns.py), every uplink capped at
20 Mbit/s with tbf, all-to-all, bf16, 3 rounds of 4 inner steps (batch 4 x 32); one more member
joins once round 1 is done and downloads the state. It prints one JSON object: `params`,
`members`; `bytes_sent_per_round_per_node` (status bytes_sent / rounds, median of the members:
(members - 1) contributions, and what it served);
`peak_rss_bytes_per_node` (VmHWM, the largest of all, the joiner's included; `peak_rss_by_node`); `round_seconds` (median wall time
between two round_done of a member, training included) and `sync_seconds` (median time a round
waited for the network); `state_transfer_seconds` and `state_bytes` (the joiner's download).
Every member must end at round 3 with one digest.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import pytest
from helpers import poll
from netns import Net, net_fixture  # noqa: F401
from test_nat import PORT, HostNode, rounds_done

pytestmark = [
    pytest.mark.swarm, pytest.mark.timeout(3600),
    pytest.mark.skipif(not os.environ.get("NEURONODE_SIZES"), reason="minutes per size: set NEURONODE_SIZES=1 to run"),
]

UPLINK_MBIT = 20
# --d-model, --n-layers (0.83M, 10.8M, 25.4M parameters), members besides the joiner
SIZES = {"1M": ("128", "4", 3), "10M": ("384", "6", 3), "25M": ("512", "8", 2)}


def peak_rss(pid: int | None) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@pytest.mark.parametrize("size", list(SIZES))
def test_size(tmp_path: Path, net: Net, size: str) -> None:
    d_model, n_layers, count = SIZES[size]
    names = [f"m{i}" for i in range(1, count + 1)]
    args = ("--d-model", d_model, "--n-layers", n_layers, "--n-heads", "4", "--seq-len", "32", "--batch-size", "4",
            "--inner-steps", "4", "--codec", "bf16", "--sync-timeout", "300", "--swarm-id", "sizes", "--device", "cpu",
            "--open", "--rounds", "3", "--min-peers", str(count), "--heartbeat-s", "2")
    hosts = {name: net.public_host(name) for name in (*names, "j")}
    for host in hosts.values():
        host.cap_upload(UPLINK_MBIT)
    bootstrap = f"{hosts['m1'].ip}:{PORT}"
    nodes = {name: HostNode(tmp_path, host, *args, "--node-id", name, *(("--peers", bootstrap) if name != "m1" else ()))
             for name, host in hosts.items()}
    members, joiner = [nodes[n] for n in names], nodes["j"]
    rss: dict[str, int] = {}

    def running() -> bool:
        for node in nodes.values():
            if node.proc is not None and node.proc.poll() is None:
                rss[node.name] = max(rss.get(node.name, 0), peak_rss(node.proc.pid))
        return all(n.proc is None or n.proc.poll() is not None for n in nodes.values())

    try:
        for node in members:
            node.start()
        poll("round 1 done", lambda: running() or max(rounds_done(members[0]), default=0) >= 1, timeout_s=1800)
        joiner.start()
        deadline = time.monotonic() + 1800
        while not running():
            assert time.monotonic() < deadline, "the swarm did not finish"
            time.sleep(1.0)
    finally:
        for node in nodes.values():
            node.kill()
    statuses = {n.name: n.status() for n in nodes.values()}
    assert all(s["round"] == 3 for s in statuses.values()), statuses
    assert len({s["param_digest"] for s in statuses.values()}) == 1, statuses
    intervals, syncs = [], []
    for node in members:
        done = sorted(rounds_done(node).values(), key=lambda e: e["round"])
        intervals += [b["ts"] - a["ts"] for a, b in zip(done, done[1:], strict=False)]
        syncs += [e["sync_s"] for e in done]
    # the joiner downloads the state, or (the swarm up to 3 rounds ahead) applies the rounds it lacks
    downloaded = next(iter(joiner.events("state_downloaded")), None) or {
        "seconds": joiner.events("caught_up")[0]["seconds"], "bytes": joiner.events("caught_up")[0]["payload_bytes"]}
    row = {
        "size": size, "params": members[0].events("joined")[0]["n_params"], "members": count,
        "uplink_mbit": UPLINK_MBIT,
        "bytes_sent_per_round_per_node": int(statistics.median(statuses[n.name]["bytes_sent"] / 3 for n in members)),
        "peak_rss_bytes_per_node": max(rss.values()),
        "round_seconds": round(statistics.median(intervals), 1), "sync_seconds": round(statistics.median(syncs), 1),
        "state_transfer_seconds": downloaded["seconds"], "state_bytes": downloaded["bytes"], "peak_rss_by_node": rss,
    }
    print(json.dumps(row))
