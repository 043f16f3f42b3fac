"""Who is in the swarm: the peer table and liveness (replica agreement: neuronode.swarm.membership.lineage).

Pure bookkeeping (no sockets): the node feeds it what Hello calls and heartbeats learn.
A peer is alive while we heard from it within `dead_after_s` and it has not said it is leaving.

Heartbeats go to `fanout(N)` peers an interval (those we heard from least recently), not to
all N: a node then sends and answers about 2·fanout Hellos a heartbeat, O(log N), and hears
from each peer at least every ceil(N / fanout) heartbeats, so a peer is dead after that many
times the base timeout (`PeerTable.dead_after_s`). Up to MIN_FANOUT members, everyone greets
everyone every heartbeat.
"""

from __future__ import annotations

import ipaddress
import logging
import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from neuronode.averaging.state import RECENT_DIGESTS
from neuronode.averaging.transport import MemberView
from neuronode.clock import Clock
from neuronode.config import parse_hostport
from neuronode.errors import ConfigError
from neuronode.events import fields
from neuronode.quorum import host as host_of
from neuronode.quorum import is_loopback, reached, voice
from neuronode.swarm.guard.bans import Bans, node_key

logger = logging.getLogger(__name__)


MAX_MEMBERS = 4096  # node ids the table holds at most (peers long dead are pruned first): a gather swarm of thousands
MAX_IDS_PER_HOST = 16  # live node ids one host (neuronode.quorum.host: an IPv4 address, an IPv6 /64) may hold
PRUNE_AFTER_DEAD_S = 600.0  # a peer dead (or gone) this long is forgotten
MIN_FANOUT = 16  # peers a heartbeat (and peer exchange) reaches at least: all of a swarm this small
MAX_GOSSIPED = 16  # new addresses one message's peer list may add (a member lists a sample of 8)
RELAYED = "relayed-by:"  # the host of a member known only through a relay, until its carrier's is known


def fanout(n_peers: int, min_fanout: int = MIN_FANOUT) -> int:
    """How many peers one heartbeat greets (and one peer exchange lists) among `n_peers`."""
    return max(min_fanout, math.ceil(2 * math.log2(n_peers + 1)))


def rotation(n_peers: int, min_fanout: int = MIN_FANOUT) -> int:
    """Heartbeats until every one of `n_peers` was greeted once (1 up to `min_fanout`)."""
    return max(1, math.ceil(n_peers / fanout(n_peers, min_fanout)))


def heartbeat_targets(table: PeerTable, *, skip: Iterable[str] = ()) -> list[str]:
    """Addresses one heartbeat greets: every known address that is not a live peer's (new
    ones, bootstrap peers, the dead: the caller's backoff paces those), and the `fanout` live
    peers we heard from least recently (one that failed our last Hello last: a crashed peer
    must not take a slot every heartbeat until it is declared dead)."""
    skipped = set(skip)
    live = {p.address: p for p in table.alive() if p.address}
    targets = [a for a in table.dial_targets() if a not in skipped]
    others = [a for a in targets if a not in live]
    stale = sorted((a for a in targets if a in live), key=lambda a: (live[a].failures > 0, live[a].last_seen, a))
    return others + stale[:fanout(len(live), table.min_fanout)]


class TableFull(Exception):
    """A new node id the table cannot take; the message says why."""


class KeyMismatch(Exception):
    """A Hello for a node id we know, signed by another key than the one it is bound to."""


@dataclass
class Peer:
    """What we know of one peer."""

    node_id: str
    address: str
    # The IP it last called us from, or that we connected to when we dialed it, never a name
    # (neuronode.quorum); a member known only through a relay, its carrier's. A relayed Hello
    # never moves a member we saw directly to a carrier's host.
    host: str = ""
    seen_directly: bool = False
    public_key: bytes = b""  # the key its id is bound to (neuronode.security.identity)
    verified: bool = True  # spoke as itself: a member; False until then (see PeerTable.heard_from)
    round: int = 0
    param_digest: str = ""
    contributes_from: int = 0  # first round it contributes to (see NodeInfo.contributes_from)
    digests: dict[int, str] = field(default_factory=dict)  # round -> param_digest
    momenta: dict[int, str] = field(default_factory=dict)  # round -> momentum_digest (as `digests`)
    last_seen: float = 0.0  # the table's clock; 0 = never heard from
    left: bool = False
    failures: int = 0
    reachable: bool = True  # False: it said peers cannot dial it (never dialed; reached over its session)
    carried_by: tuple[str, ...] = ()  # members whose sessions carry it (it said; neuronode.swarm.relay)
    advertised: bool = True  # it advertises an address of its own (not one still learning it)
    said_at: int = 0  # the (signed) time of the newest message of its we took: older ones are replays

    @property
    def voice(self) -> str:
        """Who it counts as in any vote (neuronode.quorum): its host, or its id on our loopback."""
        return voice(self.node_id, self.host)

    @property
    def counted_host(self) -> str:
        """The host --max-ids-per-host counts it under (neuronode.quorum.host; loopback too)."""
        return host_of(self.host) or self.host


