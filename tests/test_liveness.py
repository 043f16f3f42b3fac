"""Liveness and redial backoff under a ManualClock: who counts as alive, when a peer is redialed,
when a gossiped address that never answers is forgotten. No sockets, no sleeping."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from helpers import swarm_config

from neuronode.averaging import RoundState
from neuronode.clock import ManualClock
from neuronode.swarm.context import Context
from neuronode.swarm.guard.proofs import Security
from neuronode.swarm.links import Links
from neuronode.swarm.membership.peers import Peers
from neuronode.swarm.membership.table import (
    MIN_FANOUT,
    PeerTable,
    fanout,
    heartbeat_targets,
    rotation,
    round_peers,
)
from neuronode.swarm.receipts.receipts import Receipts

BOOTSTRAP = "127.0.0.1:7000"


def heard(table: PeerTable, node_id: str, *, round: int = 0, contributes_from: int = 0) -> None:
    table.heard_from(node_id, f"10.0.0.{len(table.peers) + 1}:7420", round=round, param_digest="",
                     digests={}, leaving=False, contributes_from=contributes_from)


def test_a_peer_is_alive_until_dead_after_s_without_news() -> None:
    clock = ManualClock()
    table = PeerTable(self_id="me", dead_after_s=6.0, clock=clock)
    heard(table, "a")
    clock.advance(5.99)
    assert [p.node_id for p in table.alive()] == ["a"]
    clock.advance(0.01)
    assert table.alive() == []
    heard(table, "a")  # back
    assert [p.node_id for p in table.alive()] == ["a"]
    table.mark_left("a")
    assert table.alive() == []


def test_round_peers_are_live_in_reach_of_the_round_and_contributing() -> None:
    table = PeerTable(self_id="me", dead_after_s=6.0, clock=ManualClock())
    heard(table, "behind", round=3)
    heard(table, "lagging", round=4)
    heard(table, "same", round=5)
    heard(table, "ahead", round=6)
    heard(table, "far-ahead", round=7)
    heard(table, "listener", round=5, contributes_from=6)
    assert round_peers(table, 5, round_lag=1) == {"lagging", "same", "ahead"}
    assert round_peers(table, 5, round_lag=2) == {"behind", "lagging", "same", "ahead"}  # --overlap


@pytest.mark.parametrize("n_peers", [12, 200, 1000])
def test_sampled_heartbeats_greet_log_n_peers_and_keep_every_live_one_alive(n_peers: int) -> None:
    """Each heartbeat greets `fanout(N)` live peers (everyone up to MIN_FANOUT), the ones heard
    from least recently; even if no peer ever greeted us first, every live one stays alive
    (each is greeted within `rotation(N)` heartbeats, inside the scaled timeout), and one that
    stops answering is dead within that timeout plus one rotation."""
    clock = ManualClock()
    heartbeat_s = 2.0
    table = PeerTable(self_id="me", dead_after_s=3 * heartbeat_s, clock=clock)
    for n in range(n_peers):
        heard(table, f"p{n:04d}")
    k = min(fanout(n_peers), n_peers)
    assert (k < n_peers) == (n_peers > MIN_FANOUT) and k <= max(MIN_FANOUT, 2 * n_peers.bit_length())  # O(log N)
    crashed = "p0003"
    last_greeted = {node_id: 0 for node_id in table.peers}
    beats = 3 * rotation(n_peers) + 2
    for beat in range(1, beats + 1):
        clock.advance(heartbeat_s * 1.2)  # the longest jittered interval
        targets = heartbeat_targets(table)
        live = {p.address: p.node_id for p in table.alive()}
        greeting = [a for a in targets if a in live]
        assert len(greeting) == min(k, len(live)), beat
        assert set(targets) - set(greeting) <= {table.peers[crashed].address}  # the dead: always tried (with backoff)
        for address in greeting:
            node_id = live[address]
            assert beat - last_greeted[node_id] <= rotation(n_peers), (beat, node_id)
            last_greeted[node_id] = beat
            if node_id != crashed or beat < 2:  # its answer is what we hear from it
                heard_again(table, node_id, address)
            else:
                table.mark_failure(address)  # as Peers.dial_failed does
        assert {p.node_id for p in table.alive()} >= set(table.peers) - {crashed}, beat
    assert crashed not in {p.node_id for p in table.alive()}


def heard_again(table: PeerTable, node_id: str, address: str) -> None:
    table.heard_from(node_id, address, round=0, param_digest="", digests={}, leaving=False)


@pytest.fixture
def peers() -> Peers:
    pool = ThreadPoolExecutor(1)
    cfg = swarm_config("me", advertise="127.0.0.1:1", peers=(BOOTSTRAP,), heartbeat_s=2.0)
    ctx = Context(cfg, security=Security(node_id="me", swarm_id=cfg.swarm_id), state=RoundState(), executor=pool,
                  clock=ManualClock())
    return Peers(ctx, links=Links(ctx, inbox=Unused()), receipts=Receipts(ctx, on_change=lambda: None),
                 on_news=lambda: None)


class Unused:
    """The inbox of a node that carries and holds no session (neuronode.swarm.links.Inbox)."""

    def our_hello(self, caller: str) -> Any:
        raise AssertionError("no session here")

    carrying = hello_answer = relayed_hello = contribution = carriers_changed = our_hello


def next_dial(peers: Peers, address: str) -> float:
    return peers._backoff[address][0] - peers.ctx.clock.now()


def test_an_unreachable_address_is_redialed_with_doubling_delays_up_to_30_s(peers: Peers) -> None:
    gossiped = "10.0.0.9:7420"
    peers.ctx.table.add_address(gossiped)
    peers._contact.set()  # joined: the bootstrap rule no longer applies
    delays = []
    for _ in range(5):
        peers.dial_failed(gossiped, refused=False)
        delays.append(peers._backoff[gossiped][1])
        assert 0.5 * delays[-1] <= next_dial(peers, gossiped) <= delays[-1]  # jittered
    assert delays == [2.0, 4.0, 8.0, 16.0, 30.0]
    assert gossiped in peers.ctx.table.addresses
    # At the cap, a gossiped address nobody alive uses is forgotten instead of redialed.
    peers.dial_failed(gossiped, refused=False)
    assert gossiped not in peers.ctx.table.addresses and gossiped not in peers._backoff


def test_a_refusing_peer_waits_up_to_5_min_and_the_bootstrap_is_knocked_on_while_joining(peers: Peers) -> None:
    delays = []
    for _ in range(3):  # not joined yet: the bootstrap may still be starting, so one heartbeat apart
        peers.dial_failed(BOOTSTRAP, refused=True)
        delays.append(peers._backoff[BOOTSTRAP][1])
    assert delays == [2.0, 2.0, 2.0]
    peers._contact.set()
    for _ in range(10):
        peers.dial_failed(BOOTSTRAP, refused=True)
    assert peers._backoff[BOOTSTRAP][1] == 300.0  # refused: another swarm or model will not change soon
    assert BOOTSTRAP in peers.ctx.table.addresses  # bootstrap peers are never forgotten


def test_echoes_of_a_receipt_go_to_fanout_peers_drawn_unpredictably(peers: Peers) -> None:
    """With N peers, our echo of a receipt goes to fanout(N) of them (all of them up to
    MIN_FANOUT): O(log N) echoes per receipt instead of N, drawn once per receipt with the
    system's randomness, so another node (a liar choosing its receipt) cannot predict it."""
    table, receipts = peers.ctx.table, peers.receipts
    for n in range(MIN_FANOUT):
        heard(table, f"p{n:04d}")
    assert receipts.echo_targets(b"h" * 32) is None  # everyone
    for n in range(MIN_FANOUT, 400):
        heard(table, f"p{n:04d}")
    k = fanout(len(table.peers))
    drawn = [receipts.echo_targets(bytes([i]) * 32) for i in range(50)]
    assert all(t is not None and len(t) == k and t <= set(table.peers) for t in drawn)
    assert len({t for t in drawn}) == 50  # a fresh draw each time, not a function of the hash alone
    reached = set().union(*(t for t in drawn if t is not None))
    assert len(reached) > 400 // 2  # spread over the table, not a fixed few
