"""A closed swarm keeps outsiders out, end to end (SECURITY.md).

Real `neuronode start` processes: a node with another secret, or a certificate from another
CA, never joins or gets averaged in. Real grpc.aio servers on 127.0.0.1:0: every RPC except
loopback Status refuses callers without a membership proof (UNAUTHENTICATED), a member may
not speak for another member or replay a contribution into another round (PERMISSION_DENIED),
and a member that keeps sending invalid streams is banned while the others carry on.
Protected mode: without a secret or TLS a node listens publicly only with --open.
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import helpers
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import (
    Node,
    chunks_of,
    encode,
    free_port,
    hides_refusal,
    key_of,
    non_loopback_ipv4,
    poll,
    run_neuronode,
)

from neuronode import cli
from neuronode.swarm.context import Settings
from neuronode.swarm.guard.proofs import Security
from neuronode.swarm.node import SwarmConfig, SwarmNode
from neuronode.swarm.wire import PROTOCOL_VERSION, settings_to_pb
from neuronode.v1 import node_pb2 as pb
from neuronode.v1 import node_pb2_grpc as pb_grpc

Code = grpc.StatusCode

# Tiny rounds on a tiny model: these tests are about who gets in, not about learning.
SMALL = ("--d-model", "64", "--n-layers", "2", "--seq-len", "64", "--batch-size", "8",
         "--inner-steps", "5", "--task-option", "corpus_mb=1")

# In-process nodes (real grpc.aio on 127.0.0.1:0)
SWARM = "closed-net-test"
MANIFEST = "c3" * 32
N_ELEMENTS = 4096
CHUNK_BYTES = 4096  # 1024 fp32 elements per chunk: 4 chunks
SECRET = b"correct horse battery staple 0123456789"
WRONG_SECRET = b"another swarm's secret, also long enough"
RPC_TIMEOUT_S = 10.0
METHODS = ("Hello", "PushContribution", "Leave", "FetchState", "CheckReachable")


# ---- helpers: processes ------------------------------------------------------------------------


def write_secret(path: Path, text: str) -> Path:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


def rounds_done(node: Node) -> list[tuple[int, int, list[str]]]:
    """(round, contributors, contributor ids) of every round_done event of the node."""
    return [(e["round"], len(e["contributors"]), e["contributors"]) for e in node.events("round_done")]


def wait_all(nodes: Iterable[Node], timeout_s: float) -> None:
    for node in nodes:
        assert node.wait(timeout_s) == 0, f"{node.name} failed:\n{node.log()}"


# ---- real processes: a wrong secret, a foreign CA ---------------------------------------------


@pytest.mark.swarm
@pytest.mark.timeout(600)
def test_wrong_secret_is_refused_by_every_member_and_never_averaged(tmp_path: Path) -> None:
    good = write_secret(tmp_path / "swarm.secret", "s1-" + "a" * 40)
    bad = write_secret(tmp_path / "other.secret", "s2-" + "b" * 40)
    # A's round-0 contribution reaches members that join later only while its push window
    # (--sync-timeout) is open: a long one leaves B and C ample time to start on a busy machine.
    member = ("--swarm-id", "closed", "--secret-file", str(good), "--rounds", "3",
              "--min-peers", "3", "--sync-timeout", "240", *SMALL)
    a = Node(tmp_path, "a", *member)
    b = Node(tmp_path, "b", *member, "--peers", a.address)
    c = Node(tmp_path, "c", *member, "--peers", a.address)
    x = Node(tmp_path, "x", "--swarm-id", "closed", "--secret-file", str(bad), "--rounds", "3",
             "--peers", f"{a.address},{b.address}", *SMALL)
    nodes = [a, b, c, x]
    try:
        a.start()
        # Loopback Status needs no proof (local health checks), even in a closed swarm. A waits
        # for two more members (--min-peers 3), so X is sure to find it serving and be refused.
        poll("a to serve", lambda: a.status(live=True), timeout_s=150)
        for node in (x, b, c):
            node.start()
        assert x.wait(120) == 2, x.log()[-3000:]  # refused by every bootstrap peer: it stops
        wait_all([a, b, c], 300)
    finally:
        for node in nodes:
            node.kill()

    members = [a.status(), b.status(), c.status()]
    x_id = x.status()["node_id"]
    assert len({s["param_digest"] for s in members}) == 1
    for node, s in zip((a, b, c), members, strict=True):
        assert s["round"] == 3 and s["last_round_contributors"] == 3, s
        assert x_id not in s["last_round_contributor_ids"]
        done = rounds_done(node)
        assert [r for r, _, _ in done] == [1, 2, 3], node.log()
        for _, count, ids in done:  # --min-peers 3: every round is the three members
            assert count == 3 and x_id not in ids, node.log()
    assert not rounds_done(x), x.log()  # it never trained alone
    # Members refused X's calls as unauthenticated (X lacks the swarm's secret), and X says so.
    assert any(e["code"] == "UNAUTHENTICATED" for e in x.events("refused_by")), x.log()
    assert "every bootstrap peer refused this node" in x.log(), x.log()[-3000:]


def make_ca(tmp: Path, name: str, swarm_id: str) -> Path:
    ca = tmp / name
    assert cli.main(["ca", "init", "--out", str(ca), "--swarm-id", swarm_id]) == 0
    return ca


def issue(ca: Path, out: Path, name: str) -> tuple[str, ...]:
    assert cli.main(["ca", "issue", "--ca", str(ca), "--out", str(out), "--name", name,
                     "--host", "127.0.0.1"]) == 0
    return ("--tls-cert", str(out / f"{name}.crt"), "--tls-key", str(out / f"{name}.key"),
            "--tls-ca", str(ca / "ca.crt"))


@pytest.mark.swarm
@pytest.mark.timeout(600)
def test_tls_swarm_admits_its_ca_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ca1, ca2 = make_ca(tmp_path, "ca1", "tls"), make_ca(tmp_path, "ca2", "tls")
    a_tls, b_tls = issue(ca1, tmp_path / "certs", "a"), issue(ca1, tmp_path / "certs", "b")
    x_tls = issue(ca2, tmp_path / "xcerts", "x")
    capsys.readouterr()  # what `ca` printed
    # B joins after the status checks; --sync-timeout leaves it ample time to get A's round 0.
    member = ("--swarm-id", "tls", "--rounds", "2", "--min-peers", "2", "--sync-timeout", "240",
              *SMALL)
    a = Node(tmp_path, "a", *member, *a_tls)
    b = Node(tmp_path, "b", *member, *b_tls, "--peers", a.address)
    x = Node(tmp_path, "x", "--swarm-id", "tls", "--rounds", "2", *SMALL, *x_tls,
             "--peers", a.address)
    nodes = [a, b, x]
    try:
        a.start()
        # A waits for a second contributor (--min-peers 2), so it stays up for the status checks.
        poll("a to answer a TLS status", lambda: run_neuronode(
            "status", "--peer", a.address, "--json", *a_tls).returncode == 0, timeout_s=150)
        plain = run_neuronode("status", "--peer", a.address, "--json", "--timeout", "3")
        assert plain.returncode == 1, plain
        assert plain.stdout == "" and len(plain.stderr.strip().splitlines()) == 1, plain.stderr
        assert plain.stderr.startswith("neuronode: no answer from"), plain.stderr
        x.start()
        b.start()
        wait_all(nodes, 300)
    finally:
        for node in nodes:
            node.kill()

    sa, sb, sx = a.status(), b.status(), x.status()
    assert sa["round"] == sb["round"] == 2
    assert sa["last_round_contributors"] == sb["last_round_contributors"] == 2
    assert sa["param_digest"] == sb["param_digest"]
    assert set(sa["last_round_contributor_ids"]) == {sa["node_id"], sb["node_id"]}
    assert sx["last_round_contributors"] == 1
    for node in (a, b):
        assert all(count == 2 and sx["node_id"] not in ids for _, count, ids in rounds_done(node))
    assert all(count == 1 for _, count, _ in rounds_done(x)), x.log()


# ---- real processes: protected mode ------------------------------------------------------------


@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_public_listen_needs_a_secret_tls_or_open(tmp_path: Path) -> None:
    port = free_port()
    refused = run_neuronode("start", "--data-dir", str(tmp_path / "refused"),
                      "--listen", f"0.0.0.0:{port}", *SMALL)
    assert refused.returncode == 2, refused
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, refused.stderr
    assert "--open" in lines[0] and "--secret-file" in lines[0]

    node = Node(tmp_path, "open", "--listen", f"0.0.0.0:{port}", "--open", *SMALL, port=port)
    try:
        node.start()
        assert poll("the --open node to serve", lambda: node.status(live=True), timeout_s=150)
        assert node.proc is not None
        node.proc.send_signal(signal.SIGTERM)
        assert node.wait(60) == 0, node.log()
    finally:
        node.kill()
    assert "--open" in node.log()  # the warning that anyone may join


# ---- in-process nodes: raw calls to a closed swarm ---------------------------------------------


def swarm_config(node_id: str, **overrides: Any) -> SwarmConfig:
    return helpers.swarm_config(node_id, swarm_id=SWARM, manifest_hash=MANIFEST, n_elements=N_ELEMENTS, **overrides)


def contribution(sender_id: str, *, round_id: int = 0, seed: int = 0,
                 secret: bytes = SECRET) -> list[pb.ContributionChunk]:
    """An honest fp32 contribution of `sender_id`, tagged with `secret` for `round_id`."""
    x = torch.randn(N_ELEMENTS, generator=torch.Generator().manual_seed(seed))
    return chunks_of(encode(sender_id, x, round_id=round_id, chunk_bytes=CHUNK_BYTES), swarm_id=SWARM, secret=secret)


class Member:
    """A raw client of the node under test, proving membership as `node_id` with `secret`
    (no secret: no proof at all)."""

    def __init__(self, channel: grpc.aio.Channel, node_id: str, advertise: str,
                 secret: bytes | None = SECRET) -> None:
        self.stub = pb_grpc.NodeStub(channel)
        self.node_id = node_id
        self.advertise = advertise
        self.security = Security(node_id=node_id, swarm_id=SWARM, secret=secret or b"", key=key_of(node_id))

    def info(self, node_id: str = "") -> pb.NodeInfo:
        return pb.NodeInfo(node_id=node_id or self.node_id, swarm_id=SWARM, settings=settings_to_pb(Settings()),
                           protocol_version=PROTOCOL_VERSION, manifest_hash=MANIFEST,
                           advertise=self.advertise)

    def hello(self, node_id: str = "") -> pb.HelloRequest:
        """A Hello as a member sends it: its content bound by the proof."""
        request = pb.HelloRequest(info=self.info(node_id))
        self.security.sign_hello(request)  # signed with our own key, whatever id it claims
        return request

    def signed(self, method: str, request: Any) -> Any:
        """`request` signed with our own key, whatever id it names, for the node under test."""
        return self.security.sign_request(method, request, "target")

    async def call(self, method: str, *, as_id: str = "",
                   chunks: list[pb.ContributionChunk] | None = None) -> tuple[Code, str]:
        """Call `method` speaking as `as_id` (default: ourselves); (status code, details)."""
        for _ in range(5):
            code, details = await self._call(method, as_id=as_id, chunks=chunks)
            if not (method == "PushContribution" and hides_refusal(code, details)):
                return code, details  # (otherwise: helpers.GRPC_EARLY_STATUS_BUG; send again)
        raise AssertionError("every push met grpc/grpc#36066")

    async def _call(self, method: str, *, as_id: str = "",
                    chunks: list[pb.ContributionChunk] | None = None) -> tuple[Code, str]:
        as_id = as_id or self.node_id
        kw: dict[str, Any] = {"timeout": RPC_TIMEOUT_S, "metadata": self.security.metadata(method)}
        try:
            if method == "Hello":
                await self.stub.Hello(self.hello(as_id), **kw)
            elif method == "PushContribution":
                await self.stub.PushContribution(stream(chunks or contribution(as_id)), **kw)
            elif method == "Leave":
                await self.stub.Leave(self.signed("Leave", pb.LeaveRequest(node_id=as_id, swarm_id=SWARM)), **kw)
            elif method == "FetchState":
                async for _ in self.stub.FetchState(self.signed("FetchState", pb.StateRequest(node_id=as_id,
                                                                                        swarm_id=SWARM)), **kw):
                    pass
            elif method == "CheckReachable":
                await self.stub.CheckReachable(self.signed("CheckReachable", pb.ReachRequest(node_id=as_id,
                                                                                               swarm_id=SWARM)), **kw)
            elif method == "Status":
                await self.stub.Status(pb.StatusRequest(), **kw)
            else:
                raise AssertionError(method)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
        return Code.OK, ""


async def stream(chunks: Iterable[pb.ContributionChunk]) -> AsyncIterator[pb.ContributionChunk]:
    for chunk in chunks:
        yield chunk


@pytest.fixture
async def closed_node() -> AsyncIterator[SwarmNode]:
    pool = ThreadPoolExecutor(2)
    node = SwarmNode(swarm_config("target"), executor=pool,
                     security=Security(node_id="target", swarm_id=SWARM, secret=SECRET))
    await node.start()
    try:
        yield node
    finally:
        await node.stop(grace_s=0.5)
        pool.shutdown(wait=True)


@pytest.fixture
async def channel(closed_node: SwarmNode) -> AsyncIterator[grpc.aio.Channel]:
    ch = grpc.aio.insecure_channel(closed_node.advertise)
    try:
        yield ch
    finally:
        await ch.close()


@pytest.mark.timeout(60)
async def test_calls_without_a_valid_proof_are_unauthenticated(
    closed_node: SwarmNode, channel: grpc.aio.Channel, refused_address: str,
) -> None:
    outsiders = {
        "no proof": Member(channel, "rogue", refused_address, secret=None),
        "wrong secret": Member(channel, "rogue", refused_address, secret=WRONG_SECRET),
    }
    for why, outsider in outsiders.items():
        for method in METHODS:
            code, details = await outsider.call(method)
            assert code == Code.UNAUTHENTICATED, (why, method, code, details)
            assert "secret" in details, details
    # A proof made for one method is no proof for another, nor for another swarm.
    member = Member(channel, "rogue", refused_address)
    hello_proof = member.security.metadata("Hello")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await member.stub.Leave(pb.LeaveRequest(node_id="rogue", swarm_id=SWARM),
                                metadata=hello_proof, timeout=RPC_TIMEOUT_S)
    assert refused.value.code() == Code.UNAUTHENTICATED
    other_swarm = Security(node_id="rogue", swarm_id="other", secret=SECRET).metadata("Hello")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await member.stub.Hello(member.hello(), metadata=other_swarm, timeout=RPC_TIMEOUT_S)
    assert refused.value.code() == Code.UNAUTHENTICATED

    assert closed_node.table.peers == {}  # nobody got in
    assert closed_node.book.contributors(0) == set()
    assert closed_node.counters.bytes_received == 0
    # A member's Hello rewritten on the way (another round, here) no longer matches its proof.
    member_proof = member.security.metadata("Hello")
    await member.stub.Hello(member.hello(), metadata=member_proof, timeout=RPC_TIMEOUT_S)  # as sent: fine
    rewritten = member.hello()
    rewritten.info.round = 99
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await member.stub.Hello(rewritten, metadata=member_proof, timeout=RPC_TIMEOUT_S)
    assert refused.value.code() == Code.UNAUTHENTICATED
    assert "does not match its proof" in (refused.value.details() or "")
    assert all(p.round != 99 for p in closed_node.table.peers.values())
    # Status from loopback needs no proof: local health checks keep working.
    status = await pb_grpc.NodeStub(channel).Status(pb.StatusRequest(), timeout=RPC_TIMEOUT_S)
    assert status.node_id == "target"
    assert await outsiders["wrong secret"].call("Status") == (Code.OK, "")


@pytest.mark.timeout(60)
async def test_a_member_cannot_speak_for_another_or_replay_into_another_round(
    closed_node: SwarmNode, channel: grpc.aio.Channel, refused_address: str,
) -> None:
    rogue = Member(channel, "rogue", refused_address)
    honest = Member(channel, "honest", refused_address)
    assert await rogue.call("Hello") == (Code.OK, "")
    assert await honest.call("Hello") == (Code.OK, "")

    code, details = await rogue.call("Hello", as_id="impostor")
    assert code == Code.PERMISSION_DENIED and "may not say hello as" in details, details
    code, details = await rogue.call("PushContribution", as_id="honest")
    assert code == Code.PERMISSION_DENIED and "may not send as" in details, details
    code, details = await rogue.call("Leave", as_id="honest")
    assert code == Code.PERMISSION_DENIED, details
    assert "honest" in {p.node_id for p in closed_node.table.alive()}

    # A contribution whose tag binds round 0, replayed as round 1.
    replayed = contribution("rogue", round_id=0)
    for chunk in replayed:
        chunk.round_id = 1
    code, details = await rogue.call("PushContribution", chunks=replayed)
    assert code == Code.PERMISSION_DENIED and "replayed" in details, details
    # Tagged with another secret: refused the same way.
    code, details = await rogue.call("PushContribution",
                                     chunks=contribution("rogue", secret=WRONG_SECRET))
    assert code == Code.PERMISSION_DENIED, details
    assert closed_node.book.contributors(0) == closed_node.book.contributors(1) == set()

    # The honest forms of the same calls go through.
    assert await rogue.call("PushContribution", chunks=contribution("rogue", round_id=0)) == (Code.OK, "")
    assert await honest.call("PushContribution") == (Code.OK, "")
    assert closed_node.book.contributors(0) == {"rogue", "honest"}
    assert closed_node.book.contributors(1) == set()


@pytest.mark.timeout(60)
async def test_member_sending_invalid_streams_is_banned_others_are_not(
    closed_node: SwarmNode, channel: grpc.aio.Channel, refused_address: str,
) -> None:
    rogue = Member(channel, "rogue", refused_address)
    honest = Member(channel, "honest", refused_address)
    assert await rogue.call("Hello") == (Code.OK, "")
    assert await honest.call("Hello") == (Code.OK, "")
    strikes = closed_node.ctx.bans.strikes_to_ban

    for _ in range(strikes):
        chunks = contribution("rogue")
        duplicated = [*chunks[:2], chunks[1], *chunks[2:]]
        code, details = await rogue.call("PushContribution", chunks=duplicated)
        assert code == Code.INVALID_ARGUMENT, details

    code, details = await rogue.call("PushContribution")  # an honest stream, but too late
    assert code == Code.PERMISSION_DENIED and "banned" in details, details
    code, details = await rogue.call("Hello")
    assert code == Code.PERMISSION_DENIED and "banned" in details, details
    assert "rogue" not in closed_node.book.contributors(0)

    assert await honest.call("Hello") == (Code.OK, "")
    assert await honest.call("PushContribution") == (Code.OK, "")
    assert closed_node.book.contributors(0) == {"honest"}
    status = await honest.stub.Status(pb.StatusRequest(), timeout=RPC_TIMEOUT_S)
    assert status.node_id == "target"


@pytest.mark.timeout(60)
async def test_protected_mode_admits_loopback_callers_only() -> None:
    host = non_loopback_ipv4()
    if host is None:
        pytest.skip("this machine has no non-loopback IPv4 address to call from")
    pool = ThreadPoolExecutor(1)
    node = SwarmNode(swarm_config("target", listen="0.0.0.0:0"), executor=pool)
    node.ctx.loopback_only = True  # what the daemon sets without --secret-file, TLS or --open
    await node.start()
    port = node.ctx.bound_port
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as local:
            status = await pb_grpc.NodeStub(local).Status(pb.StatusRequest(), timeout=RPC_TIMEOUT_S)
            assert status.node_id == "target"
        async with grpc.aio.insecure_channel(f"{host}:{port}") as remote:
            member = Member(remote, "far", f"{host}:1", secret=None)
            for method in ("Status", *METHODS):
                code, details = await member.call(method)
                assert code == Code.PERMISSION_DENIED and "loopback" in details, (method, details)
            # The standard health service is under the same rule (it answered anyone before).
            with pytest.raises(grpc.aio.AioRpcError) as health:
                await health_pb2_grpc.HealthStub(remote).Check(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT_S)
            assert health.value.code() == Code.PERMISSION_DENIED and "loopback" in (health.value.details() or "")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as local:
            answer = await health_pb2_grpc.HealthStub(local).Check(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT_S)
            assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING  # local health checks work
        assert node.table.peers == {}
    finally:
        await node.stop(grace_s=0.5)
        pool.shutdown(wait=True)


@pytest.mark.timeout(60)
async def test_tls_callers_speak_only_as_the_node_their_certificate_names(tmp_path: Path) -> None:
    """Mutual TLS binds ids: a member with b's certificate is refused (PERMISSION_DENIED) when it
    says Hello, pushes, leaves or asks for state as another node, and admitted as b."""
    ca = make_ca(tmp_path, "ca", SWARM)

    def files(name: str) -> tuple[str, str, str]:
        flags = issue(ca, tmp_path / "certs", name)
        return flags[1], flags[3], flags[5]

    pool = ThreadPoolExecutor(1)
    node = SwarmNode(swarm_config("a"), executor=pool,
                     security=Security(node_id="a", swarm_id=SWARM, tls_files=files("a")))
    await node.start()
    b = Security(node_id="b", swarm_id=SWARM, tls_files=files("b"))
    channel = b.channel(node.advertise)
    try:
        impostor = Member(channel, "c", "127.0.0.1:1", secret=None)
        for method in ("Hello", "PushContribution", "Leave", "FetchState", "CheckReachable"):
            code, details = await impostor.call(method)
            assert code == Code.PERMISSION_DENIED and "certificate is for node 'b'" in details, (method, details)
        assert "c" not in node.table.peers
        honest = Member(channel, "b", "127.0.0.1:1", secret=None)
        assert await honest.call("Hello") == (Code.OK, "")
        assert "b" in node.table.peers
        code, details = await honest.call("PushContribution", chunks=contribution("b", secret=b""))
        assert code == Code.OK, details
        assert node.book.contributors(0) == {"b"}
    finally:
        await channel.close()
        await node.stop(grace_s=0.5)
        pool.shutdown(wait=True)


def test_tls_node_id_is_its_certificates_name(tmp_path: Path) -> None:
    """A node with TLS takes its id from its certificate; a contradicting --node-id stops the
    start with one line (exit 2)."""
    ca = make_ca(tmp_path, "ca", "tls")
    b_tls = issue(ca, tmp_path / "certs", "b")
    out = run_neuronode("start", "--data-dir", str(tmp_path / "d"), "--swarm-id", "tls", "--node-id", "a",
                  *b_tls, *SMALL)
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--node-id a differs from the node named in --tls-cert (b)" in lines[0], lines


def test_hello_body_covers_every_field_a_hello_carries() -> None:
    """Changing any field of NodeInfo, of a RoundDigest in it, or of a listed peer changes the
    digest a Hello's tag binds. Walks the message descriptors, so a field added to the proto
    but forgotten in hello_body fails here."""
    from neuronode.swarm.guard.proofs import hello_body

    def changed(field: Any, value: Any) -> Any:
        if field.type == field.TYPE_STRING:
            return value + "x"
        if field.type == field.TYPE_BYTES:
            return value + b"x"
        if field.type == field.TYPE_BOOL:
            return not value
        return value + 1

    info = pb.NodeInfo(node_id="a", swarm_id=SWARM, protocol_version=1, manifest_hash="m",
                       advertise="127.0.0.1:1", round=3, param_digest="p", contributes_from=2)
    info.recent_digests.add(round=2, param_digest="q", contributors=4)
    statement = pb.Statement(sender_id="c", phase=pb.PHASE_UNSPECIFIED, lineage=b"l" * 32, body=b"b" * 32,
                             signature=b"s" * 64, public_key=b"k" * 32)
    for receipts in (info.receipts, info.disputed):
        receipts.add(round=2, phase=pb.PHASE_UNSPECIFIED, maker_id="a", statements=[statement], signature=b"r" * 64,
                     public_key=b"k" * 32)
    info.echoes.add(round=2, phase=pb.PHASE_UNSPECIFIED, maker_id="c", receipt_hash=b"h" * 32)
    info.wanted.add(round=2, phase=pb.PHASE_UNSPECIFIED, maker_id="c", receipt_hash=b"w" * 32)
    info.settings.aggregator = "mean"
    info.settings.task.add(name="hidden_size", value="64")
    known = [pb.PeerRecord(node_id="b", address="127.0.0.1:2")]
    base = hello_body(info, known)

    def fields_of(message: Any) -> list[tuple[Any, Any]]:
        """Every field of `message`, and of every message in it, at any depth (a repeated one
        has one element)."""
        out: list[tuple[Any, Any]] = []
        for field in message.DESCRIPTOR.fields:
            if field.message_type is not None:
                out += fields_of(getattr(message, field.name)[0] if field.is_repeated else getattr(message, field.name))
            else:
                out.append((message, field))
        return out

    targets = [(known[0], f) for f in pb.PeerRecord.DESCRIPTOR.fields] + fields_of(info)
    assert {f.name for _, f in targets} >= {"node_id", "round", "leaving", "contributes_from", "contributors",
                                            "statements", "body", "receipt_hash", "codec", "outer_lr", "overlap",
                                            "public_key"} - {"statements"}
    for message, field in targets:
        if field.is_repeated:  # a repeated scalar: one more element
            getattr(message, field.name).append("x" if field.type == field.TYPE_STRING else 7)
            assert hello_body(info, known) != base, f"hello_body ignores {message.DESCRIPTOR.name}.{field.name}"
            del getattr(message, field.name)[-1]
            continue
        old = getattr(message, field.name)
        setattr(message, field.name, changed(field, old))
        assert hello_body(info, known) != base, f"hello_body ignores {message.DESCRIPTOR.name}.{field.name}"
        setattr(message, field.name, old)
    assert hello_body(info, known) == base
