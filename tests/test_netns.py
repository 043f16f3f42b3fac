"""The netns harness builds the network it promises: public hosts reach each other, home hosts
reach out through a masquerading router, and nothing reaches in. Plain sockets only, so a
failure here is the harness's, not neuronode's. Servers run in forked children that `enter()`
a host; clients run through `ip netns exec`, so both ways of starting a process are exercised."""

from __future__ import annotations

import multiprocessing
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection

import pytest
from netns import Host, Net, list_namespaces, net_fixture, open_net  # noqa: F401  (net_fixture)

FORK = multiprocessing.get_context("fork")
ACCEPT_S = 10.0  # how long a server waits for its one connection
BLOCKED_S = 1.0  # a connection the NAT drops must not succeed within this

# A client: connect, then report "ok <local address>" or "fail <error class>".
CONNECT = """
import socket, sys
try:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
    print("ok", s.getsockname()[0])
except OSError as e:
    print("fail", type(e).__name__)
"""

# A client that uploads N bytes and prints the seconds until the server has read them all.
UPLOAD = """
import socket, sys, time
n = int(sys.argv[3])
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
start = time.monotonic()
s.sendall(bytes(n))
s.shutdown(socket.SHUT_WR)
s.recv(1)  # the server closes after reading everything
print(time.monotonic() - start)
"""


def _serve_once(host: Host, pipe: Connection) -> None:
    """Child body: enter HOST, listen on all its addresses, report the port, then the address
    of the one peer that connects (None if nobody does), having read its bytes to EOF."""
    host.enter()
    with socket.create_server(("0.0.0.0", 0)) as server:
        pipe.send(server.getsockname()[1])
        server.settimeout(ACCEPT_S)
        try:
            conn, (peer, _) = server.accept()
        except TimeoutError:
            pipe.send(None)
            return
        with conn:
            while conn.recv(1 << 16):
                pass
        pipe.send(peer)


class Server:
    """A listener inside a host, started by forking and entering the host's namespace."""

    def __init__(self, pipe: Connection) -> None:
        self.pipe = pipe
        if not pipe.poll(ACCEPT_S):
            raise TimeoutError("the server never reported its port")
        self.port: int = pipe.recv()

    def peer(self, timeout: float = ACCEPT_S) -> str | None:
        """The address the server saw its connection come from, or None if there was none."""
        return self.pipe.recv() if self.pipe.poll(timeout) else None


@contextmanager
def serving(host: Host) -> Iterator[Server]:
    parent, child = FORK.Pipe()
    process = FORK.Process(target=_serve_once, args=(host, child), daemon=True)
    process.start()
    try:
        yield Server(parent)
    finally:
        process.kill()
        process.join()


def connect(host: Host, ip: str, port: int, timeout: float = ACCEPT_S) -> str:
    """Try one TCP connection from HOST; "ok <local ip>" or "fail <error class>"."""
    return host.run(sys.executable, "-c", CONNECT, ip, str(port), str(timeout)).stdout.strip()


@pytest.mark.timeout(60)
def test_public_hosts_reach_each_other(net: Net) -> None:
    """The public segment is a plain LAN: anyone on it can dial anyone, seen as themselves."""
    a, b = net.public_host("a"), net.public_host("b")
    with serving(b) as server:
        assert connect(a, b.ip, server.port) == f"ok {a.ip}"
        assert server.peer() == a.ip


@pytest.mark.timeout(60)
def test_home_host_reaches_out_through_nat(net: Net) -> None:
    """Outbound works and is masqueraded: the peer sees the router's address, not the LAN one."""
    public, home = net.public_host("pub"), net.home("home")
    with serving(public) as server:
        assert connect(home, public.ip, server.port) == f"ok {home.ip}"
        observed = server.peer()
    print(f"home {home.ip} connected; the public host saw {observed} (router {home.public_ip})")
    assert observed == home.public_ip != home.ip


