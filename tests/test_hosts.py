"""A host is an address the node saw (issue 37, item 1): the IP a member's connections come
from, or the IP the node connected to after resolving a name itself, never the name; an IPv6
host is its /64. Votes, --max-ids-per-host, bans and slots key on it (neuronode.quorum). A Hello
answer over a session speaks for its carrier only; reachability is asked of three hosts drawn
at random and the dial-back dials the IP it checked; members at round 0 vote in the lineage
vote. Pure rules, and real SwarmNodes on 127.0.0.1:0; the process tests in network namespaces
are tests/test_names_and_starts.py."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from helpers import Nodes, swarm_config, wait_until

from neuronode.clock import ManualClock
from neuronode.quorum import caller, host, voice
from neuronode.swarm.guard.admission import Admission
from neuronode.swarm.guard.bans import host_key
from neuronode.swarm.guard.proofs import Security
from neuronode.swarm.guard.trust import askers, witnesses
from neuronode.swarm.links.resolve import Resolver, literal
from neuronode.swarm.links.sessions import Inflow
from neuronode.swarm.membership.lineage import lineages, plan_catch_up
from neuronode.swarm.membership.table import Peer, PeerTable, TableFull
from neuronode.swarm.node import SwarmNode
from neuronode.v1 import node_pb2 as pb

pytestmark = pytest.mark.timeout(60)

N = 20_000
NET = "2001:db8:1:2"  # one /64


# ---- one definition of a host -----------------------------------------------------------------


def test_a_host_is_an_ip_and_an_ipv6_host_its_64() -> None:
    assert host("203.0.113.7") == "203.0.113.7" and host("::ffff:203.0.113.7") == "203.0.113.7"
    assert host(f"{NET}::5") == host(f"[{NET}:ffff::9]") == f"{NET}::/64" != host("2001:db8:1:3::5")
    assert host("x1.203.0.113.7.nip.io") == host("203.0.113.005") == host("LOCALHOST") == ""  # a name is no host
    # Slots key on the caller's voice: one per host, one per id on this machine's loopback.
    assert caller(f"ipv6:[{NET}::5]:4000", "a") == caller(f"ipv6:[{NET}::6]:5000", "b") == voice("c", f"{NET}::7")
    assert caller("ipv4:127.0.0.1:4000", "a") != caller("ipv4:127.0.0.1:4000", "b")
    assert caller("unix:/tmp/s", "a") == "id:a"


def test_an_ipv6_64_holding_many_ids_is_one_host_for_the_ids_per_host_cap() -> None:
    """40 live ids on 40 addresses of one /64: before, 40 hosts (the cap compared address
    strings); now 16 (--max-ids-per-host), and the next /64 is another host."""
    table = PeerTable(self_id="me", dead_after_s=5.0, clock=ManualClock())
    admitted = 0
    for n in range(40):
        try:
            table.heard_from(f"v6-{n}", f"[{NET}::{n + 1:x}]:7420", round=0, param_digest="", digests={},
                             leaving=False, host=f"{NET}::{n + 1:x}")
            admitted += 1
        except TableFull as exc:
            assert f"call from {NET}::/64" in str(exc) and "--max-ids-per-host 16" in str(exc)
    assert admitted == 16 == len(table.alive())
    assert len({p.voice for p in table.alive()}) == 1
    table.heard_from("other", "[2001:db8:1:3::1]:7420", round=0, param_digest="", digests={}, leaving=False,
                     host="2001:db8:1:3::1")
    assert "other" in table.peers


class Connection:
    """What admission reads of a call's connection: where it comes from (gRPC's peer string)."""

    def __init__(self, peer: str) -> None:
        self._peer = peer

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> tuple[()]:
        return ()

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise PermissionError(code, details)


async def test_an_ipv6_64_is_one_host_for_the_bans(executor: Any) -> None:
    """Strikes from five addresses of one /64 ban it: a sixth address of the /64 is refused,
    another /64 is not. Before, each address was a key of its own, so a caller dodged a ban by
    taking the next address."""
    node = SwarmNode(swarm_config("target", n_elements=N), executor=executor)
    admission = Admission(node.ctx)
    keys = {admission.caller_key(Connection(f"ipv6:[{NET}::{n}]:40{n}")) for n in range(1, 6)}  # type: ignore[arg-type]
    assert keys == {host_key(f"{NET}::/64")}
    for n in range(1, 6):
        node.ctx.bans.strike(admission.caller_key(Connection(f"ipv6:[{NET}::{n}]:4000")))  # type: ignore[arg-type]
    with pytest.raises(PermissionError, match="banned"):
        await admission.admit(Connection(f"ipv6:[{NET}:ffff::1]:4000"))  # type: ignore[arg-type]
    await admission.admit(Connection("ipv6:[2001:db8:1:3::1]:4000"))  # type: ignore[arg-type]


# ---- names: resolved once, by the node, to the IP it dials -----------------------------------


SPELLINGS = ["127.000.000.001:7420", "127.0.0.01:7420", "LOCALHOST:7420", "localhost:7420", "127.0.0.1:7420"]


async def test_listed_spellings_of_one_address_are_one_address_and_loopback_stays_out() -> None:
    """Finding 8: `127.000.000.001` and `LOCALHOST` passed the loopback filter of gossiped
    addresses (taken as names), and grpc dialed them. Every spelling now comes out as the IP it
    names: one address, dialed only by a node that is itself on loopback."""
    assert [literal(a) is not None for a in SPELLINGS] == [False, False, False, False, True]
    for local in (False, True):
        table = PeerTable(self_id="me", dead_after_s=5.0)
        tasks: list[asyncio.Task[None]] = []
        Resolver().each(SPELLINGS, lambda ips, t=table, loc=local: t.add_gossiped(ips, local=loc, cap=100),
                        spawn=lambda coro, name, held=tasks: held.append(asyncio.ensure_future(coro)))
        await asyncio.gather(*tasks)
        assert table.addresses == ({"127.0.0.1:7420"} if local else set()), table.addresses


async def test_a_node_dials_and_counts_the_ip_a_name_resolves_to(nodes: Nodes) -> None:
    """A member bootstrapping from `localhost:PORT` records its peer at the IP it connected to,
    127.0.0.1, never at the name (before, the host was the name dialed: a voice per name)."""
    a = await nodes.start("a", n_elements=N)
    b = await nodes.start("b", peers=[f"localhost:{a.ctx.bound_port}"], n_elements=N)
    await wait_until(lambda: "a" in b.table.peers, what="b to meet a")
    assert b.table.peers["a"].host == "127.0.0.1"


# ---- a Hello answer over a session speaks for its carrier only -------------------------------


def answer_of(node: SwarmNode) -> pb.HelloResponse:
    return node.peers.session_hello()


async def test_a_hello_answer_forwarded_over_a_session_does_not_move_its_member(nodes: Nodes) -> None:
    """Finding 4: a carrier forwards member m's fresh signed Hello answer over the session a
    home member holds to it. Before, the home member recorded m at the carrier's host (the
    answer was taken as if the carrier's address had answered it); now a session speaks for
    its carrier only: m stays where the home member saw it, and the carrier's own answer is
    taken without moving any host."""
    home, carrier, member = [await nodes.start(name, n_elements=N) for name in ("home", "carrier", "m")]
    table = home.table
    for peer, seen_at in ((carrier, "203.0.113.7"), (member, "198.51.100.4")):
        table.heard_from(peer.cfg.node_id, peer.advertise, round=0, param_digest="", digests={}, leaving=False,
                         host=seen_at, public_key=peer.ctx.security.key.public, said_at=int(time.time()) - 30)
    said_at = table.peers["m"].said_at
    await home.sessions.take("carrier", "203.0.113.7:7420", pb.SessionMessage(hello=answer_of(member)), Inflow())
    assert (table.peers["m"].host, table.peers["m"].said_at) == ("198.51.100.4", said_at)
    await home.sessions.take("carrier", "203.0.113.7:7420", pb.SessionMessage(hello=answer_of(carrier)), Inflow())
    assert table.peers["carrier"].said_at > said_at and table.peers["carrier"].host == "203.0.113.7"
    assert voice("m", table.peers["m"].host) != voice("carrier", table.peers["carrier"].host)


# ---- reachability: three hosts drawn at random; the dial-back dials the IP it checked -------------


def test_reachability_is_asked_of_three_hosts_drawn_at_random() -> None:
    """Finding 5: the first three live peers in id order were asked, and ids ground to a low
    prefix on two hosts were all of them. Now three distinct hosts are drawn at random."""
    liars = [Peer(node_id=f"0000{n}", address="", host=f"203.0.113.{n % 2 + 1}", last_seen=1.0) for n in range(10)]
    honest = [Peer(node_id=f"h{n}", address="", host=f"198.51.100.{n}", last_seen=1.0) for n in range(1, 4)]
    rng = random.Random(7)
    drawn = [askers([*liars, *honest], rng=rng) for _ in range(200)]
    assert all(len(a) == 3 and len({p.voice for p in a}) == 3 for a in drawn)
    assert {p.voice for a in drawn for p in a} == {p.voice for p in [*liars, *honest]}  # every host may be asked
    assert sum(all(p.node_id.startswith("0000") for p in a) for a in drawn) == 0  # two liar hosts are never three
    assert len(askers(liars, rng=rng)) == 2  # two hosts: two asked, however many ids


async def test_the_dial_back_dials_the_ip_it_checked(nodes: Nodes, monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 8: the dial-back resolved a name to check it was the caller's, then dialed the
    name again, which a rebinding name points elsewhere. Here the name answers the caller's IP
    the first time and a test address nobody answers at after: the node dials the IP it
    checked, and finds the caller there."""
    a = await nodes.start("a", n_elements=N)
    b = await nodes.start("b", peers=[a.advertise], n_elements=N)
    await wait_until(lambda: "b" in {p.node_id for p in a.table.alive()}, what="a to know b")
    answers = iter([["127.0.0.1"]])

    async def rebinding(name: str) -> list[str]:
        return next(answers, ["192.0.2.1"]) if name == "rebind.test" else []

    monkeypatch.setattr(Resolver, "lookup_all", staticmethod(rebinding))
    said = await a.reach.dial_back("b", "127.0.0.1", f"rebind.test:{b.ctx.bound_port}")
    assert said.reachable


