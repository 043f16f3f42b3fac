"""A node that every bootstrap peer refuses (another model size) stops with the refusal: exit 2
within 30 s, the setting and both values named, no round trained alone, no firewall hint; the
node that refused it goes on as if it had never called."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers import Node, poll, stop

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]

SMALL = ("--n-layers", "1", "--n-heads", "2", "--seq-len", "32", "--batch-size", "4", "--inner-steps", "20")


def test_a_joiner_of_another_size_exits_2_naming_the_setting_and_the_first_node_is_unaffected(tmp_path: Path) -> None:
    a = Node(tmp_path, "a", *SMALL, "--d-model", "32", "--node-id", "a")  # until stopped
    b = Node(tmp_path, "b", *SMALL, "--d-model", "64", "--rounds", "3", "--node-id", "b", "--peers", a.address)
    try:
        a.start()
        poll("a to serve", lambda: a.status(live=True), timeout_s=120, context=lambda: a.log()[-3000:])
        started = time.monotonic()
        b.start()
        assert b.wait(30) == 2, b.log()[-3000:]
        assert time.monotonic() - started < 30
        stop(a, within_s=60)
    finally:
        for node in (a, b):
            node.kill()
    last = b.log().strip().splitlines()[-1]
    assert last.startswith("neuronode: every bootstrap peer refused this node"), last
    assert "--d-model 64" in last and "--d-model 32" in last, last
    refused = b.events("refused_by")
    assert refused and all(e["code"] == "FAILED_PRECONDITION" for e in refused), b.log()[-3000:]
    assert not b.events("round_done") and not b.events("joined"), b.log()[-3000:]
    assert not list((b.data_dir / "checkpoints").glob("*.ckpt"))
    assert not b.events("bootstrap_unanswered"), b.log()[-3000:]  # the firewall hint is for silence
    # a trained alone, as ever: b never became its peer.
    assert a.events("round_done"), a.log()[-3000:]
    assert all(e["contributors"] == ["a"] for e in a.events("round_done"))
    assert not a.events("peer_joined")
