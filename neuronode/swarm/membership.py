"""Who is in the swarm: the peer table, liveness and replica-agreement bookkeeping.

Pure bookkeeping (no sockets): the node feeds it what Hello calls and heartbeats learn.
A peer is alive while we heard from it within `dead_after_s` and it has not said it is leaving.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from neuronode.averaging.state import RECENT_DIGESTS
from neuronode.averaging.transport import MemberView
from neuronode.clock import Clock
from neuronode.events import fields

logger = logging.getLogger(__name__)


@dataclass
class Peer:
    """What we know of one peer."""

    node_id: str
    address: str
    round: int = 0
    param_digest: str = ""
    contributes_from: int = 0  # first round it contributes to (see NodeInfo.contributes_from)
    receipts: dict[int, frozenset[int]] = field(default_factory=dict)  # round -> averaged shards received
    digests: dict[int, str] = field(default_factory=dict)  # round -> param_digest
    last_seen: float = 0.0  # the table's clock; 0 = never heard from
    left: bool = False
    failures: int = 0


class PeerTable:
    """Peers by node id, plus bootstrap addresses whose id we don't know yet."""

    def __init__(self, *, self_id: str, dead_after_s: float, clock: Clock | None = None) -> None:
        self.self_id = self_id
        self.dead_after_s = dead_after_s
        self.clock = clock or Clock()
        self.peers: dict[str, Peer] = {}
        self.addresses: set[str] = set()  # every address worth dialing

    def add_address(self, address: str) -> None:
        self.addresses.add(address)

    def heard_from(
        self, node_id: str, address: str, *, round: int, param_digest: str,
        digests: dict[int, str], leaving: bool, contributes_from: int = 0,
        receipts: dict[int, frozenset[int]] | None = None,
    ) -> bool:
        """Record a message from a peer; True when the peer is new or came back."""
        if node_id == self.self_id:
            return False
        peer = self.peers.get(node_id)
        fresh = peer is None or not self.is_alive(peer)
        if peer is None:
            peer = self.peers[node_id] = Peer(node_id=node_id, address=address)
            logger.info("peer %s joined at %s (round %d)", node_id, address, round,
                        extra=fields("peer_joined", peer_id=node_id, address=address, round=round))
        elif fresh and not leaving:
            logger.info("peer %s is back at %s (round %d)", node_id, address, round,
                        extra=fields("peer_back", peer_id=node_id, address=address, round=round))
        if address:
            peer.address = address
            self.addresses.add(address)
        peer.round, peer.param_digest = round, param_digest
        peer.contributes_from = contributes_from
        peer.receipts = receipts or {}
        peer.digests.update(digests)
        for old in sorted(peer.digests)[:-RECENT_DIGESTS]:
            del peer.digests[old]
        peer.last_seen = self.clock.now()
        peer.failures = 0
        peer.left = leaving
        return fresh and not leaving

    def mark_left(self, node_id: str) -> bool:
        peer = self.peers.get(node_id)
        if peer is None or peer.left:
            return False
        peer.left = True
        logger.info("peer %s left the swarm", node_id, extra=fields("peer_left", peer_id=node_id))
        return True

    def mark_failure(self, address: str) -> None:
        for peer in self.peers.values():
            if peer.address == address:
                peer.failures += 1

    def is_alive(self, peer: Peer) -> bool:
        return (
            not peer.left
            and peer.last_seen > 0
            and self.clock.now() - peer.last_seen < self.dead_after_s
        )

    def alive(self) -> list[Peer]:
        return sorted((p for p in self.peers.values() if self.is_alive(p)), key=lambda p: p.node_id)

    def dial_targets(self) -> list[str]:
        """Addresses to heartbeat: all known ones except peers that said they left."""
        left = {p.address for p in self.peers.values() if p.left}
        alive = {p.address for p in self.alive()}
        return sorted(a for a in self.addresses if a not in left or a in alive)


def round_peers(table: PeerTable, round_id: int, *, round_lag: int) -> set[str]:
    """Peers whose contribution to `round_id` we wait for: live, not behind, and not only
    listening to it. A peer two rounds ahead closed this round long ago; one round ahead may still
    be streaming its contribution to us, so it stays. `round_lag` is how far a peer's reported
    round may trail a round it still contributes to: 1, or 2 under --overlap (a node contributes
    to round r while round r - 1 still syncs)."""
    return {p.node_id for p in table.alive()
            if round_id - round_lag <= p.round <= round_id + 1 and p.contributes_from <= round_id}


