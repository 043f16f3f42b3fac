"""The host a contribution names for its maker (`ContributionChunk.sender_host`), and when a
receiver that sees the maker itself takes it (pure).

The average weighs the ids of one host as one member (neuronode.diloco.hosts), by the host each
contribution's maker signed into it: every replica averaging the same contributions then groups
them alike, whatever host each replica sees a maker at (neuronode.averaging.protocol). A maker
names the host its peers agree they see its connections come from (neuronode.swarm.membership.reach); each
receiver that sees the maker itself, at an IP, checks the name against what it sees
(`host_claim_refusal`) and refuses the contribution (PERMISSION_DENIED) when it may not.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable


def canonical_ip(text: str) -> str:
    """`text` as Python writes that IP address (lower-case hex, IPv6 compressed, no brackets);
    "" when it is not one (a name, zero-padded digits)."""
    try:
        return str(ipaddress.ip_address(text.strip("[]")))
    except ValueError:
        return ""


def is_canonical_ip(text: str) -> bool:
    """`text` is an IP address written as `canonical_ip` writes it."""
    return bool(text) and canonical_ip(text) == text


def host_claim_refusal(*, seen: str, claimed: str, others: Iterable[str]) -> str:
    """Why a contribution whose maker we see at voice `seen` may not name voice `claimed` (""
    when it may), `others` the voices of the other members we saw ourselves (live or not). The host we see it at,
    always. Another one (its connections to us come from a LAN address, or another address
    family, than the ones its peers agree on) only while we see no other member at either:
    several ids we see at one host cannot name several hosts (each would weigh as a member), and
    no id can name the host of another member we see (to dilute that member's share)."""
    if claimed == seen:
        return ""
    taken = set(others)
    if seen in taken:
        return "where other members of this swarm run too"
    if claimed in taken:
        return "and another member runs at the host it names"
    return ""