@pytest.mark.timeout(60)
def test_public_host_cannot_reach_in(net: Net) -> None:
    """Nothing is port-forwarded, so a home host is undialable from outside, as a real one is."""
    public, home = net.public_host("pub"), net.home("home")
    assert home.lan is not None
    # The strongest attempt: a route to the LAN via the router, so only its firewall stops us.
    public.run("ip", "route", "add", home.lan, "via", home.public_ip)
    with serving(home) as server:
        assert connect(public, home.ip, server.port, BLOCKED_S) == "fail TimeoutError"
        assert connect(public, home.public_ip, server.port, BLOCKED_S) == "fail ConnectionRefusedError"
        assert server.peer(timeout=0) is None
        # The same server is reachable from its own LAN side, so the failures were the NAT's.
        assert home.router is not None
        assert connect(home.router, home.ip, server.port).startswith("ok")


@pytest.mark.timeout(60)
def test_home_hosts_cannot_reach_each_other(net: Net) -> None:
    """Two NATed peers cannot dial each other directly: what relaying/hole punching must solve.
    (bob's LAN address fails fast: alice's router has no route to it and answers unreachable.)"""
    alice, bob = net.home("alice"), net.home("bob")
    with serving(bob) as server:
        assert connect(alice, bob.public_ip, server.port, BLOCKED_S) == "fail ConnectionRefusedError"
        assert connect(alice, bob.ip, server.port, BLOCKED_S).startswith("fail")
        assert server.peer(timeout=0) is None


@pytest.mark.timeout(60)
def test_upload_cap_limits_throughput(net: Net) -> None:
    """cap_upload makes a slow uplink: a transfer cannot beat the configured rate."""
    sender, receiver = net.public_host("tx"), net.public_host("rx")
    mbit, size = 16, 1_000_000  # 0.5 s at the cap
    sender.cap_upload(mbit)
    with serving(receiver) as server:
        out = sender.run(sys.executable, "-c", UPLOAD, receiver.ip, str(server.port), str(size))
        assert server.peer() == sender.ip
    elapsed, expected = float(out.stdout), size * 8 / (mbit * 1e6)
    print(f"{size} bytes at {mbit} mbit took {elapsed:.2f} s (expected {expected:.2f} s)")
    assert 0.8 * expected < elapsed < 10 * expected


@pytest.mark.timeout(60)
def test_close_removes_every_namespace() -> None:
    """Nothing outlives a Net, also when the code using it raised."""
    with open_net() as built:
        built.public_host("a")
        built.home("h")
        made = built.namespaces()
    assert len(made) == 4 and not set(made) & set(list_namespaces())

    with pytest.raises(RuntimeError, match="test body failed"), open_net() as failing:
        failing.home("h")
        made = failing.namespaces()
        raise RuntimeError("test body failed")
    assert made and not set(made) & set(list_namespaces())


@pytest.mark.timeout(60)
def test_enter_moves_a_forked_child(net: Net) -> None:
    """A child that enter()s a host sees only that host's interfaces."""
    host = net.public_host("a")
    parent, child = FORK.Pipe()

    def body() -> None:
        host.enter()
        child.send(sorted(name for _, name in socket.if_nameindex()))

    process = FORK.Process(target=body, daemon=True)
    process.start()
    assert parent.poll(ACCEPT_S) and parent.recv() == ["eth0", "lo"]
    process.join()


@pytest.mark.timeout(60)
def test_stale_namespaces_of_a_dead_run_are_cleaned() -> None:
    """A crashed run leaves nn-TAG-PID-...; the next Net of that TAG removes them."""
    open_net().close()  # skips here if namespaces are unavailable
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftover = f"nn-stale-{dead.pid}-0-a"
    subprocess.run(["ip", "netns", "add", leftover], check=True)
    try:
        with Net("stale"):
            assert leftover not in list_namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", leftover], capture_output=True, check=False)

