"""Volunteers behind NAT (issue 16), on a real network: hosts in network namespaces, home hosts
behind nftables routers that masquerade and drop every new inbound connection (tests/netns.py).
Every node listens on 0.0.0.0:7420 without --advertise: what peers dial comes from what they see.

- four public hosts learn their own addresses from each other, and are dialed there;
- two public members and one home member average all three contributions every round, the
  home member through sessions it opens (nobody can dial it), with no repair;
- a home member joining late downloads the state (or the rounds it lacks) over its own connection
  and matches.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import FORKS, NODE_DEFAULTS, Forked, Node, finish, poll, run_cli, run_to_end
from netns import Host, Net, enter_namespace, net_fixture  # noqa: F401

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]

PORT = 7420  # every host has its own port space
ARGS = ("--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "32", "--batch-size", "4",
        "--inner-steps", "4", "--sync-timeout", "20", "--swarm-id", "nat", "--device", "cpu", "--open")


def run_in(ns: str, argv: list[str], log_path: str) -> None:
    """A forked node's body: into its host's namespace first, then `neuronode ARGV`."""
    enter_namespace(ns)
    run_cli(argv, log_path)


class HostNode(Node):
    """A `neuronode start` inside a host of the test network, listening on 0.0.0.0:PORT."""

    def __init__(self, tmp: Path, host: Host, *extra: str) -> None:
        super().__init__(tmp, host.name, *extra, port=PORT)
        self.host = host
        self.address = f"{host.ip}:{PORT}"  # where peers on the network dial it (if they can)

    def start(self, *more: str) -> HostNode:
        args = ["start", "--data-dir", str(self.data_dir), "--listen", f"0.0.0.0:{PORT}", *NODE_DEFAULTS,
                *self.extra, *more]
        process = FORKS.Process(target=run_in, args=(self.host.ns, args, str(self.log_path)),
                                name=f"neuronode-{self.name}")
        process.start()
        self.proc = Forked(process)
        return self

    def status(self, *, live: bool = False) -> dict[str, Any]:
        assert not live, "the test runs outside the network: read the checkpoint"
        return super().status()


def rounds_done(node: Node) -> dict[int, dict[str, Any]]:
    return {e["round"]: e for e in node.events("round_done")}


def test_nodes_without_advertise_learn_the_address_their_peers_see(tmp_path: Path, net: Net) -> None:
    hosts = [net.public_host(name) for name in ("a", "b", "c", "d")]
    bootstrap = f"{hosts[0].ip}:{PORT}"
    # Rounds of about a second: a (no bootstrap) dials its peers only once they advertise.
    nodes = [HostNode(tmp_path, h, *ARGS, "--rounds", "5", "--inner-steps", "300", "--min-peers", "4",
                      "--node-id", h.name, *(("--peers", bootstrap) if h.name != "a" else ())) for h in hosts]
    run_to_end(nodes, 240)
    where = {h.name: f"{h.ip}:{PORT}" for h in hosts}
    statuses = {n.name: n.status() for n in nodes}
    for name, status in statuses.items():
        assert status["round"] == 5, status
        assert status["advertise"] == where[name] and status["observed_address"] == where[name].split(":")[0], status
        assert status["reachable"] == "yes", status
        # Its peers are known (and dialed) at their real addresses, never at 127.0.0.1.
        assert {p["node_id"]: p["address"] for p in status["peers"]} == {k: v for k, v in where.items() if k != name}
    assert len({s["param_digest"] for s in statuses.values()}) == 1


def test_a_home_member_behind_nat_averages_every_round_through_its_sessions(tmp_path: Path, net: Net) -> None:
    p1, p2, home = net.public_host("p1"), net.public_host("p2"), net.home("home")
    bootstrap = f"{p1.ip}:{PORT}"
    common = (*ARGS, "--rounds", "5", "--min-peers", "3")
    nodes = [HostNode(tmp_path, p1, *common, "--node-id", "p1"),
             HostNode(tmp_path, p2, *common, "--node-id", "p2", "--peers", bootstrap),
             HostNode(tmp_path, home, *common, "--node-id", "home", "--peers", bootstrap)]
    run_to_end(nodes, 240)
    statuses = {n.name: n.status() for n in nodes}
    assert all(s["round"] == 5 for s in statuses.values()), statuses
    assert len({s["param_digest"] for s in statuses.values()}) == 1, statuses
    for node in nodes:  # every round averaged all three, on every member
        done = rounds_done(node)
        assert sorted(done) == [1, 2, 3, 4, 5], node.log()[-3000:]
        assert all(e["contributors"] == ["home", "p1", "p2"] for e in done.values()), \
            (node.name, {r: e["contributors"] for r, e in done.items()})
    assert not nodes[2].events("adopted"), nodes[2].log()[-3000:]  # no repair by state transfer
    home_status = statuses["home"]
    assert home_status["reachable"] == "no" and home_status["sessions"] == ["p1", "p2"], home_status
    assert home_status["observed_address"] == home.public_ip  # its router's address: NAT
    for name in ("p1", "p2"):  # the public members were never told an address to dial home at
        assert [p["address"] for p in statuses[name]["peers"] if p["node_id"] == "home"] == [""], statuses[name]


def test_a_home_member_joining_late_downloads_the_state_over_its_own_connection(tmp_path: Path, net: Net) -> None:
    p1, p2, home = net.public_host("p1"), net.public_host("p2"), net.home("home")
    bootstrap = f"{p1.ip}:{PORT}"
    common = (*ARGS, "--rounds", "8", "--inner-steps", "400")  # rounds of about a second: time to join
    publics = [HostNode(tmp_path, p1, *common, "--node-id", "p1", "--min-peers", "2"),
               HostNode(tmp_path, p2, *common, "--node-id", "p2", "--min-peers", "2", "--peers", bootstrap)]
    late = HostNode(tmp_path, home, *common, "--node-id", "home", "--peers", bootstrap)
    nodes = [*publics, late]
    try:
        for node in publics:
            node.start()
        poll("the public members at round 2", lambda: max(rounds_done(publics[0]), default=0) >= 2, timeout_s=120)
        late.start()
        finish(nodes, 240)
    finally:
        for node in nodes:
            node.kill()
    statuses = {n.name: n.status() for n in nodes}
    assert all(s["round"] == 8 for s in statuses.values()), statuses
    assert len({s["param_digest"] for s in statuses.values()}) == 1, json.dumps(statuses)[:2000]
    # the state, or the rounds it lacks (catching up by rounds), over its own connection
    assert late.events("adopted") or late.events("caught_up"), late.log()[-3000:]
    assert statuses["home"]["reachable"] == "no" and statuses["home"]["sessions"], statuses["home"]
