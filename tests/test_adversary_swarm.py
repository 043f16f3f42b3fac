"""Four honest members and one liar, all with the same credentials, one lie at a time (the
adversary harness, tests/adversary.py): the honest members finish their rounds with one digest,
val_loss within 5% of the same swarm without the liar, no crash, and no round waiting out a
deadline more than once because of the liar.

Lies about the swarm (claimed rounds, a claimed round close, another --codec or --outer-lr,
stalled streams, another member's id, ghosts, two contributions or two receipts for different
members, a contribution pushed to part of the swarm) run with the four honest members from the start; lies in a donated state (doctored, NaN, an
absurd momentum) need a joiner, so the fourth honest member joins late, through the liar.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from adversary import Liar
from helpers import Node, finish, poll

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(400)]

SYNC_TIMEOUT_S = 10  # one deadline a liar may cost: short, so the suite stays short
ARGS = ("--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "32", "--batch-size", "4",
        "--rounds", "6", "--sync-timeout", str(SYNC_TIMEOUT_S), "--swarm-id", "lies", "--device", "cpu")
HONEST = ("h1", "h2", "h3", "h4")
LIAR = "a-liar"  # sorts first: the first donor a joiner tries, the first peer it asks
SWARM_LIES = ("claim-rounds", "claim-closed", "codec", "outer-lr", "stall-streams", "impersonate", "ghosts",
              "equivocate-contributions", "half-push", "equivocate-receipts")
# (equivocate-receipts runs all-to-all, where receipts are new: under reduce-scatter a liar that
# is banned mid-swarm leaves --min-peers unreachable, and without the liar in --min-peers five
# members starting together may fix round 0 with different member lists, an old race of
# reduce-scatter. tests/test_averaging.py runs the receipt lie under reduce-scatter too.)
REFUSED = ("codec", "outer-lr")  # refused at Hello: never a member
NEVER_DELIVERS = ("stall-streams", "impersonate")  # a member whose contributions never arrive whole (or as itself)
BANNED = ("equivocate-contributions", "equivocate-receipts")  # caught and banned: a member for a round at most
WEIGHT_LIES = ("heavy-flip", "flip")  # its pseudo-gradient x -10, claiming weight 1e14 (refused) or its own
STATE_LIES = ("doctored-state", "nan-state", "huge-momentum", "hold-state")


def run(tmp: Path, behaviour: str | None, *, joiner: bool) -> dict[str, Node]:
    """The swarm, with the liar when `behaviour` is given; with `joiner` h4 joins after round 2
    through the liar (or through h1 without one)."""
    tmp.mkdir(parents=True, exist_ok=True)
    # Every round waits for every member that starts with the swarm (the liar too, unless it is
    # refused), so nobody trains ahead while the others start.
    accepted = behaviour is not None and behaviour not in (*REFUSED, *NEVER_DELIVERS, *BANNED, "heavy-flip")
    # A joiner needs rounds long enough to join the running swarm: 100 inner steps of at least
    # 10 ms each (--fault-file step_delay_s), 1 s or more however fast the machine (in CI
    # 100 steps took 0.45 s, and the swarm finished its 6 rounds before the joiner met it).
    if joiner:
        pace = tmp / "pace.json"
        pace.write_text(json.dumps({"step_delay_s": 0.01}))
    args = (*ARGS, *(("--inner-steps", "100", "--fault-file", str(pace)) if joiner else ("--inner-steps", "4")),
            *(("--chunk-bytes", "4096") if behaviour in NEVER_DELIVERS else ()))  # many chunks: one is kept back
    min_peers = ("--min-peers", str((3 if joiner else 4) + accepted))
    h1 = Node(tmp, "h1", *args, *min_peers, "--node-id", "h1")
    nodes: dict[str, Node] = {"h1": h1}
    for name in HONEST[1:3] if joiner else HONEST[1:]:
        nodes[name] = Node(tmp, name, *args, *min_peers, "--node-id", name, "--peers", h1.address)
    if behaviour:
        # A liar the others wait for keeps in step with them (--min-peers too): one that ran
        # ahead alone would finish its rounds and leave, and --min-peers would wait for good.
        nodes[LIAR] = Liar(tmp, LIAR, *args, *(min_peers if accepted else ()), "--node-id", LIAR,
                           "--peers", h1.address, behaviour=behaviour)
    try:
        for name, node in nodes.items():
            if name == LIAR and behaviour == "claim-closed":
                # Its claim meets a formed swarm: a fresh node whose only peer yet is the liar
                # takes that one peer's word (a quorum of one), which is not what this tests.
                poll("h1 to know the honest members", lambda: len(h1.events("peer_joined")) >= 3, timeout_s=60)
            node.start()
        if joiner:  # past the rounds members keep for catching up by rounds: the joiner downloads the state
            poll("h1 at round 4", lambda: any(e["round"] >= 4 for e in h1.events("round_done")), timeout_s=120)
            via = nodes[LIAR] if behaviour else h1
            nodes["h4"] = Node(tmp, "h4", *args, *min_peers, "--node-id", "h4", "--peers", via.address).start()
        if behaviour in REFUSED:  # refused by its only bootstrap peer: it stops rather than train alone
            assert nodes[LIAR].wait(240) == 2, nodes[LIAR].log()[-3000:]
        finish([node for name, node in nodes.items() if not (name == LIAR and behaviour in REFUSED)], 240)
    finally:
        for node in nodes.values():
            node.kill()
    return nodes


@cache
def reference(tmp: Path, joiner: bool) -> float:
    """The honest swarm's val_loss at the end, without the liar."""
    nodes = run(tmp / f"reference-{joiner}", None, joiner=joiner)
    return check_honest(nodes)


