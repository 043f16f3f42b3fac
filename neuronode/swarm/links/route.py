"""How a member is reached, decided in one place (pure: no sockets).

- `Dial`: it advertises an address and did not say peers cannot dial it: we call it there.
- `Carried`: it holds a session to us (it cannot be dialed): what we send goes over it.
- `Relayed`: neither, and we cannot be dialed either (two members behind NAT): the carrier
  chosen by rendezvous hash among the live members that carry its sessions forwards what we
  push to that carrier (neuronode.swarm.links.relay).
- `Unreachable`: none of these now (it is still learning its address, or its session to us is
  not up yet); `why` says which.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from neuronode.swarm.membership.table import Peer, PeerTable


@dataclass(frozen=True)
class Dial:
    address: str


@dataclass(frozen=True)
class Carried:
    peer_id: str


@dataclass(frozen=True)
class Relayed:
    carrier: str


@dataclass(frozen=True)
class Unreachable:
    why: str


Route = Dial | Carried | Relayed | Unreachable


def rank(maker: str, receiver: str, carrier: str) -> bytes:
    """Rendezvous hash: the carrier with the lowest rank relays `maker`'s traffic to `receiver`."""
    return hashlib.sha256(f"{maker}\0{receiver}\0{carrier}".encode()).digest()


def relay_for(maker: str, receiver: str, carriers: Iterable[str]) -> str | None:
    """Which of `carriers` (live members carrying `receiver`'s sessions) relays to it for `maker`."""
    candidates = [c for c in carriers if c not in (maker, receiver)]
    return min(candidates, key=lambda c: rank(maker, receiver, c)) if candidates else None


def live_carriers(peer: Peer, table: PeerTable, *, me: str = "") -> set[str]:
    """The members `peer` says carry its sessions that are live here (and `me`, if it names us)."""
    out = set()
    for carrier_id in peer.carried_by:
        carrier = table.peers.get(carrier_id)
        if carrier_id == me or (carrier is not None and table.is_alive(carrier)):
            out.add(carrier_id)
    return out


def route(peer: Peer, table: PeerTable, our_reachability: str, carried: Collection[str] = ()) -> Route:
    """How we reach `peer` now. `our_reachability`: whether peers can dial us ("yes", "no",
    "unknown"); `carried`: the members whose sessions we carry."""
    if peer.node_id in carried:
        return Carried(peer.node_id)
    if peer.reachable:
        if peer.address:
            return Dial(peer.address)
        return Unreachable("it has no address yet (it is learning the one its peers see)")
    if our_reachability != "no":
        return Unreachable("it cannot be dialed and its session to us is not up")
    carrier = relay_for(table.self_id, peer.node_id, live_carriers(peer, table))
    if carrier is None:
        return Unreachable("it cannot be dialed, nor can we, and no live member carries its sessions")
    return Relayed(carrier)
