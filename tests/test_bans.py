"""The node's one ban list (neuronode.swarm.guard.bans): strikes, backoff and outright bans on the
injected clock; and on the wire, bans fall on what a call's connection proves (its host, or its
certificate), never on an id a caller writes into its metadata."""

from __future__ import annotations

from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from helpers import key_of, non_loopback_ipv4, swarm_config

from neuronode.clock import ManualClock
from neuronode.swarm.context import Settings
from neuronode.swarm.guard.bans import Bans, host_key, node_key
from neuronode.swarm.guard.proofs import Security
from neuronode.swarm.membership.table import PeerTable
from neuronode.swarm.node import SwarmNode
from neuronode.swarm.wire import PROTOCOL_VERSION, settings_to_pb
from neuronode.v1 import node_pb2 as pb
from neuronode.v1 import node_pb2_grpc as pb_grpc

SWARM = "bans-test"
SECRET = b"the swarm's shared secret, 32 bytes or so"


def test_ban_after_strikes_and_backoff() -> None:
    clock = ManualClock()
    bans = Bans(clock=clock, strikes_to_ban=3, window_s=10, first_ban_s=30, max_ban_s=100)
    bans.strike("x")
    bans.strike("x")
    assert bans.banned_for("x") == 0
    assert bans.strike("x")
    assert bans.banned_for("x") == 30 and "repeated invalid input" in bans.refusal("x")
    assert bans.banned_for("y") == 0 and bans.refusal("y") == ""
    clock.advance(31)
    assert bans.banned_for("x") == 0
    for _ in range(3):
        bans.strike("x")
    assert bans.banned_for("x") == 60  # doubled
    clock.advance(61)
    for _ in range(3):
        bans.strike("x")
    assert bans.banned_for("x") == 100  # capped


def test_strikes_outside_window_do_not_count() -> None:
    clock = ManualClock()
    bans = Bans(clock=clock, strikes_to_ban=3, window_s=10)
    for _ in range(5):
        bans.strike("x")
        clock.advance(6)
    assert bans.banned_for("x") == 0


def test_a_proven_liar_is_banned_in_the_same_list_the_peer_table_reads() -> None:
    """One ban list: the table's equivocation bans are records of the node's Bans, on its clock."""
    clock = ManualClock()
    bans = Bans(clock=clock)
    table = PeerTable(self_id="me", dead_after_s=5.0, clock=clock, bans=bans)
    assert table.ban("liar", 3600.0) and not table.ban("liar", 10.0)  # new, then already banned
    assert bans.banned_for(node_key("liar")) == 3600.0 == table.banned_for("liar")
    assert "two different versions" in bans.refusal(node_key("liar"))
    clock.advance(3600.0)
    assert table.banned_for("liar") == 0


# ---- on the wire ---------------------------------------------------------------------------------


class Caller:
    """A raw client whose calls prove membership as `as_id` (the secret lets anyone do that) and
    whose Hellos are signed with `signer`'s key."""

    def __init__(self, channel: grpc.aio.Channel, *, as_id: str, signer: str, advertise: str) -> None:
        self.stub = pb_grpc.NodeStub(channel)
        self.as_id = as_id
        self.advertise = advertise
        self.security = Security(node_id=as_id, swarm_id=SWARM, secret=SECRET, key=key_of(signer))

    async def hello(self) -> tuple[grpc.StatusCode, str]:
        info = pb.NodeInfo(node_id=self.as_id, swarm_id=SWARM, settings=settings_to_pb(Settings()),
                           protocol_version=PROTOCOL_VERSION, manifest_hash="a1" * 32, advertise=self.advertise)
        request = pb.HelloRequest(info=info)
        self.security.sign_hello(request)
        try:
            await self.stub.Hello(request, timeout=10, metadata=self.security.metadata("Hello"))
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
        return grpc.StatusCode.OK, ""


@pytest.fixture
async def closed_node() -> AsyncIterator[SwarmNode]:
    """A closed node listening on every address, so that a caller can reach it from this
    machine's non-loopback address as well as from loopback."""
    pool = ThreadPoolExecutor(2)
    node = SwarmNode(swarm_config("target", swarm_id=SWARM, listen="0.0.0.0:0", advertise="127.0.0.1:0"),
                     executor=pool, security=Security(node_id="target", swarm_id=SWARM, secret=SECRET,
                                                      key=key_of("target")))
    await node.start()
    try:
        yield node
    finally:
        await node.stop(grace_s=0.5)
        pool.shutdown(wait=True)


@pytest.mark.timeout(60)
async def test_a_forged_ban_bans_nobody_but_the_sender(closed_node: SwarmNode, refused_address: str) -> None:
    """A member (the framer) sends Hellos under another member's id, proving that id with the
    swarm's secret as anyone can, signed with its own key: each is refused (the id is bound to
    the victim's key), and the strikes fall on the framer's host. The framer is banned; the
    victim, calling from elsewhere, is not (before, the strikes fell on the id in the metadata,
    and five of them banned the victim for its every call)."""
    host = non_loopback_ipv4()
    if host is None:
        pytest.skip("this machine has no non-loopback IPv4 address to call from")
    port = closed_node.ctx.bound_port
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as local, \
            grpc.aio.insecure_channel(f"{host}:{port}") as remote:
        victim = Caller(local, as_id="victim", signer="victim", advertise=refused_address)
        framer = Caller(remote, as_id="victim", signer="framer", advertise=refused_address)
        assert await victim.hello() == (grpc.StatusCode.OK, "")
        strikes = closed_node.ctx.bans.strikes_to_ban
        for _ in range(strikes):
            code, details = await framer.hello()
            assert code == grpc.StatusCode.PERMISSION_DENIED and "bound to another key" in details, details
        code, details = await framer.hello()
        assert code == grpc.StatusCode.PERMISSION_DENIED and "banned" in details, details
        assert closed_node.ctx.bans.banned_for(host_key(host)) > 0
        assert closed_node.ctx.bans.banned_for(node_key("victim")) == 0
        assert await victim.hello() == (grpc.StatusCode.OK, "")
        assert "victim" in {p.node_id for p in closed_node.table.alive()}
