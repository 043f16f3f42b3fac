"""Count what costs something (neuronode.quorum): every vote counts hosts, not ids, and a quorum
is a strict majority of the hosts that spoke. Two ids on one host are one voice, whatever the
rule: standing aside, witnesses for a donated state, where the swarm is, the lineage vote,
believable rounds, reachability, the address peers see, which contributions count, and what a
listener averages. Pure functions and in-process objects (the round rules on a ManualClock);
each of these votes moved with the attacker's second id before."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest
from test_averaging import TIMEOUT_S, Swarm, pools, until  # noqa: F401 - `pools` is a fixture

from neuronode.averaging import AllToAll
from neuronode.averaging.agreement import Receipt, Statement, decide, listed
from neuronode.codec.contribution import Phase
from neuronode.quorum import by_id, majority, quorum, voice
from neuronode.swarm.guard.trust import agreed_host, closed_without_us, reachability, witnesses
from neuronode.swarm.membership.lineage import believable, lineages, plan_catch_up
from neuronode.swarm.membership.table import Peer, PeerTable

PKG = Path(__file__).resolve().parent.parent / "neuronode"
HISTORY = {r: f"h{r}" for r in range(4)}


def peer(node_id: str, host: str, round_id: int = 3, digests: dict[int, str] | None = None) -> Peer:
    return Peer(node_id=node_id, address=f"{host}:7420", host=host, round=round_id,
                digests=dict(HISTORY if digests is None else digests), last_seen=1.0)


def honest(n: int = 4, **kwargs: object) -> list[Peer]:
    return [peer(f"h{i}", f"198.51.100.{i}", **kwargs) for i in range(1, n + 1)]  # type: ignore[arg-type]


def sybils(*ids: str, **kwargs: object) -> list[Peer]:
    """Ids of one volunteer, all on one host."""
    return [peer(i, "203.0.113.7", **kwargs) for i in ids]  # type: ignore[arg-type]


def test_a_voice_is_a_host_and_loopback_counts_per_id() -> None:
    assert voice("a", "203.0.113.7") == voice("b", "203.0.113.7") == "host:203.0.113.7"
    assert voice("a", "127.0.0.1") != voice("b", "127.0.0.1")  # this machine's owner's own nodes
    assert voice("a", "::1") == "id:a" and voice("a", "") == "id:a"
    # An IPv6 host is its /64 (one party usually holds it whole); a mapped IPv4 address, that address.
    assert voice("a", "2001:db8:1:2::5") == voice("b", "2001:db8:1:2:ffff::9") != voice("c", "2001:db8:1:3::5")
    assert voice("a", "::ffff:203.0.113.7") == voice("b", "203.0.113.7")
    assert [quorum(n) for n in range(6)] == [0, 1, 2, 2, 3, 3]


def test_a_majority_counts_the_hosts_that_spoke_not_ids() -> None:
    host = {"h1": "198.51.100.1", "h2": "198.51.100.2", "h3": "198.51.100.3", "s1": "203.0.113.7",
            "s2": "203.0.113.7", "s3": "203.0.113.7"}

    def voice_of(node_id: str) -> str:
        return voice(node_id, host[node_id])

    members = set(host)  # four hosts: three honest, one with three ids
    assert not majority({"s1", "s2", "s3"}, members, voice_of)  # three ids, one voice of four
    assert not majority({"h1", "s1", "s2"}, members, voice_of)  # two of four
    assert majority({"h1", "h2", "s1"}, members, voice_of)  # three of four
    assert majority({"h1", "h2"}, {"h1", "h2", "h3"}, voice_of)
    assert not majority({"h1", "x"}, {"h1", "h2", "h3"}, by_id) and not majority(set(), set(), by_id)


def test_two_ids_on_one_host_claiming_our_round_closed_do_not_make_us_stand_aside() -> None:
    """Four honest hosts still closing round 3; a volunteer's two ids on a fifth claim round 4
    with our digest for 3. Before, two ids were two of the two claims needed."""
    closed = {**HISTORY, 3: "d3"}
    peers = [*honest(round_id=3), *sybils("x1", "x2", round_id=4, digests=closed)]
    assert closed_without_us(3, "d3", peers) == []
    peers[0] = peer("h1", "198.51.100.1", round_id=4, digests=closed)
    assert closed_without_us(3, "d3", peers) == []  # two hosts of the five: no majority yet
    peers[1] = peer("h2", "198.51.100.2", round_id=4, digests=closed)
    assert closed_without_us(3, "d3", peers) == ["h1", "h2", "x1", "x2"]  # three of five


def test_a_donors_other_id_does_not_vouch_for_its_state() -> None:
    """x1 donates a doctored round-4 state; x2 (same host) published the same digest, the
    honest hosts another one, or none yet. Before, x2 was one witness of the one needed."""
    doctored = {**HISTORY, 4: "doctored"}
    peers = [*honest(round_id=3), *sybils("x1", "x2", round_id=4, digests=doctored)]
    seen = witnesses(4, "doctored", "x1", peers)
    assert not seen.accepted and seen.agree == [] and seen.others == 4
    spoke = [peer(p.node_id, p.host, round_id=4, digests={**HISTORY, 4: "honest"}) for p in honest()]
    assert not witnesses(4, "doctored", "x1", [*spoke, *sybils("x1", "x2", round_id=4, digests=doctored)]).accepted
    assert witnesses(4, "honest", "h1", [*spoke, *sybils("x1", "x2", round_id=4, digests=doctored)]).accepted


def test_where_the_swarm_is_counts_each_host_once() -> None:
    """Two ids on one host claiming a round more than the honest hosts move nobody (before, they
    were the two members that reached it)."""
    peers = [*honest(3, round_id=3), *sybils("x1", "x2", round_id=4, digests={**HISTORY, 4: "x"})]
    assert plan_catch_up("me", 3, HISTORY, peers) is None
    joiner = plan_catch_up("me", 0, {}, peers)
    assert joiner is not None and joiner.target_round == 3


def test_a_lineage_of_many_ids_on_one_host_loses_to_more_hosts() -> None:
    ours = {**HISTORY, 4: "ours"}
    theirs = {**HISTORY, 4: "theirs"}
    peers = [peer("h1", "198.51.100.1", 4, ours), *sybils("x1", "x2", "x3", round_id=4, digests=theirs)]
    lin = lineages("me", 4, ours, peers)
    assert lin.winner == ["h1", "me"]


def test_a_round_far_ahead_is_not_believed_on_the_word_of_ids_of_one_host() -> None:
    far = {**HISTORY, 1003: "far"}
    peers = [*honest(3), *sybils("x1", "x2", round_id=1003, digests=far)]
    assert {p.node_id for p in believable(peers)} == {"h1", "h2", "h3"}


def test_reachability_and_the_address_peers_see_count_hosts() -> None:
    table = PeerTable(self_id="me", dead_after_s=5.0)
    for p in [*honest(2), *sybils("x1", "x2")]:
        table.peers[p.node_id] = p
    # h1 says yes; x1 and x2 (one host) say no: one voice each way, no quorum of hosts.
    assert reachability({"h1": True, "x1": False, "x2": False}, table.voice) == "unknown"
    assert reachability({"h1": True, "x1": False, "x2": False}) == "no"  # what counting ids said
    assert reachability({"h1": True, "h2": True, "x1": False, "x2": False}, table.voice) == "yes"
    observed = {"h1": "192.0.2.1", "x1": "192.0.2.99", "x2": "192.0.2.99"}
    assert agreed_host(observed, table.voice) is None
    assert agreed_host({**observed, "h2": "192.0.2.1"}, table.voice) == "192.0.2.1"


def statement(sender: str) -> Statement:
    return Statement(round_id=1, sender=sender, phase=Phase.WHOLE, shard_index=0, lineage=b"l" * 32,
                     body=b"b" * 32, signature=sender.encode().ljust(64, b"s"))


def test_receipts_count_ids_so_ids_of_one_host_keep_no_contribution_out() -> None:
    """Receipts count the ids that made them, alike at every member (agreement's docstring: the
    host a member is seen at differs between members). Fourteen ids of one host that list
    nothing keep out no contribution that two members hold; two ids of one host listing x's
    contribution get it in (what it weighs is bounded by --max-weight and the aggregator)."""
    x, h = statement("x"), statement("h1")
    sybils = [f"x{i}" for i in range(1, 15)]
    receipts = [Receipt(1, Phase.WHOLE, m, (h,)) for m in ("h2", "h3")] + [
        Receipt(1, Phase.WHOLE, m, ()) for m in sybils]
    assert ("h1", 0) in decide(receipts, [], lineage=h.lineage).agreed
    assert "h1" in listed(receipts)
    receipts = [Receipt(1, Phase.WHOLE, m, (x,) if m in ("x1", "x2") else ()) for m in ("x1", "x2", "h1", "h2", "h3")]
    assert ("x", 0) in decide(receipts, [], lineage=x.lineage).agreed
    receipts[1] = Receipt(1, Phase.WHOLE, "x2", ())
    assert ("x", 0) not in decide(receipts, [], lineage=x.lineage).agreed  # one listing is not enough


async def test_a_listener_averages_nothing_that_only_ids_of_one_host_decided(pools) -> None:  # noqa: ANN001, F811
    """Round 0's members are x1 and x2 (one host) and h2, h3, whose contributions and receipts
    never come; h1 only listens. At the deadline h1 holds receipts of one host of the round's
    three: no quorum, so it averages nothing. Before, x1 and x2 vouched for each other and h1
    averaged what they alone sent."""
    swarm = Swarm(pools, AllToAll)
    for name in ("h1", "h2", "h3", "x1", "x2"):
        swarm.join(name)
    swarm.local.hosts.update({"x1": "203.0.113.7", "x2": "203.0.113.7", "h1": "198.51.100.1",
                              "h2": "198.51.100.2", "h3": "198.51.100.3"})
    swarm.local.members["h1"].state.contributes_from = 1  # it stood aside: it listens to round 0
    running = [asyncio.ensure_future(swarm.round(n)) for n in ("x1", "x2")]
    listening = asyncio.ensure_future(swarm.protocols["h1"].listen(0, base_digest="d0"))
    await until("every member waiting on the clock", lambda: swarm.clock.waiting == 3)
    for _ in range(3):  # the round's deadline, then the receipts' (h2 and h3 never publish one)
        swarm.clock.advance(TIMEOUT_S)
        await asyncio.sleep(0.01)
    await until("the listener to finish", listening.done)
    assert listening.result().contributors == []
    for r in running:
        r.cancel()


def definitions(name: str) -> list[str]:
    """Where `def name` or `class name` appears in neuronode/ (module-level or nested)."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name:
                found.append(str(path.relative_to(PKG.parent)))
    return found