def check_honest(nodes: dict[str, Node]) -> float:
    statuses = {name: nodes[name].status() for name in HONEST}
    assert all(s["round"] == 6 for s in statuses.values()), statuses
    assert len({s["param_digest"] for s in statuses.values()}) == 1, statuses
    digests: dict[int, set[str]] = {}  # every round ended identical on every member that averaged it
    for name in HONEST:
        for e in nodes[name].events("round_done"):
            digests.setdefault(e["round"], set()).add(e["param_digest"])
    assert all(len(d) == 1 for d in digests.values()), {r: d for r, d in digests.items() if len(d) > 1}
    for name in HONEST:  # at most one round waited out its deadline, whatever the liar did
        waited = {e["round_id"] for e in nodes[name].events("deadline")}
        assert len(waited) <= 1, (name, waited)
        assert statuses[name]["buffered_bytes"] <= statuses[name]["buffered_bytes_bound"], statuses[name]
    return float(statuses["h1"]["val_loss"])


def rejected_donors(node: Node) -> list[Any]:
    return [e["peer_id"] for e in node.events("donor_rejected")]


@pytest.mark.parametrize("behaviour", SWARM_LIES + STATE_LIES)
def test_one_liar_among_four_honest_members_changes_nothing(tmp_path_factory: pytest.TempPathFactory,
                                                            behaviour: str) -> None:
    base = tmp_path_factory.getbasetemp() / "adversary-swarm"
    joiner = behaviour in STATE_LIES
    nodes = run(base / behaviour, behaviour, joiner=joiner)
    val_loss = check_honest(nodes)
    assert abs(val_loss - reference(base, joiner)) <= 0.05 * reference(base, joiner)
    honest = [nodes[name] for name in HONEST]
    if behaviour in ("codec", "outer-lr"):  # refused at Hello, never averaged
        flag = "--codec int8" if behaviour == "codec" else "--outer-lr 0.5"
        assert any(flag in e["detail"] for e in nodes[LIAR].events("refused_by")), nodes[LIAR].log()[-3000:]
        assert all(LIAR not in e["contributors"] for n in honest for e in n.events("round_done"))
    elif behaviour == "claim-rounds":  # nobody believed the 1000 rounds or caught up to them
        assert not any(n.events("catching_up") for n in honest)
    elif behaviour == "claim-closed":  # nobody stood aside on the liar's word
        assert not any(n.events("stand_aside") for n in honest)
    elif behaviour == "stall-streams":  # its streams were cut when rounds closed, and never averaged
        assert all(LIAR not in e["contributors"] for n in honest for e in n.events("round_done"))
    elif behaviour == "impersonate":  # refused as h2 (its key is not h2's): h2 stayed where it is
        assert any("bound to another key" in e["detail"] for e in nodes[LIAR].events("refused_by")), \
            nodes[LIAR].log()[-3000:]
    elif behaviour == "ghosts":  # at most --max-ids-per-host ids from the liar's host, never averaged
        assert all(not any(c.startswith("ghost-") for c in e["contributors"]) for n in honest for e in n.events("round_done"))
    elif behaviour == "equivocate-contributions":  # the two statements proved it: left out everywhere, banned
        # Whoever averaged the round where both versions were listed caught it; a member that
        # did not (one that only listened to that round, or whose round the liar missed) sees no
        # second version later, since the others refuse the banned liar: it leaves it out too.
        caught = [n.name for n in honest if any(e["peer_id"] == LIAR for e in n.events("equivocation"))]
        assert caught, "\n".join(n.log()[-2000:] for n in honest)
        assert all(LIAR not in e["contributors"] for n in honest for e in n.events("round_done"))
    elif behaviour == "half-push":  # h4 fetched what a quorum of hosts holds, so everyone averaged it
        assert all(n.events("fetched") for n in honest[3:]), honest[3].log()[-3000:]
        assert any(LIAR in e["contributors"] for e in honest[0].events("round_done"))
    elif behaviour == "equivocate-receipts":  # two versions met (echo, dispute): every honest member banned it
        assert all(any(e["peer_id"] == LIAR for e in n.events("equivocation")) for n in honest)
    elif behaviour == "hold-state":  # the liar held a slot at every donor; the joiner got the other one
        assert nodes["h4"].events("adopted"), nodes["h4"].log()[-3000:]
    else:  # the joiner refused the liar's state, then adopted a vouched one
        h4 = nodes["h4"]
        # Donors go by round, then id: the liar comes first unless h4 planned at the instant a
        # round closed, when an honest member already said round r + 1 and the liar not yet
        # (seen once in CI). The liar's state was then never offered; check_honest still holds.
        first = h4.events("catching_up")[0]["donors"][0]
        assert first != LIAR or rejected_donors(h4)[:1] == [LIAR], h4.log()[-3000:]
        assert h4.events("adopted"), h4.log()[-3000:]