class PeerTable:
    """Peers by node id, plus bootstrap addresses whose id we don't know yet."""

    def __init__(self, *, self_id: str, dead_after_s: float, clock: Clock | None = None,
                 max_members: int = MAX_MEMBERS, max_ids_per_host: int = MAX_IDS_PER_HOST,
                 min_fanout: int = MIN_FANOUT, bans: Bans | None = None) -> None:
        self.self_id = self_id
        self.base_dead_after_s = dead_after_s  # with everyone greeted every heartbeat
        self.min_fanout = min_fanout  # peers a heartbeat greets at least (module docstring)
        self.clock = clock or Clock()
        self.max_members = max_members
        self.max_ids_per_host = max_ids_per_host
        self.peers: dict[str, Peer] = {}
        self.bans = bans or Bans(clock=self.clock)  # the node's one ban list (proven liars among them)
        self.addresses: set[str] = set()  # every address worth dialing
        self.bootstrap: set[str] = set()  # --peers: kept whatever happens

    def add_address(self, address: str, *, bootstrap: bool = False) -> None:
        self.addresses.add(address)
        if bootstrap:
            self.bootstrap.add(address)

    @property
    def dead_after_s(self) -> float:
        """Silence after which a peer is dead: the base timeout per heartbeat rotation (module
        docstring), so that sampled heartbeats never make a live peer look dead."""
        return self.base_dead_after_s * rotation(len(self.peers), self.min_fanout)

    def admit(self, node_id: str, host: str) -> None:
        """Raise TableFull unless a new `node_id` seen at `host` may join the table: at most
        --max-ids-per-host live ids per host (an IPv6 host is its /64: neuronode.quorum.host)."""
        if node_id in self.peers or node_id == self.self_id:
            return
        if len(self.peers) >= self.max_members:
            self.prune()
        if len(self.peers) >= self.max_members:
            raise TableFull(f"this node already knows {len(self.peers)} members, its most; try again later")
        counted = Peer(node_id=node_id, address="", host=host).counted_host
        same_host = sum(1 for p in self.peers.values() if counted and p.counted_host == counted and self.is_alive(p))
        if counted and same_host >= self.max_ids_per_host:
            raise TableFull(f"{same_host} live members already call from {counted}, the most one host may "
                            f"run (--max-ids-per-host {self.max_ids_per_host})")

    def prune(self) -> int:
        """Forget peers dead or gone for PRUNE_AFTER_DEAD_S; how many were forgotten."""
        now = self.clock.now()
        gone = [i for i, p in self.peers.items()
                if not self.is_alive(p) and now - p.last_seen >= max(PRUNE_AFTER_DEAD_S, 2 * self.dead_after_s)]
        for node_id in gone:
            del self.peers[node_id]
        return len(gone)

    def heard_from(
        self, node_id: str, address: str, *, round: int, param_digest: str,
        digests: dict[int, str], leaving: bool, contributes_from: int = 0, momenta: dict[int, str] | None = None,
        host: str = "",
        public_key: bytes = b"", verified: bool = True, reachable: bool = True, carried_by: tuple[str, ...] = (),
        advertised: bool = True, said_at: int = 0,
    ) -> bool:
        """Record a (verified, signed) message from a peer; True when the peer is new or came
        back. A new peer must pass `admit` (raises TableFull); its id is bound to `public_key`
        from then on, and a message for it under another key raises KeyMismatch. `verified`
        False (a Hello answer whose id a certificate did not prove) records the peer without
        making it a member (not alive: not expected, not a donor, counted nowhere) until a
        verified message of its own arrives. `said_at` is the message's signed time: one older
        than the newest taken from the peer (a replay) changes nothing."""
        if node_id == self.self_id:
            return False
        peer = self.peers.get(node_id)
        if peer is not None and peer.public_key and public_key != peer.public_key:
            raise KeyMismatch(f"node id {node_id[:128]!r} is bound to another key here; a node id belongs to "
                              "one key (give this node its own --node-id, or its old data dir back)")
        if peer is not None and self.stale(peer, said_at, round=round, leaving=leaving):
            return False
        relayed = host.startswith(RELAYED)
        host = self.resolve_host(host) if relayed else host_ip(host)
        fresh = peer is None or not self.is_alive(peer)
        if peer is None:
            self.admit(node_id, host)
            peer = self.peers[node_id] = Peer(node_id=node_id, address=address, public_key=public_key,
                                              verified=verified)
            logger.info("peer %s joined at %s (round %d)", node_id, address, round,
                        extra=fields("peer_joined", peer_id=node_id, address=address, round=round))
        elif fresh and not leaving:
            logger.info("peer %s is back at %s (round %d)", node_id, address, round,
                        extra=fields("peer_back", peer_id=node_id, address=address, round=round))
        peer.verified = peer.verified or verified
        moved = not said_at or said_at > peer.said_at or not peer.host  # a replay of this second moves nothing
        if host and moved and not (relayed and peer.seen_directly):
            peer.host = host
            peer.seen_directly = not relayed
        peer.said_at = max(peer.said_at, said_at)
        if address and address != peer.address:
            if peer.address not in self.bootstrap:  # one address per member: a flood of them goes nowhere
                self.addresses.discard(peer.address)
            peer.address = address
        if address:
            self.addresses.add(address)
        peer.round, peer.param_digest = round, param_digest
        peer.contributes_from = contributes_from
        peer.digests.update(digests)
        peer.momenta.update(momenta or {})
        for old in sorted(peer.digests)[:-RECENT_DIGESTS]:
            del peer.digests[old]
        for old in set(peer.momenta) - set(peer.digests):
            del peer.momenta[old]
        peer.last_seen = self.clock.now()
        peer.failures = 0
        peer.reachable = reachable
        peer.carried_by = carried_by
        peer.advertised = advertised
        peer.left = leaving
        return fresh and not leaving

    @staticmethod
    def stale(peer: Peer, said_at: int, *, round: int, leaving: bool) -> bool:
        """A message older than the newest we took from `peer` (a replay within the signature's
        freshness window), or one of the same second that would take it back (to an older round,
        or back from having left): taking it would roll the member back or revive it."""
        if not said_at:
            return False
        if said_at < peer.said_at:
            return True
        return said_at == peer.said_at and (round < peer.round or (peer.left and not leaving))

    def resolve_host(self, host: str) -> str:
        """A member known only through a relay counts under its carrier's host (neuronode.quorum)."""
        if host.startswith(RELAYED):
            carrier = self.peers.get(host[len(RELAYED):])
            if carrier is not None and carrier.host and not carrier.host.startswith(RELAYED):
                return carrier.host
        return host

    def voice(self, node_id: str) -> str:
        """Who `node_id` counts as in a vote (neuronode.quorum); unknown ids (and we) per id."""
        peer = self.peers.get(node_id)
        return peer.voice if peer is not None else voice(node_id, "")

    def add_gossiped(self, addresses: Iterable[str], *, local: bool, cap: int) -> int:
        """Take at most MAX_GOSSIPED new addresses a peer listed, up to `cap` known in all, each
        one worth dialing (`gossiped_address_ok`); how many were added."""
        added = 0
        for address in addresses:
            if len(self.addresses) >= cap or added >= MAX_GOSSIPED:
                break
            if address not in self.addresses and gossiped_address_ok(address, local=local):
                self.addresses.add(address)
                added += 1
        return added

    def seen(self, node_id: str) -> None:
        """A live peer sent us something of its own (a contribution's chunk): it is live now, as
        if a Hello had come (one may be queued behind those bytes on its link)."""
        peer = self.peers.get(node_id)
        if peer is not None and self.is_alive(peer):
            peer.last_seen = self.clock.now()

    def ban(self, node_id: str, for_s: float) -> bool:
        """Exclude `node_id` for `for_s` (it signed two versions of one statement): not alive, its
        Hellos and contributions refused. True when the ban is new."""
        return self.bans.ban(node_key(node_id), for_s, "it signed two different versions of one contribution or receipt")

    def banned_for(self, node_id: str) -> float:
        """Seconds left on `node_id`'s ban (0: not banned)."""
        return self.bans.banned_for(node_key(node_id))

    def banned_ids(self) -> list[str]:
        """The node ids banned now."""
        return self.bans.banned_nodes()

    def mark_left(self, node_id: str, *, said_at: int = 0) -> bool:
        peer = self.peers.get(node_id)
        if peer is None or peer.left or (said_at and said_at < peer.said_at):
            return False
        peer.left = True
        peer.said_at = max(peer.said_at, said_at)
        logger.info("peer %s left the swarm", node_id, extra=fields("peer_left", peer_id=node_id))
        return True

    def mark_failure(self, address: str) -> None:
        for peer in self.peers.values():
            if peer.address == address:
                peer.failures += 1

    def is_alive(self, peer: Peer) -> bool:
        return (
            not peer.left
            and peer.verified
            and self.banned_for(peer.node_id) <= 0
            and peer.last_seen > 0
            and self.clock.now() - peer.last_seen < self.dead_after_s
        )

    def dialable(self, peer: Peer) -> bool:
        """We may dial it: it has an address and did not say peers cannot dial it."""
        return peer.reachable and bool(peer.address)

    def alive(self) -> list[Peer]:
        return sorted((p for p in self.peers.values() if self.is_alive(p)), key=lambda p: p.node_id)

    def dial_targets(self) -> list[str]:
        """Addresses to heartbeat: all known ones except peers that said they left, or that
        they cannot be dialed (they call us; a bootstrap address is always tried)."""
        left = {p.address for p in self.peers.values() if p.left}
        alive = {p.address for p in self.alive()}
        undialable = {p.address for p in self.peers.values() if not p.reachable} - self.bootstrap
        return sorted(a for a in self.addresses if (a not in left or a in alive) and a not in undialable)