def test_one_home_per_rule() -> None:
    """One quorum function, imported wherever members vote; one ban list, on the node's clock."""
    assert definitions("quorum") == ["neuronode/quorum.py"]
    assert definitions("Bans") == ["neuronode/swarm/guard/bans.py"]
    for path in sorted([*(PKG / "swarm").rglob("*.py"), *(PKG / "averaging").rglob("*.py")]):
        text = path.read_text()
        assert "QUORUM" not in text and "min(2," not in text, f"{path}: a quorum of its own"
        assert "banned_until" not in text or path.name == "bans.py", f"{path}: bans of its own"
    bans = (PKG / "swarm" / "guard" / "bans.py").read_text()
    assert "time." not in bans and "self.clock.now()" in bans


def test_quorum_function_is_the_one_the_votes_import() -> None:
    for module in ("swarm/guard/trust.py", "swarm/membership/lineage.py", "averaging/agreement.py", "swarm/receipts/checks.py",
                   "averaging/protocol.py", "averaging/book.py"):
        assert "from neuronode.quorum import" in (PKG / module).read_text(), module


@pytest.mark.parametrize("host", ["127.0.0.1", "203.0.113.7"])
def test_a_relayed_member_counts_under_its_carriers_host(host: str) -> None:
    table = PeerTable(self_id="me", dead_after_s=5.0)
    table.heard_from("carrier", f"{host}:1", round=1, param_digest="", digests={}, leaving=False, host=host)
    table.heard_from("home", "", round=1, param_digest="", digests={}, leaving=False, host="relayed-by:carrier",
                     reachable=False)
    assert table.peers["home"].host == host
    assert (table.voice("home") == table.voice("carrier")) == (host != "127.0.0.1")
    assert table.voice("me") == by_id("me")