@pytest.mark.parametrize("behaviour", WEIGHT_LIES)
def test_a_member_flipping_its_update_or_claiming_a_huge_weight_changes_little(
        tmp_path_factory: pytest.TempPathFactory, behaviour: str) -> None:
    """Default flags. A member whose contributions carry its pseudo-gradient x -10 and claim
    weight 1e14 is refused (the weight is above the swarm's --max-weight): it counts nowhere. One
    within the bound sending x -10 counts in the round, but norm-clip (the default aggregator)
    leaves it out: clipped to the median norm, it still points against the sum of the others. Either way
    the honest val_loss ends within 10% of the swarm without it. Before, the 1e14 claim made the
    liar's update the whole mean (val_loss 5955 in a probe), and x -10 under the plain mean
    pulled every round the wrong way."""
    base = tmp_path_factory.getbasetemp() / "adversary-swarm"
    nodes = run(base / behaviour, behaviour, joiner=False)
    val_loss = check_honest(nodes)
    print(f"{behaviour}: honest val_loss {val_loss:.4f}, without the liar {reference(base, False):.4f}")  # shown with -s
    assert abs(val_loss - reference(base, False)) <= 0.10 * reference(base, False), (val_loss, reference(base, False))
    honest = [nodes[name] for name in HONEST]
    averaged = [LIAR in e["contributors"] for n in honest for e in n.events("round_done")]
    if behaviour == "heavy-flip":
        assert not any(averaged)
        refusals = [e for n in honest for e in n.events("refused") if e["what"] == "contribution"]
        assert refusals and all(e["code"] == "INVALID_ARGUMENT" and "--max-weight" in e["detail"] for e in refusals)
    else:
        assert all(averaged), "the liar's bounded contribution counts in every round like any member's"
        # ... and norm-clip leaves it out: it points against the sum of the others.
        assert all(any(LIAR in e["peers"] for e in n.events("opposed_left_out")) for n in honest), \
            {n.name: n.events("opposed_left_out") for n in honest}