def host_ip(seen: str) -> str:
    """`seen` (an IP the node saw) in canonical spelling; "" for anything else: a name is no host
    (neuronode.quorum), so a caller that passes one records none."""
    try:
        return str(ipaddress.ip_address(seen.strip("[]")))
    except ValueError:
        return ""


def gossiped_address_ok(address: str, *, local: bool) -> bool:
    """Whether to dial an address a peer listed, once resolved (neuronode.swarm.links.resolve:
    only an IP the node resolved itself is dialed, never the name): IP:PORT with a port, the IP
    in canonical spelling and unicast; a loopback, unspecified, multicast, link-local or
    reserved one only when we ourselves are on loopback (`local`: a swarm on one machine). A
    liar's list must not make us dial this machine's own services, or a network's broadcast."""
    try:
        host, port = parse_hostport(address, "a listed peer")
    except ConfigError:
        return False
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if not port or str(ip) != host.lower():
        return False
    if is_loopback(host):
        return local
    return local or not (ip.is_unspecified or ip.is_multicast or ip.is_link_local or ip.is_reserved)


def round_peers(table: PeerTable, round_id: int, *, round_lag: int) -> set[str]:
    """Peers whose contribution to `round_id` we wait for: live, not behind, and not only
    listening to it. A peer two rounds ahead closed this round long ago; one round ahead may still
    be streaming its contribution to us, so it stays. `round_lag` is how far a peer's reported
    round may trail a round it still contributes to: 1, or 2 under --overlap (a node contributes
    to round r while round r - 1 still syncs)."""
    return {p.node_id for p in table.alive()
            if round_id - round_lag <= p.round <= round_id + 1 and p.contributes_from <= round_id}


