"""How a member is reached (neuronode.swarm.links): the pure route rule, and the one retry
backoff under a ManualClock."""

from __future__ import annotations

import asyncio

from neuronode.clock import ManualClock
from neuronode.swarm.links import Carried, Dial, Relayed, Unreachable, relay_for, retry_until, route
from neuronode.swarm.membership.table import PeerTable


def table(*peers: tuple[str, str, bool, tuple[str, ...]], me: str = "me") -> PeerTable:
    """Live peers (id, address, reachable, carried_by)."""
    t = PeerTable(self_id=me, dead_after_s=10.0, clock=ManualClock())
    for node_id, address, reachable, carried_by in peers:
        t.heard_from(node_id, address, round=0, param_digest="", digests={}, leaving=False, reachable=reachable,
                     carried_by=carried_by, advertised=bool(address))
    return t


def test_a_reachable_member_with_an_address_is_dialed_and_one_without_is_not() -> None:
    t = table(("p", "10.0.0.2:7420", True, ()), ("learning", "", True, ()))
    assert route(t.peers["p"], t, "yes") == Dial("10.0.0.2:7420")
    assert route(t.peers["p"], t, "no") == Dial("10.0.0.2:7420")  # we dial out from behind NAT
    assert isinstance(route(t.peers["learning"], t, "yes"), Unreachable)  # never an empty address


def test_a_member_whose_session_we_carry_goes_over_it() -> None:
    t = table(("home", "", False, ("me",)))
    assert route(t.peers["home"], t, "yes", carried={"home"}) == Carried("home")
    assert isinstance(route(t.peers["home"], t, "yes"), Unreachable)  # its session is not up yet: it opens one


def test_two_members_nobody_can_dial_reach_each_other_through_the_carrier_the_hash_picks() -> None:
    t = table(("p1", "10.0.0.2:7420", True, ()), ("p2", "10.0.0.3:7420", True, ()), ("home", "", False, ("p1", "p2")))
    where = route(t.peers["home"], t, "no")
    assert where == Relayed(relay_for("me", "home", {"p1", "p2"}))  # the relay reckons the same
    assert relay_for("me", "home", {"p1", "p2"}) in {"p1", "p2"}
    t.peers[where.carrier].left = True  # type: ignore[union-attr]  # the carrier goes: the other takes over
    assert route(t.peers["home"], t, "no") == Relayed(({"p1", "p2"} - {where.carrier}).pop())  # type: ignore[union-attr]
    t.peers["p1"].left = t.peers["p2"].left = True
    assert isinstance(route(t.peers["home"], t, "no"), Unreachable)


def test_relay_choice_spreads_over_carriers_and_never_picks_an_end() -> None:
    carriers = {f"p{i}" for i in range(4)}
    picks = {relay_for(f"m{i}", "home", carriers) for i in range(40)}
    assert picks == carriers  # every carrier relays for some pair
    assert relay_for("p0", "home", {"p0"}) is None


async def test_retry_until_backs_off_on_the_clock_and_stops_at_the_deadline() -> None:
    clock = ManualClock()
    tries: list[float] = []

    async def failing(left: float) -> bool:
        tries.append(clock.now())
        return False

    retrying = asyncio.ensure_future(retry_until(clock.now() + 10.0, clock, failing, first_s=1.0, max_s=4.0))
    while not retrying.done():
        await asyncio.sleep(0)
        if clock.waiting:
            clock.advance(0.5)
    assert retrying.result() is False
    gaps = [b - a for a, b in zip(tries, tries[1:], strict=False)]
    # waits of 1, 2, 4, 4 s times a jitter of 0.5-1, and the last one cut at the deadline: the third
    # wait (2-4 s) is at least twice the first (0.5-1 s), whatever the jitter drew
    assert len(gaps) >= 3 and all(0.5 <= g <= 4.5 for g in gaps) and max(gaps) >= 2 * gaps[0]  # doubling, capped
    assert tries[-1] < 1000.0 + 10.0

    done = asyncio.ensure_future(retry_until(clock.now() + 10.0, clock, lambda left: asyncio.sleep(0, True)))
    assert await done is True
