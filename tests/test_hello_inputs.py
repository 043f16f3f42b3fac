"""What a Hello may carry, and what it may not do: a replayed older Hello moves nobody back, an
answer with an echo of an unknown phase is refused like any bad answer (it does not end the
heartbeat), the thousands of signatures a Hello may carry are checked off the event loop, and
the peers a Hello lists are dialed only when they are worth dialing. Real SwarmNodes on
127.0.0.1:0 and raw grpc.aio peers."""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import pytest
import torch
from helpers import Nodes, encode, key_of

from neuronode.averaging.agreement import Receipt, statement_of
from neuronode.clock import ManualClock
from neuronode.codec import Phase
from neuronode.security import identity
from neuronode.swarm.context import Settings
from neuronode.swarm.guard.proofs import Security, hello_body
from neuronode.swarm.membership.table import MAX_GOSSIPED, PeerTable, gossiped_address_ok
from neuronode.swarm.receipts.wire import receipt_to_pb
from neuronode.swarm.wire import PROTOCOL_VERSION, settings_to_pb
from neuronode.v1 import node_pb2 as pb
from neuronode.v1 import node_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)

N = 10_000
MEMBER = "m"


def hello_at(node: Any, timestamp_s: int, *, round_id: int, leaving: bool = False, advertise: str,
             receipts: list[Receipt] = ()) -> pb.HelloRequest:  # type: ignore[assignment]
    """MEMBER's Hello as it signed it at `timestamp_s` (what a replay replays)."""
    security = Security(node_id=MEMBER, swarm_id=node.cfg.swarm_id, key=key_of(MEMBER))
    info = pb.NodeInfo(node_id=MEMBER, swarm_id=node.cfg.swarm_id, protocol_version=PROTOCOL_VERSION,
                       manifest_hash=node.cfg.manifest_hash, advertise=advertise, round=round_id, leaving=leaving,
                       settings=settings_to_pb(Settings()), public_key=key_of(MEMBER).public)
    for r in receipts:
        signed = Receipt(r.round_id, r.phase, r.maker, r.statements, public_key=key_of(MEMBER).public)
        info.receipts.append(receipt_to_pb(Receipt(r.round_id, r.phase, r.maker, r.statements,
                                                   signature=security.sign_receipt(signed),
                                                   public_key=key_of(MEMBER).public)))
    request = pb.HelloRequest(info=info, timestamp_s=timestamp_s)
    request.signature = key_of(MEMBER).sign("hello", node.cfg.swarm_id, MEMBER, timestamp_s,
                                            hello_body(request.info, request.known_peers))
    return request


async def say(node: Any, request: pb.HelloRequest) -> None:
    async with grpc.aio.insecure_channel(node.advertise) as channel:
        await pb_grpc.NodeStub(channel).Hello(request, timeout=10)


async def test_a_replayed_older_hello_neither_rolls_a_member_back_nor_revives_it(
        nodes: Nodes, refused_address: str) -> None:
    """m says round 5, then round 6; its first Hello, replayed (within the signature's 300 s),
    leaves it at round 6. m leaves; its round-6 Hello, replayed, does not make it alive again.
    Before, the table took whatever came last."""
    node = await nodes.start("target", n_elements=N)
    now = int(time.time())
    older = hello_at(node, now - 10, round_id=5, advertise=refused_address)
    await say(node, older)
    newer = hello_at(node, now - 5, round_id=6, advertise=refused_address)
    await say(node, newer)
    await say(node, older)  # the replay
    assert node.table.peers[MEMBER].round == 6
    await say(node, hello_at(node, now - 2, round_id=6, leaving=True, advertise=refused_address))
    assert MEMBER not in {p.node_id for p in node.table.alive()}
    await say(node, newer)  # the replay of a Hello from before it left
    assert MEMBER not in {p.node_id for p in node.table.alive()}
    await say(node, hello_at(node, now, round_id=6, advertise=refused_address))  # it came back: a new Hello
    assert MEMBER in {p.node_id for p in node.table.alive()}


