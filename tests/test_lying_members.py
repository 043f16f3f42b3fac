"""One lying member changes nothing: decisions that need more than one peer's word, donors the
swarm vouches for, and no crash from a peer's data. Real SwarmNodes on 127.0.0.1:0, the liars
scripted with the adversary harness (tests/adversary.py). Every test here failed on the code
before issue 14 (see the note on the issue)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch
from adversary import FAKE_DIGEST, claim, lie_about_reach, nan_chunk, published, state
from helpers import Nodes, wait_until

from neuronode.events import record_fields
from neuronode.node.catchup import implausible
from neuronode.swarm.context import Tasks
from neuronode.swarm.guard.trust import closed_without_us
from neuronode.swarm.membership.lineage import plan_catch_up
from neuronode.swarm.membership.table import Peer
from neuronode.swarm.node import SwarmNode
from neuronode.swarm.statesync import donor as statedonor
from neuronode.swarm.statesync import statesync

pytestmark = pytest.mark.timeout(60)

N = 20_000


def events(caplog: pytest.LogCaptureFixture, name: str) -> list[dict[str, object]]:
    return [record_fields(r) for r in caplog.records if getattr(r, "event", "") == name]


async def swarm(nodes: Nodes, names: list[str], **overrides: object) -> list[SwarmNode]:
    """Nodes that all know each other (every one bootstraps from the first)."""
    first = await nodes.start(names[0], n_elements=N, **overrides)
    rest = [await nodes.start(n, peers=[first.advertise], n_elements=N, **overrides) for n in names[1:]]
    everyone = [first, *rest]
    for node in everyone:
        others = {n.cfg.node_id for n in everyone} - {node.cfg.node_id}
        await wait_until(lambda n=node, o=others: {p.node_id for p in n.table.alive()} >= o,
                         what=f"{node.cfg.node_id} to know {sorted(others)}")
    return everyone


def at(nodes: list[SwarmNode], round_id: int, digests: dict[int, str]) -> None:
    """Put every node at `round_id` completed rounds with this digest history."""
    for node in nodes:
        node.state.adopted(min(digests), digests[min(digests)], listen=False)
        for r in sorted(digests)[1:]:
            node.state.completed(r - 1, digests[r])
        assert node.state.round == round_id


async def seen(node: SwarmNode, predicate: Callable[[dict[str, Peer]], bool], what: str) -> None:
    await wait_until(lambda: predicate({p.node_id: p for p in node.table.alive()}), what=what, timeout_s=15)


# ---- 1. one peer's claim is not enough to act ------------------------------------------------


async def test_one_member_claiming_it_closed_our_round_does_not_make_us_stand_aside(nodes: Nodes) -> None:
    """Standing aside (listening instead of contributing) rested on a single peer claiming round
    r + 1 with our digest for r: then we averaged whatever arrived, possibly only its part."""
    a, b, c, liar = await swarm(nodes, ["a", "b", "c", "liar"])
    at([a, b, c, liar], 0, {0: "d0"})
    claim(liar, round_offset=1)  # "I am at round 1: round 0 closed without you"
    liar.peers.announce()
    await seen(a, lambda p: p["liar"].round == 1, "a to hear the liar's claim")
    assert a.closed_without_us(0) == []
    b.state.completed(0, "d1")  # a second member really closed it: now two say so
    await seen(a, lambda p: p["b"].round == 1, "a to see b at round 1")
    assert a.closed_without_us(0) == ["b", "liar"]


def peer(node_id: str, round_id: int, digests: dict[int, str]) -> Peer:
    return Peer(node_id=node_id, address=f"{node_id}:1", round=round_id, digests=digests, last_seen=1.0)


def test_a_liar_claiming_our_round_closed_before_the_others_published_is_not_believed() -> None:
    """We finished round 3 first: the honest peers have not published their round-3 digest
    yet, and the liar claims it closed round 3 with our digest. The quorum counted only peers
    that had published our digest (the liar alone: one of one), so we stood aside, listened to
    the liar, and under --min-peers the others waited for us forever (a CI run did that)."""
    honest = [peer(n, 3, {2: "d2"}) for n in ("b", "c", "d")]  # still closing round 2 -> 3
    liar = peer("liar", 4, {2: "d2", 3: "d3"})
    assert closed_without_us(3, "d3", [*honest, liar]) == []
    honest[0] = peer("b", 4, {2: "d2", 3: "d3"})  # a member really closed it: two of four hosts say so
    assert closed_without_us(3, "d3", [*honest, liar]) == []
    honest[1] = peer("c", 4, {2: "d2", 3: "d3"})  # three of four: a quorum (a strict majority)
    assert closed_without_us(3, "d3", [*honest, liar]) == ["b", "c", "liar"]


def test_a_round_claimed_far_ahead_of_every_other_member_is_not_believed() -> None:
    """A liar in the swarm's own lineage claiming 1000 rounds more made every honest node plan to
    catch up to it (and choose it as the first donor)."""
    history = {r: f"h{r}" for r in range(4)}
    liar = peer("a-liar", 1003, {**history, 1003: FAKE_DIGEST})
    honest = [peer(n, 3, history) for n in ("b", "c")]
    assert plan_catch_up("me", 3, history, [liar, *honest]) is None  # we are not behind anyone believable
    joiner = plan_catch_up("me", 0, {0: "h0"}, [liar, *honest])
    assert joiner is not None and joiner.target_round == 3 and "a-liar" not in joiner.donors
    # A member alone in reach of the claim (nobody else to compare with) is still believed, and a
    # swarm several members strong may be ahead of us by any margin.
    assert plan_catch_up("me", 0, {0: "h0"}, [liar]) is not None
    assert plan_catch_up("me", 3, history, [peer(n, 40, {40: "x"}) for n in ("b", "c")]) is not None


async def test_a_state_no_other_member_vouches_for_is_refused(nodes: Nodes, executor: ThreadPoolExecutor,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A donor claiming a round nobody else published served whatever it liked: the joiner
    accepted any state whose round no other member had a digest for."""
    honest = torch.randn(N, generator=torch.Generator().manual_seed(1))
    good, bad = state(honest, round_id=7), state(honest + 0.1, round_id=8)
    joiner = await nodes.start("joiner", n_elements=N)
    b, c = (SwarmNode(replace(joiner.cfg, node_id=name, peers=(joiner.advertise,)), executor=executor,
                      state_provider=lambda: good) for name in ("b", "c"))
    liar = SwarmNode(replace(joiner.cfg, node_id="a-liar", peers=(joiner.advertise,)), executor=executor,
                     state_provider=lambda: bad)
    for node in (b, c, liar):
        await node.start()
        nodes.running.append(node)
    for node in (b, c):
        published(node, good)
    published(liar, bad)
    await seen(joiner, lambda p: {"a-liar", "b", "c"} <= set(p) and 7 in p["b"].digests and 7 in p["c"].digests
               and 8 in p["a-liar"].digests,
               "the joiner to hear everyone's digests")
    got = await joiner.fetch_state(["a-liar", "b", "c"])  # the liar first, as if it led the lineage
    assert got is not None and got.round == 7 and got.param_digest == good.param_digest
    [rejected] = events(caplog, "donor_rejected")
    assert rejected["peer_id"] == "a-liar" and "0 of the 2 other live hosts published" in str(rejected["reason"])


