"""Who counts in a vote, and how many make a quorum: the one rule every "more than one member
must agree" decision uses (standing aside, catching up, witnesses for a donated state, the
lineage vote, reachability, the address peers see, which contributions a round averages).

Ids are free: anyone holding the swarm's secret (or open to join) makes as many keys as it
likes. So no decision counts ids. It counts *voices*: the host a member's connections come from
(for a member behind NAT, the address peers see it at; a member known only through a relay,
its carrier's host; an IPv6 host, its /64 network, which one party usually holds whole). Any
number of ids on one host are one voice: a lab behind one NAT, too.

The exception is this machine's loopback: a member that calls from 127.0.0.1 (or ::1) runs on
this machine, where only its owner can start processes, so it counts per id. A swarm on one
machine (a laptop, the tests) keeps one voice per node, and no remote party gains anything from
it: it cannot call from our loopback.

A quorum is a strict majority of the voices that spoke: never a fixed count, so a swarm's size
decides how many hosts a liar needs, not a constant.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable

from neuronode.config import is_loopback_host

VoiceOf = Callable[[str], str]  # node id -> its voice


def voice(node_id: str, host: str) -> str:
    """The voice of `node_id` seen at `host` (module docstring): "host:..." for a remote host,
    "id:<node_id>" on our loopback or where no host is known."""
    host = host.strip("[]")
    if not host or is_loopback_host(host):
        return f"id:{node_id}"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f"host:{host.lower()}"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return f"host:{ip.ipv4_mapped}"
        return f"host:{ipaddress.IPv6Network((ip, 64), strict=False)}"
    return f"host:{ip}"


def by_id(node_id: str) -> str:
    """The voice of an id when every id is its own host (in-process swarms, pure tests)."""
    return f"id:{node_id}"


def voices(ids: Iterable[str], voice_of: VoiceOf) -> set[str]:
    """The distinct voices among `ids`."""
    return {voice_of(i) for i in ids}


def quorum(spoke: int) -> int:
    """How many of `spoke` voices must agree: a strict majority (none of none)."""
    return spoke // 2 + 1 if spoke > 0 else 0


def majority(said: Iterable[str], of: Iterable[str], voice_of: VoiceOf) -> bool:
    """Whether the ids in `said` are a strict majority of the voices of `of` (and `of` has one)."""
    spoke = voices(of, voice_of)
    return len(voices(said, voice_of) & spoke) >= quorum(len(spoke)) > 0