# ---- no takeover while a swarm starts --------------------------------------------------------------


def test_one_id_announcing_round_1_moves_nobody_while_the_swarm_starts() -> None:
    """Finding 2: four members at round 0 (the seed's digest) and one id announcing round 1
    with digests of its own. Members at round 0 did not vote: its lineage won, the others
    planned to download its state, and no other member of its lineage could vouch, so its word
    was taken. Now members at round 0 vote (four hosts against one), and no state is vouched
    for that no other host published."""
    seed = {0: "seed"}
    honest = [Peer(node_id=f"h{n}", address="", host=f"198.51.100.{n}", round=0, digests=dict(seed), last_seen=1.0)
              for n in range(2, 5)]
    liar = Peer(node_id="a-liar", address="", host="203.0.113.7", round=1, digests={1: "doctored"}, last_seen=1.0)
    assert lineages("h1", 0, seed, [liar, *honest]).winner == ["h1", "h2", "h3", "h4"]
    assert plan_catch_up("h1", 0, seed, [liar, *honest]) is None
    seen = witnesses(1, "doctored", "a-liar", [liar, *honest])
    assert not seen.accepted and seen.others == 3 and seen.pending  # too few can vouch: keep our own
    assert witnesses(1, "doctored", "a-liar", [liar]).accepted  # a swarm of two: nobody else to ask