async def test_a_state_whose_momentum_nobody_else_published_is_refused(nodes: Nodes, executor: ThreadPoolExecutor,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Issue 26, item 2 (d): a donor with the swarm's parameters and doctored momentum (three
    times the swarm's: within the 10x bound). The witnesses vouched for (round, param_digest)
    only, so the joiner took the momentum on the donor's word, diverged at its first outer step
    and repaired from the same donor, in a loop. Members now publish each round's
    momentum_digest beside its param_digest, and a donor's state is vouched for whole."""
    params = torch.randn(N, generator=torch.Generator().manual_seed(1))
    momentum = torch.randn(N, generator=torch.Generator().manual_seed(2))
    good, bad = state(params, round_id=7, momentum=momentum), state(params, round_id=7, momentum=3 * momentum)
    joiner = await nodes.start("joiner", n_elements=N)
    served = {"a-liar": bad, "b": good, "c": good, "d": good}
    members = [SwarmNode(replace(joiner.cfg, node_id=name, peers=(joiner.advertise,)), executor=executor,
                         state_provider=lambda name=name: served[name]) for name in served]
    for node in members:
        await node.start()
        nodes.running.append(node)
        published(node, served[node.cfg.node_id])
    await seen(joiner, lambda p: set(served) <= set(p) and all(p[n].momenta.get(7) for n in served),
               "the joiner to hear everyone's digests")
    got = await joiner.fetch_state(sorted(served))  # the liar first, as if it led the lineage
    assert got is not None and got.momentum is not None and torch.equal(got.momentum, momentum)
    [rejected] = events(caplog, "donor_rejected")
    assert rejected["peer_id"] == "a-liar" and "0 of the 3 other live hosts published" in str(rejected["reason"])


async def test_a_donor_a_round_ahead_of_what_the_others_announced_is_asked_again_once_they_did(
        nodes: Nodes, executor: ThreadPoolExecutor, caplog: pytest.LogCaptureFixture) -> None:
    """The joiner's donor b finished round 8 a moment before c announced it: nobody could vouch
    for it yet. The joiner gave up, trained a round alone, and then refused the swarm's state as
    implausible against its fresh parameters, round after round (tests/test_nat.py saw it never
    join). It now waits until another member publishes the round, and asks again."""
    caplog.set_level(logging.INFO, logger=statesync.__name__)
    honest = torch.randn(N, generator=torch.Generator().manual_seed(1))
    old, new = state(honest, round_id=7), state(honest + 0.1, round_id=8)
    joiner = await nodes.start("joiner", n_elements=N)
    served = {"b": new, "c": old}
    b, c = (SwarmNode(replace(joiner.cfg, node_id=name, peers=(joiner.advertise,)), executor=executor,
                      state_provider=lambda name=name: served[name]) for name in ("b", "c"))
    for node in (b, c):
        await node.start()
        nodes.running.append(node)
    published(b, new)
    published(c, old)
    await seen(joiner, lambda p: {"b", "c"} <= set(p) and 8 in p["b"].digests and 7 in p["c"].digests,
               "the joiner to hear b at round 8 and c at round 7")
    fetching = asyncio.ensure_future(joiner.fetch_state(["b", "c"]))
    await wait_until(lambda: len(events(caplog, "donor_rejected")) == 2 or fetching.done(),
                     what="both donors refused: nobody vouches for either yet")
    assert not fetching.done()
    served["c"] = new
    published(c, new)  # c finished round 8 too, and announces it
    got = await fetching
    assert got is not None and got.round == 8 and got.param_digest == new.param_digest
    assert len(events(caplog, "state_unwitnessed")) == 1


def test_a_donated_state_is_implausible_only_far_beyond_what_the_rounds_between_us_explain() -> None:
    """A fresh joiner (parameters' norm 10.2) refused the swarm's round-4 state (norm 108.5) as
    implausible, round after round, and never joined (tests/test_nat.py): the bound was ten times
    ours, however many rounds of training lay between. It is ten times per round apart now;
    absurd norms are still refused."""
    assert implausible(10.17, 108.5, None, rounds_apart=4) is None
    assert implausible(10.17, 108.5, None, rounds_apart=1) is not None
    assert implausible(10.17, 108.5, None, rounds_apart=-4) is None  # a repair back to an earlier round
    assert "parameters' norm" in str(implausible(10.0, 1e6, None, rounds_apart=4))
    assert "parameters' norm" in str(implausible(10.0, 1e-3, None, rounds_apart=4))
    assert "momentum" in str(implausible(10.0, 10.0, 1e4, rounds_apart=1))


async def test_reachability_rests_on_more_than_one_peer(nodes: Nodes) -> None:
    """The node believed the first peer that answered its dial-back request (here a liar that
    says nobody can reach us, sorting first)."""
    me, b, c, liar = await swarm(nodes, ["me", "b", "c", "a-liar"])
    lie_about_reach(liar, reachable=False)
    await me.check_reachable()
    assert me.reach.reachable == "yes"
    lie_about_reach(b, reachable=False)
    other = await nodes.start("other", peers=[me.advertise], n_elements=N)
    await seen(other, lambda p: {"a-liar", "b", "c"} <= set(p), "the newcomer to know everyone")
    # Two of the three it asks say no to a newcomer: that is a quorum. The three are fixed here:
    # drawn at random (trust.askers) among me, b, c and the liar, me and c with either liar made
    # a quorum saying yes, and the test failed in 2 of 6 runs.
    asked = [other.table.peers[name] for name in ("a-liar", "b", "c")]
    assert await other.reach.check(other.reach.target(), asked) == "no"


# ---- 3. a peer's data never kills the node --------------------------------------------------


async def test_a_donor_streaming_nan_is_refused_without_a_crash(nodes: Nodes, executor: ThreadPoolExecutor,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A hostile donor streams NaN (ours refuses to encode it). Its state decoded to NaN inside
    the download's last step, which raised out of fetch_state and killed the daemon."""
    poisoned = torch.randn(N, generator=torch.Generator().manual_seed(3))
    poisoned[::101] = float("nan")
    monkeypatch.setattr(statedonor, "encode_chunk", nan_chunk)
    joiner = await nodes.start("joiner", n_elements=N)
    donor = SwarmNode(replace(joiner.cfg, node_id="donor", peers=(joiner.advertise,)), executor=executor,
                      state_provider=lambda: state(poisoned))
    await donor.start()
    nodes.running.append(donor)
    await seen(joiner, lambda p: "donor" in p, "the joiner to meet the donor")
    assert await joiner.fetch_state(["donor"]) is None  # the only member: its word is taken, its NaN never
    [rejected] = events(caplog, "donor_rejected")
    assert rejected["peer_id"] == "donor" and "state values" in str(rejected["reason"])


def test_a_background_task_that_fails_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """`_spawn` logged nothing when a background task died."""

    async def main() -> None:
        tasks = Tasks()

        async def broken() -> None:
            raise RuntimeError("boom")

        task = tasks.spawn(broken(), "broken")
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)  # the done callback runs at the next loop turn

    with caplog.at_level(logging.ERROR):
        asyncio.run(main())
    assert any("background task broken failed" in r.getMessage() for r in caplog.records)


def test_heartbeats_restart_after_a_failure(caplog: pytest.LogCaptureFixture) -> None:
    """One exception stopped heartbeats for good."""
    calls = []

    async def main() -> None:
        tasks, third = Tasks(), asyncio.Event()

        async def heartbeats() -> None:
            calls.append(1)
            if len(calls) < 3:
                raise OverflowError("a peer announced a round we cannot echo")
            third.set()
            await asyncio.Event().wait()  # the third run keeps going

        tasks.supervise(heartbeats, "heartbeats", restart_after_s=0.0)
        await third.wait()
        await tasks.stop()

    with caplog.at_level(logging.ERROR):
        asyncio.run(asyncio.wait_for(main(), 10))
    assert len(calls) == 3
    assert sum("heartbeats failed" in r.getMessage() for r in caplog.records) == 2

