"""A real network inside Linux network namespaces, so tests can put nodes behind real NATs.

`Net` builds a "public" segment (a bridge in its own namespace) that public hosts and home
routers join, and home hosts that sit behind their own nftables masquerading router that drops
new inbound connections: the situation of a peer at home that nobody can dial. Every namespace
it makes is deleted by `Net.close()`, which the `net` fixture and `with Net(...)` always call.

Nothing here touches the root namespace's links, routes or firewall: veth pairs are created
directly inside the namespaces (`ip -n NS link add ... peer ... netns OTHER`).

A test module gets the `net` fixture with `from netns import net_fixture  # noqa: F401`
(conftest.py puts tests/ on sys.path); it is registered under the name "net", and exported
under another so that a test's `net` argument does not shadow an import (ruff F811). Tests
skip when namespaces cannot be made, unless CI or NEURONODE_REQUIRE_NETNS=1 is set: then they
fail, so CI cannot silently stop testing NAT.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import random
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn

import pytest

NETNS_DIR = Path("/var/run/netns")
CLONE_NEWNET = 0x40000000
COMMAND_TIMEOUT_S = 30.0
_NAME = re.compile(r"[a-z0-9]{1,12}\Z")
_SEQ = itertools.count()  # several Nets in one process get distinct namespace names

# A home router: masquerade LAN traffic out of "wan"; forward only LAN->WAN and the replies
# (conntrack established/related), so a new connection from the public side is dropped.
ROUTER_RULES = """
table ip nat {
    chain postrouting {
        type nat hook postrouting priority srcnat; policy accept;
        oifname "wan" masquerade
    }
}
table inet filter {
    chain forward {
        type filter hook forward priority filter; policy drop;
        ct state established,related accept
        iifname "lan" oifname "wan" accept
    }
}
"""


class NetnsError(RuntimeError):
    """A command that builds or tears down the network failed."""


class NetnsUnavailable(NetnsError):
    """This machine cannot make namespaces (not root, a tool missing, or the kernel refuses)."""


def _sh(*cmd: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one command with a deadline; on failure raise NetnsError carrying its stderr."""
    proc = subprocess.run(
        list(cmd), input=stdin, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
    )
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def missing() -> str | None:
    """Why namespaces cannot be made here, or None if the prerequisites are in place."""
    if os.geteuid() != 0:
        return "not running as root (network namespaces need CAP_SYS_ADMIN)"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install {package})"
    return None


def required() -> bool:
    """CI must run the NAT tests rather than skip them."""
    return bool(os.environ.get("CI")) or os.environ.get("NEURONODE_REQUIRE_NETNS") == "1"


def unavailable(reason: str) -> NoReturn:
    """Skip the test, or fail it where the harness is required."""
    if required():
        pytest.fail(f"netns harness required (CI / NEURONODE_REQUIRE_NETNS=1) but {reason}", pytrace=False)
    pytest.skip(f"netns harness unavailable: {reason}")


