"""Replica agreement and catch-up, as pure functions of what peers announce (their rounds and
recent parameter digests, kept by neuronode.swarm.membership.table's peer table): which claims are
believable, which lineages the swarm holds, whether we agree with it, and whom to download the
state from when we are behind or apart. Never on one peer's word (docs/fault-tolerance.md)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from neuronode.quorum import by_id, reached
from neuronode.swarm.membership.table import Peer

# A member more than this many rounds ahead of the most advanced other host is not believed:
# honest members close rounds together (at most 2 apart under --overlap), so only a liar, or a
# member that trained alone, is further ahead of everyone else.
MAX_LEAD = 3


def believable(peers: list[Peer], *, max_lead: int = MAX_LEAD) -> list[Peer]:
    """`peers` less any whose claimed round is more than `max_lead` ahead of every other host
    that has trained (neuronode.quorum: its other ids are no evidence, nor are fresh joiners at
    round 0; with no such other host nobody can tell, and the claim stands). Linear: only the
    two hosts with the highest trained rounds matter."""
    best: dict[str, int] = {}
    for p in peers:
        if p.round > 0:
            best[p.voice] = max(best.get(p.voice, 0), p.round)
    top = heapq.nlargest(2, ((r, v) for v, r in best.items()))
    out = []
    for peer in peers:
        best_other = next((r for r, v in top if v != peer.voice), None)
        if best_other is None or peer.round <= best_other + max_lead:
            out.append(peer)
    return out


def same_lineage(a: dict[int, str], b: dict[int, str]) -> bool | None:
    """Do two digest histories agree at their newest common round? None: no common round."""
    common = set(a) & set(b)
    if not common:
        return None
    newest = max(common)
    return a[newest] == b[newest]


@dataclass(frozen=True)
class Lineages:
    """Nodes grouped by lineage (agreeing digests), and the winning group by the swarm's rule."""

    groups: list[list[str]]  # each sorted; winner first
    rounds: dict[str, int]
    voices: dict[str, str] = field(default_factory=dict, compare=False)  # node id -> voice (neuronode.quorum)
    work: int = field(default=0, compare=False)  # digest lookups and unions made (tests count them)

    @property
    def winner(self) -> list[str]:
        return self.groups[0]

    def top_round(self, group: list[str]) -> int:
        return max(self.rounds[i] for i in group)


def lineages(self_id: str, own_round: int, own: dict[int, str], peers: list[Peer]) -> Lineages:
    """Group ourselves and live peers that published digests into lineages.

    Two nodes share a lineage when the one whose history ends first (its newest round is the
    lower) holds, at its newest round, the digest the other published for that round: they held
    the same parameters there and neither has since left them (for histories that are windows of
    recent rounds, as nodes publish, that is agreeing at the newest common round). The relation
    is closed transitively. The winner is the group with the most members (counted as hosts:
    neuronode.quorum; members at round 0 too, so that one id announcing a round of its own while
    a swarm starts is one voice against every member there), then the highest round, then the
    smallest digest at that round (docs/fault-tolerance.md). Everyone applies the same rule to
    the same reports, so after a partition heals every node picks the same side. A peer
    claiming a round far ahead of every other peer is not believed (`believable`) and counts
    nowhere.

    Near-linear in the digests published: nodes are taken newest-first, each looks its own
    newest (round, digest) up among the histories already taken, and a lookup that joins groups
    leaves one representative behind.
    """
    peers = believable(peers)
    voice_of = {self_id: by_id(self_id)} | {p.node_id: p.voice for p in peers}
    histories = {self_id: own} | {p.node_id: p.digests for p in peers if p.digests}
    rounds = {self_id: own_round} | {p.node_id: p.round for p in peers if p.digests}
    parent = {i: i for i in histories}
    work = 0

    def find(i: str) -> str:
        root = i
        while parent[root] != root:
            root = parent[root]
        while parent[i] != root:  # path compression
            parent[i], i = root, parent[i]
        return root

    holders: dict[tuple[int, str], list[str]] = {}  # (round, digest) -> nodes taken that hold it
    newest = {i: max(h) if h else -1 for i, h in histories.items()}
    for j in sorted(histories, key=lambda i: (-newest[i], i)):
        history = histories[j]
        if not history:
            continue
        key = (newest[j], history[newest[j]])
        holding = holders.get(key)
        if holding:
            for i in holding:
                parent[find(i)] = find(j)
                work += 1
            holders[key] = []  # all of them are j's group now: j, added below, stands for it
        for item in history.items():
            work += 1
            holders.setdefault(item, []).append(j)
    grouped: dict[str, list[str]] = {}
    for i in sorted(histories):
        grouped.setdefault(find(i), []).append(i)

    def rank(group: list[str]) -> tuple[int, int, str]:
        top = max(rounds[i] for i in group)
        holder = min(i for i in group if rounds[i] == top)
        return (-len({voice_of[i] for i in group}), -top, histories[holder].get(top, ""))

    return Lineages(groups=sorted(grouped.values(), key=rank), rounds=rounds, voices=voice_of, work=work)


@dataclass(frozen=True)
class CatchUp:
    """Why and from whom to download the swarm's state."""

    reason: str  # "behind" or "diverged"
    target_round: int
    donors: list[str]  # node ids, best first


def plan_catch_up(self_id: str, own_round: int, own: dict[int, str], peers: list[Peer]) -> CatchUp | None:
    """Behind the winning lineage, or outside it: download from its most advanced members
    (whose state is only adopted if other members vouch for it: neuronode.swarm.guard.trust)."""
    peers = believable(peers)
    lin = lineages(self_id, own_round, own, peers)
    winner = lin.winner
    # Where the swarm is: the round a quorum of its other hosts reached (each host at its
    # furthest id), so one host claiming a round more, under any number of ids, moves nobody.
    top = reached((lin.voices[i], lin.rounds[i]) for i in winner if i != self_id)
    if top is None:
        top = own_round
    if self_id in winner:
        if own_round >= top:
            return None
        reason = "behind"
    elif too_far_behind(own_round, own, winner, peers):
        reason = "behind"  # no common round left to compare: we are simply far behind
    else:
        reason = "diverged"
    donors = sorted((i for i in winner if i != self_id), key=lambda i: (-lin.rounds[i], i))
    return CatchUp(reason=reason, target_round=top, donors=donors) if donors else None


def too_far_behind(own_round: int, own: dict[int, str], group: list[str], peers: list[Peer]) -> bool:
    """We share no round with `group` and are older than all they remember."""
    histories = [p.digests for p in peers if p.node_id in group and p.digests]
    oldest = min((min(h) for h in histories), default=0)
    return own_round < oldest and all(same_lineage(own, h) is None for h in histories)


def agreement(self_id: str, own_round: int, own: dict[int, str], peers: list[Peer]) -> str:
    """"agree" (one lineage), "majority" (ours wins, others differ), "diverged" (ours loses),
    "behind" (too far behind to compare), or "unknown" (no peer published a digest yet)."""
    lin = lineages(self_id, own_round, own, peers)
    if len(lin.rounds) == 1:
        return "unknown"
    if self_id not in lin.winner:
        return "behind" if too_far_behind(own_round, own, lin.winner, peers) else "diverged"
    return "agree" if len(lin.groups) == 1 else "majority"
