"""Signed requests are good once, at the node they were made for (issue 26, item 6).

A signed request (Leave, FetchState, FetchContribution, CheckReachable, Session) names its
callee and carries a nonce under its signature; the callee refuses one made for another node,
and one it accepted already (PERMISSION_DENIED). Before, a request replayed for 300 s anywhere:
whoever received a member's request (the node it was sent to) could replay it at other members,
or at itself again, and take the member's session, its state-transfer and fetch slots, its
dial-back, or announce its leave.

Real SwarmNodes on 127.0.0.1:0. Each request is captured from an honest exchange (the calls a
member's own code makes), then replayed with a raw grpc.aio client, as its receiver could."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest
import torch
from adversary import state
from helpers import Nodes, encode, wait_until

from neuronode.averaging.agreement import statement_of
from neuronode.clock import ManualClock
from neuronode.codec import Phase
from neuronode.swarm.node import SwarmNode
from neuronode.swarm.wire import Refusal
from neuronode.v1 import node_pb2 as pb
from neuronode.v1 import node_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(180)

Code = grpc.StatusCode
N = 20_000
BIG = 2_000_000  # 8 MB and more: far more than HTTP/2 lets a server write ahead of a reader that reads nothing


def alive_ids(node: SwarmNode) -> set[str]:
    return {p.node_id for p in node.table.alive()}


async def trio(nodes: Nodes, n_elements: int = N) -> tuple[SwarmNode, SwarmNode, SwarmNode]:
    """Members y and z, and x, the member whose requests get replayed; all know each other.
    Reachable by flag: nobody asks for a dial-back but the test."""
    y = await nodes.start("y", n_elements=n_elements, reachable="yes")
    z = await nodes.start("z", peers=[y.advertise], n_elements=n_elements, reachable="yes")
    x = await nodes.start("x", peers=[y.advertise], n_elements=n_elements, reachable="yes")
    for node, others in ((x, {"y", "z"}), (y, {"x", "z"}), (z, {"x", "y"})):
        await wait_until(lambda n=node, o=others: alive_ids(n) >= o, what=f"{node.cfg.node_id} to know {others}")
    return x, y, z


def capture(node: SwarmNode, name: str) -> list[tuple[str, Any]]:
    """Every (callee, request) `node` sends through its links' `name` ("fetch", "call"): what
    each callee receives, byte for byte, on a connection without TLS."""
    sent: list[tuple[str, Any]] = []
    original = getattr(node.links, name)

    async def recording(peer_id: str, method: str, request: Any, **kw: Any) -> Any:
        copy = type(request)()
        copy.CopyFrom(request)
        sent.append((peer_id, copy))
        return await original(peer_id, method, request, **kw)

    setattr(node.links, name, recording)
    return sent


async def unary(node: SwarmNode, method: str, request: Any) -> tuple[Code, str]:
    """Send `request` to `node` as its receiver replays it: the (status code, details)."""
    async with grpc.aio.insecure_channel(node.advertise) as channel:
        try:
            await getattr(pb_grpc.NodeStub(channel), method)(request, timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
    return Code.OK, ""


class Held:
    """Server streams a replayer opens and then stops reading (each one holds whatever slot it
    was given); `first` is what each answered first: a status code, or OK once a message came."""

    def __init__(self, node: SwarmNode, method: str) -> None:
        # No BDP probing: the receive window stays 64 KiB, so the server's writes block at once.
        self.channel = grpc.aio.insecure_channel(node.advertise, options=[("grpc.http2.bdp_probe", 0)])
        self.call = getattr(pb_grpc.NodeStub(self.channel), method)
        self.calls: list[Any] = []

    async def open(self, request: Any) -> tuple[Code, str]:
        call = self.call(request, timeout=60)
        self.calls.append(call)
        try:
            await call.read()
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
        return Code.OK, ""

    async def close(self) -> None:
        for call in self.calls:
            call.cancel()
        await self.channel.close()


def refused_elsewhere(answer: tuple[Code, str], made_for: str) -> None:
    code, details = answer
    assert code == Code.PERMISSION_DENIED and f"signed for node {made_for!r}" in details, answer


def refused_again(answer: tuple[Code, str]) -> None:
    code, details = answer
    assert code == Code.PERMISSION_DENIED and "used here already" in details, answer


async def test_a_state_request_replayed_at_another_donor_or_again_is_refused_and_takes_no_slot(nodes: Nodes) -> None:
    """x downloads the state from y; y replays x's request at z (holding the transfer without
    reading: x's one slot there), and at itself again. Before, both were served, and x's own
    download from z was refused: "a state transfer to you is already in flight"."""
    x, y, z = await trio(nodes, BIG)
    for donor in (y, z):
        donor.donor.provider = lambda: state(torch.randn(BIG, generator=torch.Generator().manual_seed(3)),
                                             round_id=3, momentum=torch.zeros(BIG))
        donor.state.adopted(3, donor.donor.provider().param_digest, listen=False)
    x.fetcher.vouched = lambda *args: None  # no other member publishes a digest here
    sent = capture(x, "fetch")
    got = await x.fetch_state(["y"])
    assert got is not None and got.round == 3
    requests = [(c, r) for c, r in sent if isinstance(r, pb.StateRequest)]
    assert {c for c, _ in requests} == {"y"}
    _, request = requests[-1]  # a share of chunks (the first asked for the header only)
    held = Held(z, "FetchState")
    try:
        refused_elsewhere(await held.open(request), "y")
        assert z.donor.active == {}  # x's slot at z is free
        got = await x.fetch_state(["z"])
        assert got is not None and got.round == 3  # x's own request is served
        refused_again(await Held(y, "FetchState").open(request))
    finally:
        await held.close()


async def test_a_contribution_request_replayed_at_another_holder_or_again_is_refused_and_takes_no_slot(
    nodes: Nodes,
) -> None:
    """x fetches a contribution it missed from y; y replays x's request at z twice (x's two
    fetch slots there, held by not reading) and at itself. Before, all were served, and x's own
    fetch from z was refused (RESOURCE_EXHAUSTED): it could not get what it missed."""
    x, y, z = await trio(nodes, BIG)
    c = encode("y", torch.randn(BIG, generator=torch.Generator().manual_seed(1)), round_id=2)
    y.transport.sign(c)
    for holder in (y, z):
        holder.transport.missed.retain(2, Phase.WHOLE, [c], for_s=600)
    sent = capture(x, "fetch")
    got = await x.transport.missed.fetch(statement_of(c), ["y"], timeout_s=30)
    assert got is not None and got.digest == c.digest
    [(callee, request)] = [(h, r) for h, r in sent if isinstance(r, pb.ContributionRequest)]
    assert callee == "y"
    held = Held(z, "FetchContribution")
    try:
        for _ in range(2):
            refused_elsewhere(await held.open(request), "y")
        assert z.transport.missed.serving == {}
        got = await x.transport.missed.fetch(statement_of(c), ["z"], timeout_s=30)
        assert got is not None and got.digest == c.digest  # x's own request is served
        refused_again(await Held(y, "FetchContribution").open(request))
        # Its content is signed too: the same request for another contribution is no request.
        other = type(request)()
        other.CopyFrom(request)
        other.round_id += 1
        code, details = await Held(y, "FetchContribution").open(other)
        assert code == Code.PERMISSION_DENIED and "signed by that node's key only" in details, details
    finally:
        await held.close()


async def test_a_session_request_replayed_at_another_carrier_or_again_takes_over_nothing(nodes: Nodes) -> None:
    """x (peers cannot dial it) holds sessions to y and z. y replays x's SessionRequest at z and
    at itself. Before, each replay was carried ("a second replaces the first"): x's session
    there ended, and what z sends x went to y."""
    y = await nodes.start("y", n_elements=N)
    z = await nodes.start("z", peers=[y.advertise], n_elements=N)
    received: list[pb.SessionRequest] = []
    admit = y.sessions.admit

    def recording(request: pb.SessionRequest, proven_id: str) -> Any:
        copy = pb.SessionRequest()
        copy.CopyFrom(request)
        received.append(copy)
        return admit(request, proven_id)

    y.sessions.admit = recording  # type: ignore[method-assign]
    x = await nodes.start("x", peers=[y.advertise], n_elements=N, reachable="no")
    await wait_until(lambda: x.status()["sessions"] == ["y", "z"], what="x's sessions to y and z")
    request = next(r for r in received if r.node_id == "x")
    carried = {n.cfg.node_id: n.sessions.carried["x"] for n in (y, z)}
    held = Held(z, "Session")
    try:
        refused_elsewhere(await held.open(request), "y")
        refused_again(await Held(y, "Session").open(request))
        assert all(n.sessions.carried.get("x") is carried[n.cfg.node_id] for n in (y, z))  # x's own sessions
        assert not any(s.closed for s in carried.values())
    finally:
        await held.close()


async def test_a_replayed_leave_or_dial_back_request_does_nothing_elsewhere_or_again(nodes: Nodes) -> None:
    """x asks y to dial it back, and tells y it leaves; y replays both at z. Before, z took x's
    dial-back (x's one a minute there: x's own was refused) and marked x as left."""
    x, y, z = await trio(nodes)
    sent = capture(x, "call")
    assert await x.reach.ask("y", x.advertise) is not None
    [(callee, reach)] = [(c, r) for c, r in sent if isinstance(r, pb.ReachRequest)]
    assert callee == "y"
    refused_elsewhere(await unary(z, "CheckReachable", reach), "y")
    refused_again(await unary(y, "CheckReachable", reach))
    answer = await x.reach.ask("z", x.advertise)  # x's own is answered
    assert answer is not None and answer.reachable
    changed = type(reach)()  # the content is signed: another address is another request
    changed.CopyFrom(reach)
    changed.address = z.advertise
    code, details = await unary(y, "CheckReachable", changed)
    assert code == Code.PERMISSION_DENIED and "signed by that node's key only" in details, details

    await x.peers.leave("y")
    await wait_until(lambda: "x" not in alive_ids(y), what="y to mark x as left")
    [(callee, leave)] = [(c, r) for c, r in sent if isinstance(r, pb.LeaveRequest)]
    assert callee == "y"
    refused_elsewhere(await unary(z, "Leave", leave), "y")
    refused_again(await unary(y, "Leave", leave))
    assert "x" in alive_ids(z) and not z.table.peers["x"].left


def test_spent_requests_are_remembered_for_the_window_and_bounded_per_caller_and_in_all() -> None:
    """SpentRequests: a key is refused a second time until twice the freshness window passed on
    the node's clock; a caller holding PER_CALLER is refused (itself only), and once MAX are
    held a caller at its fair share is refused while one below it is still taken."""
    from neuronode.swarm.guard.replay import SpentRequests

    clock = ManualClock()
    spent = SpentRequests(clock, keep_s=600.0)
    spent.spend("a", b"k1", "Session")
    with pytest.raises(Refusal) as again:
        spent.spend("a", b"k1", "Session")
    assert again.value.code == "PERMISSION_DENIED"
    clock.advance(599.0)
    with pytest.raises(Refusal):
        spent.spend("a", b"k1", "Session")
    clock.advance(1.0)
    spent.spend("a", b"k1", "Session")  # past the window, the freshness check refuses it anyway
    assert len(spent) == 1

    class Small(SpentRequests):
        PER_CALLER, MAX = 3, 4

    bounded = Small(clock, keep_s=10.0)
    key: Callable[[int], bytes] = lambda i: i.to_bytes(4, "big")  # noqa: E731
    for i in range(3):
        bounded.spend("flood", key(i), "FetchState")
    with pytest.raises(Refusal) as full:
        bounded.spend("flood", key(3), "FetchState")
    assert full.value.code == "RESOURCE_EXHAUSTED" and "'flood'" in str(full.value)
    bounded.spend("b", key(10), "FetchState")  # MAX (4) held now
    bounded.spend("c", key(11), "FetchState")  # c holds nothing, below its fair share (4 // 3): taken
    with pytest.raises(Refusal):
        bounded.spend("c", key(12), "FetchState")  # at its share now
    clock.advance(10.0)
    bounded.spend("flood", key(3), "FetchState")  # all expired
    assert len(bounded) == 1