def list_namespaces() -> list[str]:
    """Names from `ip netns list` (its lines may carry an "(id: N)" suffix)."""
    return [line.split()[0] for line in _sh("ip", "netns", "list").stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    """Whether PID runs; a zombie (killed, not yet reaped) counts as dead."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _delete_namespace(ns: str) -> None:
    """Kill what still runs inside NS (it would keep the namespace and its veths alive), then
    delete it; the kernel then destroys its interfaces, and their veth peers, asynchronously."""
    pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    _sh("ip", "netns", "del", ns)


@dataclass
class Host:
    """One machine: a namespace with an address. For a home host, `public_ip` is its router's
    address, the one a public peer sees its connections come from."""

    name: str
    ns: str
    ip: str
    public_ip: str
    iface: str = "eth0"  # the outward interface, where cap_upload shapes
    lan: str | None = None  # a home host's LAN, e.g. "192.168.3.0/24"
    router: Host | None = None  # a home host's NAT router
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list, repr=False)

    def exec_prefix(self) -> list[str]:
        """Prefix a command line with this to run it inside the host."""
        return ["ip", "netns", "exec", self.ns]

    def run(
        self, *cmd: str, check: bool = True, timeout: float = COMMAND_TIMEOUT_S
    ) -> subprocess.CompletedProcess[str]:
        """Run CMD inside the host and wait for it (text output captured)."""
        proc = subprocess.run(
            [*self.exec_prefix(), *cmd], capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and proc.returncode != 0:
            raise NetnsError(f"[{self.name}] {' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def popen(self, *cmd: str, **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start CMD inside the host in the background; Net.close() kills it if still running."""
        proc: subprocess.Popen[bytes] = subprocess.Popen([*self.exec_prefix(), *cmd], **kwargs)
        self.procs.append(proc)
        return proc

    def enter(self) -> None:
        """Move the calling thread into this host's namespace (threads it starts later follow).

        Call it first thing in a freshly forked child, before it opens any socket: sockets
        opened earlier stay in the namespace they were made in. Python 3.11 has no os.setns.
        """
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(NETNS_DIR / self.ns, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                errno = ctypes.get_errno()
                raise OSError(errno, f"setns({self.ns}): {os.strerror(errno)}")
        finally:
            os.close(fd)

    def cap_upload(self, mbit: float, latency_ms: int = 50) -> None:
        """Shape what this host sends out to MBIT megabit/s with a token bucket (tbf; this
        kernel has no netem). The bucket holds ~5 ms of traffic, at least 16 KiB."""
        burst = max(16384, int(mbit * 1e6 / 8 * 0.005))
        self.run(
            "tc", "qdisc", "replace", "dev", self.iface, "root", "tbf",
            "rate", f"{mbit}mbit", "burst", str(burst), "latency", f"{latency_ms}ms",
        )  # fmt: skip


class Net:
    """A public segment plus the hosts and NAT routers a test adds to it.

    Namespaces are named nn-TAG-PID-SEQ-NAME (NAME-r for a home host's router, pub-bridge for
    the public segment). A new Net first deletes those of its TAG whose PID is dead (left by a
    crashed run), leaving live runs' namespaces alone.
    """

    def __init__(self, tag: str = "t") -> None:
        if not _NAME.match(tag):
            raise ValueError(f"tag must match {_NAME.pattern}: {tag!r}")
        self.tag = tag
        self.prefix = f"nn-{tag}-{os.getpid()}-{next(_SEQ)}-"
        self.subnet_octet = random.randint(16, 254)
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []
        self._ports = itertools.count(1)  # bridge ports v1, v2, ...; address 10.X.0.(port+1)
        self._lans = itertools.count(1)  # home LANs 192.168.1.0/24, 192.168.2.0/24, ...
        self._closed = False
        self.clean_stale(tag)
        try:
            self.bridge_ns = self._first_namespace()
            self._probe_nft()
            _sh("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def clean_stale(tag: str) -> list[str]:
        """Delete namespaces of TAG left by processes that are gone; return their names."""
        stale = []
        for ns in list_namespaces():
            parts = ns.split("-")  # nn, TAG, PID, SEQ, NAME...
            ours = len(parts) >= 5 and parts[:2] == ["nn", tag] and parts[2].isdigit()
            if ours and not _pid_alive(int(parts[2])):
                _delete_namespace(ns)
                stale.append(ns)
        return stale

    def _first_namespace(self) -> str:
        """The public segment's namespace; failing to make it means this machine cannot."""
        try:
            return self._add_namespace("pub-bridge")  # no host name has a "-"
        except NetnsError as exc:
            raise NetnsUnavailable(f"`ip netns add` failed: {exc}") from exc

    def _add_namespace(self, name: str) -> str:
        ns = self.prefix + name
        _sh("ip", "netns", "add", ns)
        self._namespaces.append(ns)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        return ns

    def _probe_nft(self) -> None:
        """nft may be installed while the kernel lacks nf_tables: find out before any test does."""
        try:
            _sh("ip", "netns", "exec", self.bridge_ns, "nft", "add table ip probe; delete table ip probe")
        except NetnsError as exc:
            raise NetnsUnavailable(f"nftables does not work in a namespace: {exc}") from exc

    def _public_address(self, port: int) -> str:
        if port > 250:
            raise NetnsError("the public /24 is full")
        return f"10.{self.subnet_octet}.0.{port + 1}"

    def _plug(self, ns: str, iface: str) -> str:
        """Connect NS to the bridge by a veth named IFACE inside NS; return the address it got."""
        port = next(self._ports)
        ip = self._public_address(port)
        peer = f"v{port}"
        _sh("ip", "-n", ns, "link", "add", iface, "type", "veth", "peer", "name", peer, "netns", self.bridge_ns)
        _sh("ip", "-n", self.bridge_ns, "link", "set", peer, "master", "br0", "up")
        _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", iface)
        _sh("ip", "-n", ns, "link", "set", iface, "up")
        return ip

    def _claim(self, name: str) -> None:
        if self._closed:
            raise NetnsError("this Net is closed")
        if not _NAME.match(name):
            raise ValueError(f"host name must match {_NAME.pattern}: {name!r}")
        if name in self.hosts:
            raise ValueError(f"host name already used: {name!r}")

    def public_host(self, name: str) -> Host:
        """A host with an address on the public segment that every other host can reach."""
        self._claim(name)
        ns = self._add_namespace(name)
        ip = self._plug(ns, "eth0")
        host = self.hosts[name] = Host(name=name, ns=ns, ip=ip, public_ip=ip)
        return host

    def home(self, name: str) -> Host:
        """A host on its own LAN behind a NAT router (host NAME-r) that masquerades
        its outbound traffic and forwards nothing new inbound, and no port forwarding."""
        self._claim(name)
        n = next(self._lans)
        if n > 254:
            raise NetnsError("out of home LANs")
        lan, router_lan_ip, host_ip = f"192.168.{n}.0/24", f"192.168.{n}.1", f"192.168.{n}.2"
        router_ns = self._add_namespace(f"{name}-r")
        public_ip = self._plug(router_ns, "wan")
        host_ns = self._add_namespace(name)
        _sh("ip", "-n", router_ns, "link", "add", "lan", "type", "veth", "peer", "name", "eth0", "netns", host_ns)
        _sh("ip", "-n", router_ns, "addr", "add", f"{router_lan_ip}/24", "dev", "lan")
        _sh("ip", "-n", router_ns, "link", "set", "lan", "up")
        _sh("ip", "-n", host_ns, "addr", "add", f"{host_ip}/24", "dev", "eth0")
        _sh("ip", "-n", host_ns, "link", "set", "eth0", "up")
        _sh("ip", "-n", host_ns, "route", "add", "default", "via", router_lan_ip)
        _sh("ip", "netns", "exec", router_ns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        _sh("ip", "netns", "exec", router_ns, "nft", "-f", "-", stdin=ROUTER_RULES)
        router = Host(name=f"{name}-r", ns=router_ns, ip=public_ip, public_ip=public_ip, iface="wan", lan=lan)
        host = Host(name=name, ns=host_ns, ip=host_ip, public_ip=public_ip, lan=lan, router=router)
        self.hosts[router.name] = router
        self.hosts[name] = host
        return host

    def close(self) -> None:
        """Kill the processes started in the hosts and delete every namespace this Net made
        (their veths go with them). Tries them all; raises afterwards if any failed."""
        self._closed = True
        for host in self.hosts.values():
            for proc in host.procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        errors = []
        while self._namespaces:
            ns = self._namespaces.pop()
            try:
                _delete_namespace(ns)
            except (NetnsError, subprocess.TimeoutExpired) as exc:
                errors.append(str(exc))
        if errors:
            raise NetnsError("cleanup failed: " + "; ".join(errors))

    def namespaces(self) -> list[str]:
        """The namespaces this Net made and has not deleted yet."""
        return list(self._namespaces)

    def __enter__(self) -> Net:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def open_net(tag: str = "t") -> Net:
    """A new Net, or skip (fail under CI / NEURONODE_REQUIRE_NETNS=1) naming what is missing."""
    reason = missing()
    if reason is not None:
        unavailable(reason)
    try:
        return Net(tag)
    except NetnsUnavailable as exc:
        unavailable(str(exc))


@pytest.fixture(name="net")
def net_fixture() -> Iterator[Net]:
    """A fresh Net for one test, closed afterwards whether the test passed or not."""
    with open_net() as network:
        yield network


CLONE_NEWNS = 0x00020000
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000


def private_hosts(path: Path) -> None:
    """Give the calling process a mount namespace of its own in which /etc/hosts is `path`, as
    `ip netns exec` does with /etc/netns/NAME/hosts: every name lookup it (and grpc) makes reads
    that file. Call it in a freshly forked child; nothing outside the child sees the mount (the
    namespace's mounts are made private first)."""
    libc = ctypes.CDLL(None, use_errno=True)
    steps = ((libc.unshare, (CLONE_NEWNS,), "unshare(CLONE_NEWNS)"),
             (libc.mount, (None, b"/", None, MS_REC | MS_PRIVATE, None), "making / private"),
             (libc.mount, (str(path).encode(), b"/etc/hosts", None, MS_BIND, None), f"binding {path} on /etc/hosts"))
    for call, args, what in steps:
        if call(*args) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")


def enter_namespace(ns: str) -> None:
    """Move the calling thread into namespace `ns` (see Host.enter; usable in a forked child)."""
    Host(name=ns, ns=ns, ip="", public_ip="").enter()
