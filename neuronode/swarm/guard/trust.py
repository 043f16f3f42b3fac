"""Decisions that never rest on one member's word (SECURITY.md, "Lying members").

Standing aside, choosing a donor, reachability and the address peers see each rest on what the
node verifies itself, or on a quorum of voices other than the one that benefits: a strict
majority of the hosts that spoke (neuronode.quorum; ids and names are free, so any number of
ids on one host are one voice). A donated state needs a quorum of every live host but the
donor's, not only of the donor's lineage: where too few can vouch, the node keeps its own. A
swarm of two has no second witness, and says so in its log. A round claimed far ahead of every
other host is not believed at all (neuronode.swarm.membership.lineage). Pure functions of what the peer
table holds.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from neuronode.quorum import VoiceOf, by_id, is_loopback, quorum
from neuronode.swarm.membership.lineage import believable
from neuronode.swarm.membership.table import Peer


def closed_without_us(round_id: int, own_digest: str | None, peers: list[Peer]) -> list[str]:
    """Peers of our lineage (our digest at the start of `round_id`) that claim to have closed
    `round_id` already, when a quorum of the live hosts says so: any number of ids on one host
    claiming it alone change nothing, even while the others have not yet published where they
    are. [] otherwise."""
    if own_digest is None:
        return []
    live = believable(peers)
    closed = [p for p in live if p.digests.get(round_id) == own_digest and p.round == round_id + 1]
    if not closed or len({p.voice for p in closed}) < quorum(len({p.voice for p in live})):
        return []
    return sorted(p.node_id for p in closed)


@dataclass(frozen=True)
class Witnesses:
    """Who vouches for a donated state's (round, param_digest, momentum_digest), the donor's
    host aside."""

    agree: list[str]  # published those digests for that round
    disagree: list[str]  # published others for it (in the donor's lineage, when the caller named it)
    others: int  # live, believable hosts other than the donor's, whatever their lineage
    agreeing: int = 0  # hosts among `agree`
    disagreeing: int = 0  # hosts among `disagree`
    published: int = 0  # hosts among both
    silent: int = 0  # hosts among `others` that published nothing for the round yet

    @property
    def accepted(self) -> bool:
        """A quorum of the live hosts other than the donor's that published a state for the
        round published the donor's, and at least one did: where none did (one id announcing a
        round nobody else reached, while every other member is still at round 0) nobody vouches,
        and the node keeps its own lineage. With no other host alive at all (a swarm of two)
        nobody can object: the donor's word stands, and the caller says so."""
        if self.others == 0:
            return True
        return self.agreeing >= max(1, quorum(self.published)) and self.agreeing > self.disagreeing

    @property
    def pending(self) -> bool:
        """Some other host has not published a state for the round yet (it may be about to)."""
        return self.silent > 0


def witnesses(round_id: int, param_digest: str, donor_id: str, peers: list[Peer], momentum_digest: str = "", *,
              lineage: Collection[str] | None = None) -> Witnesses:
    """What the live hosts other than the donor's published for `round_id` (the donor's other
    ids vouch for nothing): parameters and momentum alike, or it is another state. `peers`:
    every live member, whatever lineage it is in: witnesses are not sought only in the donor's
    lineage (a lineage of one has hosts around it, and none of them vouches). `lineage`: the
    donor's (the one the vote chose), when the caller has one: a host of another lineage that
    published another state for the round (the other side of a healed partition) then
    objects to nothing; without it, every other state published objects."""
    live = believable(peers)
    donor = next((p.voice for p in live if p.node_id == donor_id), by_id(donor_id))
    others = [p for p in live if p.voice != donor]
    spoke = [p for p in others if round_id in p.digests]
    agree = [p for p in spoke
             if p.digests[round_id] == param_digest and p.momenta.get(round_id, "") == momentum_digest]
    disagree = [p for p in spoke if p not in agree and (lineage is None or p.node_id in lineage)]
    return Witnesses(agree=sorted(p.node_id for p in agree), disagree=sorted(p.node_id for p in disagree),
                     others=len({p.voice for p in others}), agreeing=len({p.voice for p in agree}),
                     disagreeing=len({p.voice for p in disagree}), published=len({p.voice for p in agree + disagree}),
                     silent=len({p.voice for p in others} - {p.voice for p in spoke}))


ASKED = 3  # peers a node asks to dial it back, each on a host of its own


def askers(peers: list[Peer], *, rng: random.Random, k: int = ASKED) -> list[Peer]:
    """Whom to ask to dial us back: `k` of `peers` on distinct hosts, the hosts drawn at random
    (so are their ids): not the first in id order, which ids ground to a low prefix would be,
    and never two of one host."""
    by_voice: dict[str, list[Peer]] = {}
    for peer in peers:
        by_voice.setdefault(peer.voice, []).append(peer)
    chosen = rng.sample(sorted(by_voice), min(k, len(by_voice)))
    return [rng.choice(by_voice[v]) for v in chosen]


def reachability(answers: Mapping[str, bool] | Iterable[tuple[str, bool]], voice_of: VoiceOf = by_id) -> str:
    """"yes" or "no" when a quorum of the hosts that answered our dial-back request (`answers`:
    peer id -> its answer) agree, else "unknown" (one host saying we are unreachable, or
    reachable, is not enough when others answered differently)."""
    said = list(answers.items() if isinstance(answers, Mapping) else answers)
    spoke = {voice_of(peer) for peer, _ in said}
    yes = {voice_of(peer) for peer, answer in said if answer}
    no = {voice_of(peer) for peer, answer in said if not answer}
    need = quorum(len(spoke))
    if need and len(yes) >= need and len(no) < need:
        return "yes"
    if need and len(no) >= need and len(yes) < need:
        return "no"
    return "unknown"


def agreed_host(observed: Mapping[str, str], voice_of: VoiceOf = by_id) -> str | None:
    """The host our peers see our connections come from (`observed`: peer id -> host): the one
    a quorum of their hosts agree on, the most common first. A loopback host counts only when
    every peer sees us there (all on our machine): a peer elsewhere must never be told to dial
    127.0.0.1. None while they disagree, or before any peer answered."""
    remote = {peer: h for peer, h in observed.items() if not is_loopback(h)}
    pool = remote or dict(observed)
    if not pool:
        return None
    seen: dict[str, set[str]] = {}
    for peer, host in pool.items():
        seen.setdefault(host, set()).add(voice_of(peer))
    counts = Counter({host: len(who) for host, who in seen.items()})
    (best, count), *_ = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return best if count >= quorum(len({voice_of(peer) for peer in pool})) else None
