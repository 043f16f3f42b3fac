"""The swarm at a real size over home links (issues 25 and 39): a 10.8M-parameter model (bf16
contributions of 21 chunks), every uplink capped at 20 Mbit/s with tbf, 2 public members and 2
home members behind their own NAT routers (tests/netns.py), all-to-all; a fifth member (public,
as in the runs issue 39 reports) joins at round 2 (it downloads the state, 86 MB with momentum,
or applies the rounds it lacks from what the members keep); the relay p2 is killed with -9 in
the middle of round 3. Everyone still running ends --rounds 8 at round 8 with one digest; the joiner's contribution
counts in every round that starts after its state is installed (its logs and status); every
round before the kill averaged all four first members and every round after it every live
member that trained it; no log holds a traceback.

Several minutes on the 2-core development machine (five 10.8M-parameter processes), so not
part of every CI run (`make test`): `NEURONODE_REAL_SIZE=1 .venv/bin/python -m pytest -s
tests/test_real_size.py` (it prints its figures); the last run's figures are in
docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import Node, finish, poll
from netns import Net, net_fixture  # noqa: F401
from test_nat import PORT, HostNode, rounds_done

pytestmark = [
    pytest.mark.swarm, pytest.mark.timeout(1800),
    pytest.mark.skipif(not os.environ.get("NEURONODE_REAL_SIZE"), reason="five 10.8M-parameter processes on "
                       "capped links: set NEURONODE_REAL_SIZE=1 to run"),
]

UPLINK_MBIT = 20
ROUNDS = 8
ARGS = ("--d-model", "384", "--n-layers", "6", "--n-heads", "4", "--seq-len", "32", "--batch-size", "4",
        "--inner-steps", "6", "--codec", "bf16", "--sync-timeout", "150", "--swarm-id", "real", "--device", "cpu",
        "--open", "--rounds", str(ROUNDS), "--min-peers", "3", "--heartbeat-s", "2")
FIRST = ["h1", "h2", "p1", "p2"]


def installed(joiner: Node) -> tuple[int, float]:
    """The round whose start the joiner installed last (downloaded, or reached by applying
    rounds), and when."""
    got = [(e["round_id"], e["ts"]) for e in joiner.events("adopted")]
    got += [(e["round"], e["ts"]) for e in joiner.events("caught_up")]
    return max(got, key=lambda x: x[1])


def figures(nodes: dict[str, Node], joined_at: float, killed_at: float) -> dict[str, Any]:
    j = nodes["j"]
    first = min((e for e in nodes["p1"].events("round_done") if "j" in e["contributors"]), key=lambda e: e["ts"])
    downloads = j.events("state_downloaded")
    return {"joiner_first_counted_s": round(first["ts"] - joined_at, 1), "joiner_first_counted_round": first["round_id"],
            "joiner_installed": installed(j)[0], "joiner_downloads": [(e["bytes"], e["seconds"]) for e in downloads],
            "joiner_caught_up": [(e["round_id"], e["round"], e["payload_bytes"]) for e in j.events("caught_up")],
            "rounds": {r: (round(e["ts"] - killed_at, 1), e["contributors"]) for r, e in rounds_done(nodes["p1"]).items()},
            "relay_events": [(n, e["event"], e.get("round_id"), e.get("peer_id")) for n, node in nodes.items()
                             for e in node.events() if e.get("event") in ("carrier_lost", "relay_failover")]}


def test_ten_million_parameters_over_capped_home_links_with_a_joiner_and_a_killed_relay(
        tmp_path: Path, net: Net) -> None:
    hosts = {"p1": net.public_host("p1"), "p2": net.public_host("p2"), "h1": net.home("h1"), "h2": net.home("h2"),
             "j": net.public_host("j")}
    for host in hosts.values():
        host.cap_upload(UPLINK_MBIT)
    bootstrap = f"{hosts['p1'].ip}:{PORT}"
    nodes = {name: HostNode(tmp_path, host, *ARGS, "--node-id", name,
                            *(("--peers", bootstrap) if name != "p1" else ()))
             for name, host in hosts.items()}
    joiner, relay = nodes["j"], nodes["p2"]
    started = time.monotonic()
    try:
        for name in FIRST:
            nodes[name].start()
        poll("p1 at round 2", lambda: max(rounds_done(nodes["p1"]), default=0) >= 2, timeout_s=900,
             context=lambda: nodes["p1"].log()[-3000:])
        joined_at = time.time()
        joiner.start()
        poll("p2 to send its round-3 contribution", lambda: any(
            e["round_id"] == 3 for e in relay.events("contribution_ready")), timeout_s=900,
             context=lambda: relay.log()[-3000:])
        killed_at = time.time()
        relay.kill()  # -9: no Leave, its sessions and relays cut mid-round
        rest = [n for name, n in nodes.items() if name != "p2"]
        finish(rest, 900)
    finally:
        for node in nodes.values():
            node.kill()
    print(json.dumps({"seconds": round(time.monotonic() - started), **figures(nodes, joined_at, killed_at)}))
    statuses = {n.name: n.status() for n in rest}
    assert all(s["round"] == ROUNDS for s in statuses.values()), statuses
    assert len({s["param_digest"] for s in statuses.values()}) == 1, statuses
    assert len({s["state_digest"] for s in statuses.values()}) == 1, statuses
    assert "j" in statuses["j"]["last_round_contributor_ids"] and "j" in statuses["p1"]["last_round_contributor_ids"]
    _, installed_at = installed(joiner)
    trained = {e["round_id"] for e in joiner.events("contribution_ready")}
    for node in rest:
        done = {e["round_id"]: e for e in node.events("round_done")}
        started_at = {r + 1: e["ts"] for r, e in rounds_done(nodes["p1"]).items()}  # round r starts as r - 1 closes
        for r, e in done.items():
            if r < 3:  # before the kill: all four first members
                assert set(FIRST) <= set(e["contributors"]), (node.name, r, e["contributors"])
            elif r > 3:  # after it: every live member that trained the round
                assert set(e["contributors"]) == {"h1", "h2", "p1"} | ({"j"} if r in trained else set()), \
                    (node.name, r, e["contributors"], sorted(trained))
            if started_at.get(r, 0.0) > installed_at:  # a round that started after the joiner installed its state
                assert "j" in e["contributors"], (node.name, r, e["contributors"])
        assert node.name == "j" or sorted(done) == list(range(ROUNDS)), (node.name, sorted(done))
    kill_round = [e for e in nodes["p1"].events("round_done") if e["round_id"] in (3, 4)]
    assert any({"h1", "h2"} <= set(e["contributors"]) for e in kill_round), kill_round  # that round or the next
    assert joiner.events("adopted") or joiner.events("caught_up"), joiner.log()[-3000:]
    for node in nodes.values():
        assert "Traceback" not in node.log(), (node.name, node.log()[-4000:])