def test_a_member_we_know_directly_keeps_its_own_host_when_a_carrier_relays_it_too() -> None:
    # A home member calls us over its own session (we see its NAT's address) and a carrier
    # relays its Hellos to us as well: it is not known only through a relay, so it keeps its own
    # voice. Before, each relayed Hello moved it under the relaying carrier's host, merging it
    # with the carrier's voice until its next direct call, so members counted receipts under
    # different voices at different moments and, starting together, closed round 0 apart (a
    # member left its own contribution out while the others averaged it; tests/test_relay.py).
    table = PeerTable(self_id="me", dead_after_s=5.0)
    table.heard_from("carrier", "203.0.113.7:1", round=0, param_digest="", digests={}, leaving=False,
                     host="203.0.113.7", said_at=1)
    table.heard_from("home", "", round=0, param_digest="", digests={}, leaving=False, host="198.51.100.4",
                     reachable=False, said_at=1)
    table.heard_from("home", "", round=0, param_digest="", digests={}, leaving=False, host="relayed-by:carrier",
                     reachable=False, said_at=2)
    assert table.peers["home"].host == "198.51.100.4"
    assert table.voice("home") != table.voice("carrier")
    # known first only through the relay, it counts under the carrier until it calls us itself
    table.heard_from("other", "", round=0, param_digest="", digests={}, leaving=False, host="relayed-by:carrier",
                     reachable=False, said_at=1)
    assert table.voice("other") == table.voice("carrier")
    table.heard_from("other", "", round=0, param_digest="", digests={}, leaving=False, host="198.51.100.9",
                     reachable=False, said_at=2)
    assert table.voice("other") == voice("other", "198.51.100.9") != table.voice("carrier")


def test_members_that_see_a_home_member_directly_or_relayed_decide_alike() -> None:
    # Round 0 of a failed run of the relay-kill test: p2 closed before h1's push came (it
    # fetched it later), so its receipt lacks h1; p1 and h2 list everything.
    st = {n: Statement(round_id=0, sender=n, phase=Phase.WHOLE, shard_index=0, lineage=b"l", body=n.encode())
          for n in ("h1", "h2", "p1", "p2")}

    def receipt(maker: str, *held: str) -> Receipt:
        return Receipt(round_id=0, phase=Phase.WHOLE, maker=maker, statements=tuple(st[h] for h in sorted(held)))
    receipts = [receipt("p1", "h1", "h2", "p1", "p2"), receipt("p2", "h2", "p1", "p2"),
                receipt("h2", "h1", "h2", "p1", "p2"), receipt("h1", "h1", "h2", "p1", "p2")]
    # p2 sees h1 and h2 over their sessions, h1 sees h2 only through p1's relay: counted by host,
    # h1 left its own contribution out while the others kept it (the relay-kill test failed on
    # this). Counted by id, every member holding these receipts keeps all four.
    assert set(decide(receipts, [], lineage=b"l").agreed) == {(n, 0) for n in st}
