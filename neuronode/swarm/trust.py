"""Decisions that never rest on one member's word (SECURITY.md, "Lying members").

Standing aside, catching up, choosing a donor, repairing, the majority lineage and
reachability each rest on what the node verifies itself, or on the agreement of at least two
members other than the one that benefits: every other member when fewer than two exist (a
swarm of two has no second witness, and says so in its log). A round claimed far ahead of every
other member is not believed at all. Pure functions of what the peer table holds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from neuronode.config import is_loopback_host
from neuronode.swarm.lineage import believable
from neuronode.swarm.membership import Peer


def quorum(others: int) -> int:
    """Independent members that must agree: two, or every other member when fewer exist."""
    return min(2, others)


def closed_without_us(round_id: int, own_digest: str | None, peers: list[Peer]) -> list[str]:
    """Peers of our lineage (our digest at the start of `round_id`) that claim to have closed
    `round_id` already, when enough of them say so to stand aside: at least a quorum of the live
    peers (one liar claiming it alone changes nothing, even while the others have not yet
    published where they are). [] otherwise."""
    if own_digest is None:
        return []
    live = believable(peers)
    closed = sorted(p.node_id for p in live if p.digests.get(round_id) == own_digest and p.round == round_id + 1)
    return closed if closed and len(closed) >= quorum(len(live)) else []


@dataclass(frozen=True)
class Witnesses:
    """Who vouches for a donated state's (round, param_digest), the donor aside."""

    agree: list[str]  # published that digest for that round
    disagree: list[str]  # published another digest for it
    others: int  # live, believable members other than the donor

    @property
    def accepted(self) -> bool:
        """A quorum of the other members that published a digest for the round published the
        donor's, and more of them than published another. With nobody else to speak, nobody can
        vouch: the caller decides."""
        published = len(self.agree) + len(self.disagree)
        return len(self.agree) >= max(1, quorum(published)) and len(self.agree) > len(self.disagree)


def witnesses(round_id: int, param_digest: str, donor_id: str, peers: list[Peer]) -> Witnesses:
    """What the members other than the donor published for `round_id`."""
    others = [p for p in believable(peers) if p.node_id != donor_id]
    published = [p for p in others if round_id in p.digests]
    return Witnesses(agree=sorted(p.node_id for p in published if p.digests[round_id] == param_digest),
                     disagree=sorted(p.node_id for p in published if p.digests[round_id] != param_digest),
                     others=len(others))


def reachability(answers: Iterable[bool]) -> str:
    """"yes" or "no" when a quorum of the peers that answered our dial-back request agree, else
    "unknown" (one peer saying we are unreachable, or reachable, is not enough when others
    answered differently)."""
    said = list(answers)
    need = quorum(len(said))
    if need and said.count(True) >= need:
        return "yes"
    if need and said.count(False) >= need:
        return "no"
    return "unknown"


def agreed_host(observed: Mapping[str, str]) -> str | None:
    """The host our peers see our connections come from (`observed`: peer id -> host): the one
    a quorum of them agree on, the most common first. A loopback host counts only when every
    peer sees us there (all on our machine): a peer elsewhere must never be told to dial
    127.0.0.1. None while they disagree, or before any peer answered."""
    hosts = list(observed.values())
    remote = [h for h in hosts if not is_loopback_host(h)]
    pool = remote or hosts
    if not pool:
        return None
    (best, count), *_ = sorted(Counter(pool).items(), key=lambda kv: (-kv[1], kv[0]))
    return best if count >= quorum(len(pool)) else None
