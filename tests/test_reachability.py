"""Reachability self-check: with --advertise set, a node asks a peer to dial it back."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import Node, free_port, poll

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]


def test_node_learns_whether_peers_can_dial_it_back(tmp_path: Path) -> None:
    small = ("--inner-steps", "5", "--batch-size", "8")
    a = Node(tmp_path, "a", *small)
    good = Node(tmp_path, "good", *small, "--peers", a.address)
    bad = Node(tmp_path, "bad", *small, "--peers", a.address)
    nodes = [a, good, bad]
    try:
        a.start()
        poll("a to serve", lambda: a.status(live=True), timeout_s=90)
        good.start("--advertise", good.address)
        # Advertise a port nobody listens on: what a volunteer behind NAT without forwarding sees.
        bad.start("--advertise", f"127.0.0.1:{free_port()}")
        poll("good to be reachable", lambda: good.status(live=True)["reachable"] == "yes", timeout_s=120)
        poll("bad's warning", lambda: bad.events("reachability"), timeout_s=120)
    finally:
        for node in nodes:
            node.kill()
    assert [e["reachable"] for e in bad.events("reachability")] == [False]
    assert "not reachable from the internet" in bad.log() and "TCP port" in bad.log()  # what a volunteer reads
    assert [e["reachable"] for e in good.events("reachability")] == [True]