def moved_past(table: PeerTable, round_id: int, *, round_lag: int) -> bool:
    """A quorum of the other live hosts is past `round_id` (closed it, and under --overlap its
    sync too): nobody else contributes to it any more."""
    at = reached((p.voice, p.round) for p in table.alive())
    return at is not None and at > round_id + round_lag - 1


def reducers(table: PeerTable, members: Iterable[str], *, self_dialable: bool) -> set[str]:
    """Members peers can dial: they advertise an address and did not say peers cannot dial it
    (what each says of itself, so every member reckons alike; `self_dialable` is what we say).
    A node still learning its address is none yet."""
    out = set()
    for member in members:
        if member == table.self_id:
            if self_dialable:
                out.add(member)
        elif (peer := table.peers.get(member)) is not None and peer.reachable and peer.advertised:
            out.add(member)
    return out


def member_views(table: PeerTable, makers: set[str], round_id: int, members: Iterable[str], *,
                 coming: Collection[str] = ()) -> list[MemberView]:
    """What we know of every member of `round_id` but us: `makers` published their receipt;
    `coming` sent one we cannot read yet (its list is on its way), so it is not past the round
    for us even when it moved on."""
    views = []
    for member in sorted(set(members)):
        if member == table.self_id:
            continue
        peer = table.peers.get(member)
        present = (peer is not None and not peer.left and table.is_alive(peer)
                   and peer.contributes_from <= round_id)
        views.append(MemberView(member=member, present=present, has_receipt=member in makers,
                                past_round=peer is not None and peer.round > round_id and member not in coming))
    return views