async def test_the_signatures_a_hello_carries_are_checked_off_the_event_loop(
        nodes: Nodes, refused_address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Hello with a receipt listing 64 statements: 66 signatures (the Hello's, the receipt's,
    the statements'). Every one is verified in a worker thread, none on the event loop (before,
    all of them were, up to 6 x 1024 a Hello)."""
    node = await nodes.start("target", n_elements=N)
    loop_thread = threading.get_ident()
    on_loop: list[str] = []
    checked: list[str] = []
    verify = identity.verify

    def watched(public_key: bytes, signature: bytes, domain: str, *fields: object) -> None:
        (on_loop if threading.get_ident() == loop_thread else checked).append(domain)
        verify(public_key, signature, domain, *fields)

    monkeypatch.setattr(identity, "verify", watched)
    held = []
    for i in range(64):  # senders whose ids their keys prove: every statement is checked
        key = key_of(f"s{i}")
        c = encode(key.derived_id, torch.full((N,), float(i)), round_id=1)
        c.signature = Security(node_id=c.sender_id, swarm_id=node.cfg.swarm_id, key=key).sign_statement(statement_of(c))
        c.public_key = key.public
        held.append(statement_of(c))
    receipt = Receipt(1, Phase.WHOLE, MEMBER, tuple(sorted(held, key=lambda s: s.slot)))
    await say(node, hello_at(node, int(time.time()), round_id=1, advertise=refused_address, receipts=[receipt]))
    assert MEMBER in node.table.peers
    assert on_loop == [], on_loop
    assert checked.count("contribution") == 64 and "hello" in checked and "receipt" in checked


async def test_an_answer_with_an_echo_of_an_unknown_phase_is_refused_and_heartbeats_go_on(
        nodes: Nodes, refused_address: str) -> None:
    """A peer answers Hello with an echo of phase 7: its answer is refused like any malformed
    one, and the caller goes on (before, the ValueError escaped and ended the heartbeat)."""
    node = await nodes.start("target", n_elements=N)
    server = grpc.aio.server()
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"

    class Odd(pb_grpc.NodeServicer):
        async def Hello(self, request: pb.HelloRequest, context: Any) -> pb.HelloResponse:  # noqa: N802
            answer = pb.HelloResponse(info=pb.NodeInfo(
                node_id=MEMBER, swarm_id=request.info.swarm_id, protocol_version=PROTOCOL_VERSION,
                manifest_hash=request.info.manifest_hash, advertise=address, settings=request.info.settings,
                echoes=[pb.ReceiptEcho(round=1, phase=7, maker_id="x", receipt_hash=bytes(32))]))  # type: ignore[arg-type]
            Security(node_id=MEMBER, swarm_id=request.info.swarm_id, key=key_of(MEMBER)).sign_hello(answer)
            return answer

    pb_grpc.add_NodeServicer_to_server(Odd(), server)
    await server.start()
    try:
        assert await node.peers.hello(address) is False  # what a heartbeat does with each target
        assert MEMBER not in node.table.peers
        assert not node.ctx.tasks.named("heartbeats")[0].done()
    finally:
        await server.stop(0)


@pytest.mark.parametrize(("address", "remote_ok", "local_ok"), [
    ("198.51.100.7:7420", True, True),
    ("node-1.example.org:7420", False, False),  # a name is resolved first, to the IP then checked (tests/test_hosts.py)
    ("198.51.100.007:7420", False, False),  # so is an IP spelled otherwise
    ("[2001:db8::5]:7420", True, True),
    ("127.0.0.1:7420", False, True),
    ("localhost:22", False, False),
    ("[::1]:7420", False, True),
    ("0.0.0.0:7420", False, True),
    ("224.0.0.1:7420", False, True),
    ("169.254.1.1:7420", False, True),
    ("198.51.100.7:0", False, False),
    ("198.51.100.7", False, False),
    ("bad host:7420", False, False),
])
def test_a_gossiped_address_is_dialed_only_when_worth_dialing(address: str, remote_ok: bool, local_ok: bool) -> None:
    """A listed peer on this machine's loopback, or an unspecified, multicast or link-local one,
    is dialed only by a node that is itself on loopback (a swarm on one machine); only an IP in
    its one spelling is dialed (names and other spellings are resolved to one first)."""
    assert gossiped_address_ok(address, local=False) is remote_ok
    assert gossiped_address_ok(address, local=True) is local_ok


def test_one_message_adds_a_bounded_number_of_gossiped_addresses() -> None:
    table = PeerTable(self_id="me", dead_after_s=5.0, clock=ManualClock())
    listed = [f"198.51.100.{i}:7420" for i in range(200)] + ["127.0.0.1:1"]
    assert table.add_gossiped(listed, local=False, cap=1024) == MAX_GOSSIPED
    assert len(table.addresses) == MAX_GOSSIPED and "127.0.0.1:1" not in table.addresses
    assert table.add_gossiped(listed, local=False, cap=20) == 20 - MAX_GOSSIPED  # the cap on all known