async def test_witnesses_are_sought_among_all_live_hosts(executor: Any) -> None:
    """The donor alone in its lineage (round 1, digests of its own) and three hosts at round 0:
    before, witnesses were sought in the donor's lineage only, it held no other member, and the
    donor's word was taken ("a lineage of one has no second witness"). Now the three are asked,
    none published the round, and the state is refused: the node keeps its own lineage."""
    node = SwarmNode(swarm_config("joiner", n_elements=N), executor=executor)
    table, now = node.table, int(time.time())
    table.heard_from("a-liar", "203.0.113.7:7420", round=1, param_digest="doctored", digests={1: "doctored"},
                     leaving=False, host="203.0.113.7", said_at=now)
    assert node.fetcher.vouched(1, "doctored", "a-liar", ["a-liar"]) is None  # nobody else alive: a swarm of two
    for n in range(1, 4):
        table.heard_from(f"h{n}", f"198.51.100.{n}:7420", round=0, param_digest="seed", digests={0: "seed"},
                         leaving=False, host=f"198.51.100.{n}", said_at=now)
    refused = node.fetcher.vouched(1, "doctored", "a-liar", ["a-liar"])
    assert refused is not None and "0 of the 3 other live hosts" in refused and node.fetcher.unwitnessed == {1: "a-liar"}


async def test_under_tls_a_name_is_dialed_at_its_ip(tmp_path: Path, executor: Any) -> None:
    """Mutual TLS, a advertising `localhost`: b dials the IP the name resolves to (the
    certificate is checked against the name: `ca issue` certificates always name localhost and
    127.0.0.1 too, so this shows the handshake still completes, not the check), and counts a at
    the IP."""
    from neuronode import cli

    ca = tmp_path / "ca"
    assert cli.main(["ca", "init", "--out", str(ca), "--swarm-id", "tls-names"]) == 0
    files = {}
    for name in ("a", "b"):
        assert cli.main(["ca", "issue", "--ca", str(ca), "--out", str(tmp_path / "certs"), "--name", name,
                         "--host", "localhost"]) == 0
        files[name] = (str(tmp_path / "certs" / f"{name}.crt"), str(tmp_path / "certs" / f"{name}.key"),
                       str(ca / "ca.crt"))
    a = SwarmNode(swarm_config("a", swarm_id="tls-names", n_elements=N, advertise="localhost:0"), executor=executor,
                  security=Security(node_id="a", swarm_id="tls-names", tls_files=files["a"]))
    await a.start()
    b = SwarmNode(swarm_config("b", swarm_id="tls-names", n_elements=N, peers=(a.advertise,)), executor=executor,
                  security=Security(node_id="b", swarm_id="tls-names", tls_files=files["b"]))
    await b.start()
    try:
        assert a.advertise.startswith("localhost:")
        await wait_until(lambda: "a" in b.table.peers, what="b to meet a over TLS", timeout_s=20)
        assert b.table.peers["a"].host == "127.0.0.1"
    finally:
        await b.stop(grace_s=0.2)
        await a.stop(grace_s=0.2)
