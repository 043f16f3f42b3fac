"""Who is in the swarm: the peer table, liveness and replica-agreement bookkeeping.

Pure bookkeeping (no sockets): the node feeds it what Hello calls and heartbeats learn.
A peer is alive while we heard from it within `dead_after_s` and it has not said it is leaving.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

RECENT_DIGESTS = 8


@dataclass
class Peer:
    """What we know of one peer."""

    node_id: str
    address: str
    round: int = 0
    param_digest: str = ""
    digests: dict[int, str] = field(default_factory=dict)  # round -> param_digest
    last_seen: float = 0.0  # time.monotonic(); 0 = never heard from
    left: bool = False
    failures: int = 0


class PeerTable:
    """Peers by node id, plus bootstrap addresses whose id we don't know yet."""

    def __init__(self, *, self_id: str, dead_after_s: float) -> None:
        self.self_id = self_id
        self.dead_after_s = dead_after_s
        self.peers: dict[str, Peer] = {}
        self.addresses: set[str] = set()  # every address worth dialing

    def add_address(self, address: str) -> None:
        self.addresses.add(address)

    def heard_from(
        self, node_id: str, address: str, *, round: int, param_digest: str,
        digests: dict[int, str], leaving: bool,
    ) -> bool:
        """Record a message from a peer; True when the peer is new or came back."""
        if node_id == self.self_id:
            return False
        peer = self.peers.get(node_id)
        fresh = peer is None or not self.is_alive(peer)
        if peer is None:
            peer = self.peers[node_id] = Peer(node_id=node_id, address=address)
            logger.info("peer %s joined at %s (round %d)", node_id, address, round)
        elif fresh and not leaving:
            logger.info("peer %s is back at %s (round %d)", node_id, address, round)
        if address:
            peer.address = address
            self.addresses.add(address)
        peer.round, peer.param_digest = round, param_digest
        peer.digests.update(digests)
        for old in sorted(peer.digests)[:-RECENT_DIGESTS]:
            del peer.digests[old]
        peer.last_seen = time.monotonic()
        peer.failures = 0
        peer.left = leaving
        return fresh and not leaving

    def mark_left(self, node_id: str) -> bool:
        peer = self.peers.get(node_id)
        if peer is None or peer.left:
            return False
        peer.left = True
        logger.info("peer %s left the swarm", node_id)
        return True

    def mark_failure(self, address: str) -> None:
        for peer in self.peers.values():
            if peer.address == address:
                peer.failures += 1

    def is_alive(self, peer: Peer) -> bool:
        return (
            not peer.left
            and peer.last_seen > 0
            and time.monotonic() - peer.last_seen < self.dead_after_s
        )

    def alive(self) -> list[Peer]:
        return sorted((p for p in self.peers.values() if self.is_alive(p)), key=lambda p: p.node_id)

    def dial_targets(self) -> list[str]:
        """Addresses to heartbeat: all known ones except peers that said they left."""
        left = {p.address for p in self.peers.values() if p.left}
        alive = {p.address for p in self.alive()}
        return sorted(a for a in self.addresses if a not in left or a in alive)


def agreement(own: dict[int, str], peers: list[Peer]) -> tuple[str, int | None]:
    """Compare our digest of the newest round that peers also reported.

    Returns ("agree" | "diverged" | "unknown", round compared). We are "diverged" when, for that
    round, more nodes (ourselves counted) hold one other digest than hold ours.
    """
    for round_id in sorted(own, reverse=True):
        votes = Counter(p.digests[round_id] for p in peers if round_id in p.digests)
        if not votes:
            continue
        votes[own[round_id]] += 1
        ours = votes[own[round_id]]
        best_digest, best = min(votes.items(), key=lambda kv: (-kv[1], kv[0]))
        if best_digest != own[round_id] and best > ours:
            return "diverged", round_id
        return "agree" if ours == sum(votes.values()) else "majority", round_id
    return "unknown", None
