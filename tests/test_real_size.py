"""The swarm at a real size over home links (issue 25): a 10.8M-parameter model (bf16
contributions of 21 chunks), every uplink capped at 40 Mbit/s with tbf, 2 public members and 2
home members behind their own NAT routers (tests/netns.py), all-to-all; a fifth member (at home
too) joins at round 2 and downloads the state (86 MB with momentum); the relay p2 is killed with
-9 in the middle of round 3. Everyone still running ends --rounds 5 at round 5 with one digest,
every round before the kill averaged all four first members, and no log holds a traceback.

Several minutes on the 2-core development machine (five 10.8M-parameter processes), so not
part of every CI run (`make test`): `NEURONODE_REAL_SIZE=1 .venv/bin/python -m pytest
tests/test_real_size.py`; the last run's time is in docs/benchmarks.md.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import finish, poll
from netns import Net, net_fixture  # noqa: F401
from test_nat import PORT, HostNode, rounds_done

pytestmark = [
    pytest.mark.swarm, pytest.mark.timeout(1800),
    pytest.mark.skipif(not os.environ.get("NEURONODE_REAL_SIZE"), reason="five 10.8M-parameter processes on "
                       "capped links: set NEURONODE_REAL_SIZE=1 to run"),
]

UPLINK_MBIT = 40
ARGS = ("--d-model", "384", "--n-layers", "6", "--n-heads", "4", "--seq-len", "32", "--batch-size", "4",
        "--inner-steps", "6", "--codec", "bf16", "--sync-timeout", "150", "--swarm-id", "real", "--device", "cpu",
        "--open", "--rounds", "5", "--min-peers", "3", "--heartbeat-s", "2")
FIRST = ["h1", "h2", "p1", "p2"]


def test_ten_million_parameters_over_capped_home_links_with_a_joiner_and_a_killed_relay(
        tmp_path: Path, net: Net) -> None:
    hosts = {"p1": net.public_host("p1"), "p2": net.public_host("p2"), "h1": net.home("h1"), "h2": net.home("h2"),
             "j": net.home("j")}
    for host in hosts.values():
        host.cap_upload(UPLINK_MBIT)
    bootstrap = f"{hosts['p1'].ip}:{PORT}"
    nodes = {name: HostNode(tmp_path, host, *ARGS, "--node-id", name,
                            *(("--peers", bootstrap) if name != "p1" else ()))
             for name, host in hosts.items()}
    joiner, relay = nodes["j"], nodes["p2"]
    try:
        for name in FIRST:
            nodes[name].start()
        poll("p1 at round 2", lambda: max(rounds_done(nodes["p1"]), default=0) >= 2, timeout_s=900,
             context=lambda: nodes["p1"].log()[-3000:])
        joiner.start()
        poll("p2 to send its round-3 contribution", lambda: any(
            e["round_id"] == 3 for e in relay.events("contribution_ready")), timeout_s=900,
             context=lambda: relay.log()[-3000:])
        relay.kill()  # -9: no Leave, its sessions and relays cut mid-round
        rest = [n for name, n in nodes.items() if name != "p2"]
        finish(rest, 900)
    finally:
        for node in nodes.values():
            node.kill()
    statuses = {n.name: n.status() for n in rest}
    assert all(s["round"] == 5 for s in statuses.values()), statuses
    assert len({s["param_digest"] for s in statuses.values()}) == 1, statuses
    assert len({s["state_digest"] for s in statuses.values()}) == 1, statuses
    for node in rest:
        done = rounds_done(node)
        for r in (1, 2, 3):  # rounds 0-2, before the kill
            if r in done:  # the joiner took part from round 2 on
                assert set(FIRST) <= set(done[r]["contributors"]), (node.name, r, done[r]["contributors"])
        assert node.name == "j" or sorted(done) == [1, 2, 3, 4, 5], (node.name, sorted(done))
    assert joiner.events("adopted") and joiner.events("state_downloaded"), joiner.log()[-3000:]
    for node in nodes.values():
        assert "Traceback" not in node.log(), (node.name, node.log()[-4000:])