def member_views(table: PeerTable, round_id: int, members: tuple[str, ...]) -> list[MemberView]:
    """What every reduce-scatter member but us said about `round_id` (see agreed_shards)."""
    views = []
    for member in members:
        if member == table.self_id:
            continue
        peer = table.peers.get(member)
        present = (peer is not None and not peer.left and table.is_alive(peer)
                   and peer.contributes_from <= round_id)
        views.append(MemberView(member=member, present=present,
                                receipt=peer.receipts.get(round_id) if peer is not None else None,
                                past_round=peer is not None and peer.round > round_id))
    return views


# A member more than this many rounds ahead of the most advanced other member is not believed:
# honest members close rounds together (at most 2 apart under --overlap), so only a liar, or a
# member that trained alone, is further ahead of everyone else.
MAX_LEAD = 3


def believable(peers: list[Peer], *, max_lead: int = MAX_LEAD) -> list[Peer]:
    """`peers` less any whose claimed round is more than `max_lead` ahead of every other peer
    that has trained (fresh joiners at round 0 are no evidence; with no such other peer nobody
    can tell, and the claim stands)."""
    out = []
    for peer in peers:
        others = [p.round for p in peers if p is not peer and p.round > 0]
        if not others or peer.round <= max(others) + max_lead:
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

    @property
    def winner(self) -> list[str]:
        return self.groups[0]

    def top_round(self, group: list[str]) -> int:
        return max(self.rounds[i] for i in group)


def lineages(self_id: str, own_round: int, own: dict[int, str], peers: list[Peer]) -> Lineages:
    """Group ourselves and live peers that published digests into lineages.

    Two nodes share a lineage when their digests agree at their newest common round. The
    winner is the group with the most members that have trained (fresh joiners at round 0 vote
    for no lineage), then the highest round, then the smallest digest at that round
    (docs/fault-tolerance.md). Everyone applies the same rule to the same reports, so after a
    partition heals every node picks the same side. A peer claiming a round far ahead of every
    other peer is not believed (`believable`) and counts nowhere.
    """
    peers = believable(peers)
    histories = {self_id: own} | {p.node_id: p.digests for p in peers if p.digests}
    rounds = {self_id: own_round} | {p.node_id: p.round for p in peers if p.digests}
    ids = sorted(histories)
    parent = {i: i for i in ids}

    def find(i: str) -> str:
        while parent[i] != i:
            i = parent[i]
        return i

    for n, i in enumerate(ids):
        for j in ids[n + 1 :]:
            if same_lineage(histories[i], histories[j]):
                parent[find(j)] = find(i)
    grouped: dict[str, list[str]] = {}
    for i in ids:
        grouped.setdefault(find(i), []).append(i)

    def rank(group: list[str]) -> tuple[int, int, str]:
        top = max(rounds[i] for i in group)
        holder = min(i for i in group if rounds[i] == top)
        return (-sum(rounds[i] > 0 for i in group), -top, histories[holder].get(top, ""))

    return Lineages(groups=sorted(grouped.values(), key=rank), rounds=rounds)


@dataclass(frozen=True)
class CatchUp:
    """Why and from whom to download the swarm's state."""

    reason: str  # "behind" or "diverged"
    target_round: int
    donors: list[str]  # node ids, best first


def plan_catch_up(self_id: str, own_round: int, own: dict[int, str], peers: list[Peer]) -> CatchUp | None:
    """Behind the winning lineage, or outside it: download from its most advanced members
    (whose state is only adopted if other members vouch for it: neuronode.swarm.trust)."""
    peers = believable(peers)
    lin = lineages(self_id, own_round, own, peers)
    winner = lin.winner
    # Where the swarm is: the round at least two of its members (every one, if fewer) reached,
    # so one member claiming a round more moves nobody.
    others = sorted((lin.rounds[i] for i in winner if i != self_id), reverse=True)
    top = others[min(2, len(others)) - 1] if others else own_round
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
