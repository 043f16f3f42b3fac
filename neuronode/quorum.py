"""Who counts in a vote, and how many make a quorum: the one rule every "more than one member
must agree" decision uses (standing aside, catching up, witnesses for a donated state, the
lineage vote, reachability, the address peers see, which contributions a round averages), and
the one definition of a host that votes, --max-ids-per-host, bans and slots key on.

Ids are free: anyone holding the swarm's secret (or open to join) makes as many keys as it
likes. Names are free too: anyone points as many DNS names as it likes at one machine. So no
decision counts ids or names. It counts *hosts*: an address the node saw itself, the IP a
member's connections to us come from or the IP we connected to when we dialed it (a name is
resolved once, by the node, to the IP it then dials: neuronode.swarm.links.resolve), never a
name. An IPv6 host is its /64 network, which one party usually holds whole. A member known
only through a relay counts under its carrier's host. Any number of ids on one host are one
voice: a lab behind one NAT, too.

The exception is this machine's loopback: a member that calls from 127.0.0.1 (or ::1) runs on
this machine, where only its owner can start processes, so its voice (and its slots) are its
own. A swarm on one machine (a laptop, the tests) keeps one voice per node, and no remote party
gains anything from it: it cannot call from our loopback.

A quorum is a strict majority of the voices that spoke: never a fixed count, so a swarm's size
decides how many hosts a liar needs, not a constant.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable

VoiceOf = Callable[[str], str]  # node id -> its voice


def host(ip: str) -> str:
    """The host an IP address belongs to: an IPv4 address (an IPv4-mapped IPv6 one unwrapped),
    an IPv6 address's /64 network; "" for anything that is not an IP literal (a name names no
    host). What --max-ids-per-host and bans count, loopback included."""
    try:
        address = ipaddress.ip_address(ip.strip("[]"))
    except ValueError:
        return ""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def is_loopback(ip: str) -> bool:
    """`ip` is an address of this machine's loopback (an IPv4-mapped one included)."""
    try:
        address = ipaddress.ip_address(ip.strip("[]"))
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def voice(node_id: str, seen: str) -> str:
    """The voice of `node_id` seen at IP `seen` (module docstring): "host:<host>" for a remote
    host, "id:<node_id>" on our loopback or where no address is known. A placeholder that is
    not an IP (a member known only through a relay whose carrier we have not seen yet:
    neuronode.swarm.membership.table) is one voice of its own."""
    if not seen or is_loopback(seen):
        return f"id:{node_id}"
    return f"host:{host(seen) or seen}"


def peer_ip(peer: str) -> str:
    """The IP in gRPC's peer string ("ipv4:1.2.3.4:5", "ipv6:[::1]:5"): where a caller's
    connection comes from; "" for anything else (a unix socket)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return ""
    return rest.rpartition(":")[0].strip("[]")


def caller(peer: str, node_id: str) -> str:
    """The voice of a caller (gRPC's peer string `peer`, the id its request proved): what a
    per-member limit keys on (state-transfer and contribution-fetch slots), so that the ids
    of one host share one slot and this machine's own nodes keep one each."""
    return voice(node_id, peer_ip(peer))


def by_id(node_id: str) -> str:
    """The voice of an id when every id is its own host (in-process swarms, pure tests)."""
    return f"id:{node_id}"


def voices(ids: Iterable[str], voice_of: VoiceOf) -> set[str]:
    """The distinct voices among `ids`."""
    return {voice_of(i) for i in ids}


def quorum(spoke: int) -> int:
    """How many of `spoke` voices must agree: a strict majority (none of none)."""
    return spoke // 2 + 1 if spoke > 0 else 0


def reached(rounds: Iterable[tuple[str, int]]) -> int | None:
    """The round a quorum of hosts reached, from (voice, round) pairs, each host at its furthest
    id: one host claiming a round more, under any number of ids, moves nothing. None: no host."""
    furthest: dict[str, int] = {}
    for spoke, at in rounds:
        furthest[spoke] = max(furthest.get(spoke, at), at)
    ordered = sorted(furthest.values(), reverse=True)
    return ordered[quorum(len(ordered)) - 1] if ordered else None


def majority(said: Iterable[str], of: Iterable[str], voice_of: VoiceOf) -> bool:
    """Whether the ids in `said` are a strict majority of the voices of `of` (and `of` has one)."""
    spoke = voices(of, voice_of)
    return len(voices(said, voice_of) & spoke) >= quorum(len(spoke)) > 0
