"""The IP the node dials: a name is resolved once, by the node, and the IP it gives is what the
node dials and what it counts (neuronode.quorum: a host is an address the node saw, never a
name; anyone points as many names as it likes at one machine).

`literal` reads an address whose host is an IP literal in its one canonical spelling; anything
else (a name, "LOCALHOST", a zero-padded "203.0.113.005" that resolvers read as an IP) goes
through the system resolver, off the event loop, and comes out as the IP it names. The node
then dials that IP (under TLS checking the certificate against the name it was given), so
what it saw and what it connected to are one address: a name that resolves elsewhere a moment
later (DNS rebinding) changes nothing already decided.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from neuronode.clock import Clock
from neuronode.config import parse_hostport
from neuronode.errors import ConfigError

RESOLVE_TIMEOUT_S = 5.0
RESOLVED_TTL_S = 60.0  # a name is looked up again after this long (its owner may move it)
MAX_RESOLVED = 1024  # names remembered at most
MAX_RESOLVING = 64  # names being resolved at once at most (a liar may list names without end)
MAX_NAMES = 16  # names of one list resolved at most (a member lists a sample of 8 peers)


@dataclass(frozen=True)
class Target:
    """An address to dial: `address` is IP:PORT in canonical spelling (IPv6 in brackets);
    `name` the host name it was resolved from ("" for an IP literal), which TLS checks the
    server's certificate against."""

    address: str
    name: str = ""

    @property
    def ip(self) -> str:
        return self.address.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])


def join(ip: str, port: int | str) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def split(address: str) -> tuple[str, int] | None:
    """(host, port) of HOST:PORT with a port in 1-65535; None when malformed."""
    try:
        host, port = parse_hostport(address, "address")
    except ConfigError:
        return None
    return (host, port) if port else None


def literal(address: str) -> Target | None:
    """`address` when its host is an IP written the one way Python writes it (so "203.0.113.5"
    and "[2001:db8::5]", never "203.0.113.005" or "LOCALHOST"); None otherwise."""
    parts = split(address)
    if parts is None:
        return None
    host, port = parts
    ip = canonical_ip(host)
    return Target(join(ip, port)) if ip and ip == host.lower() else None


class Resolver:
    """Names to the IP the node dials, looked up off the event loop and kept RESOLVED_TTL_S."""

    def __init__(self, *, clock: Clock | None = None) -> None:
        self.clock = clock or Clock()
        self._known: dict[str, tuple[float, str]] = {}  # name -> (when looked up, IP)
        self._resolving: set[str] = set()  # names `each` is resolving now

    def each(self, addresses: list[str], take: Callable[[list[str]], Any], *,
             spawn: Callable[[Coroutine[Any, Any, None], str], Any]) -> None:
        """Hand `take` the IP:PORT each address names: IP literals at once, names (and IPs
        spelled otherwise) once resolved, in a task `spawn` owns; at most MAX_NAMES names of one
        list and MAX_RESOLVING at a time, the rest dropped."""
        take([t.address for a in addresses if (t := literal(a)) is not None])
        names = [a for a in dict.fromkeys(addresses) if literal(a) is None and a not in self._resolving][:MAX_NAMES]
        names = names[:max(0, MAX_RESOLVING - len(self._resolving))]
        if names:
            self._resolving.update(names)
            spawn(self._take_resolved(names, take), "resolve-listed")

    async def _take_resolved(self, names: list[str], take: Callable[[list[str]], Any]) -> None:
        try:
            targets = await asyncio.gather(*(self.resolve(name) for name in names))
            take([t.address for t in targets if t is not None])
        finally:
            self._resolving.difference_update(names)

    async def resolve(self, address: str) -> Target | None:
        """The IP `address` names, as a Target; None for a malformed address or a name that does
        not resolve (in RESOLVE_TIMEOUT_S)."""
        found = literal(address)
        if found is not None:
            return found
        parts = split(address)
        if parts is None:
            return None
        name, port = parts
        now = self.clock.now()
        known = self._known.get(name)
        if known is None or now - known[0] >= RESOLVED_TTL_S:
            ip = await self.lookup(name)
            if not ip:
                return None
            if len(self._known) >= MAX_RESOLVED:
                self._known.clear()
            known = self._known[name] = (now, ip)
        return Target(join(known[1], port), name=name)

    @staticmethod
    async def lookup(name: str) -> str:
        """The IP the system resolver gives first for `name`, an IPv4 one before any IPv6 one (a
        node listening on 0.0.0.0 answers on IPv4 only), canonical; "" when none."""
        ips = await Resolver.lookup_all(name)
        return ips[0] if ips else ""

    @staticmethod
    async def lookup_all(name: str) -> list[str]:
        """Every IP `name` resolves to (itself if it is one), canonical (an IPv4-mapped one as
        IPv4), IPv4 first, resolved off the event loop; [] when none in RESOLVE_TIMEOUT_S."""
        try:
            infos = await asyncio.wait_for(
                asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM), RESOLVE_TIMEOUT_S)
        except (OSError, TimeoutError, UnicodeError):
            return []
        ips = dict.fromkeys(ip for info in infos if (ip := canonical_ip(str(info[4][0]).partition("%")[0])))
        return sorted(ips, key=lambda ip: ":" in ip)  # stable: the resolver's order within a family


def canonical_ip(text: str) -> str:
    """`text` as the IP it is, in its one spelling (an IPv4-mapped IPv6 address as IPv4); "" if
    it is not an IP literal."""
    try:
        ip = ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return ""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)
