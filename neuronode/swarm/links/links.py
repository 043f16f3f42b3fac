"""`Links`: every call a node makes goes out here, by member id (routed: dialed, over the session
the member holds to us, or left to its relay) or, before we know an id, by address.

Two lanes per address: control calls (Hello, Leave, CheckReachable, Status) ride a connection of
their own, so that a contribution filling a capped uplink never delays a heartbeat behind it;
contribution streams, fetches, state transfers and sessions ride the bulk one. Fault injection
(`--fault-file`) and membership proofs are applied here, for every call alike.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import grpc

from neuronode.swarm.context import Context
from neuronode.swarm.links.relay import Relay
from neuronode.swarm.links.resolve import Resolver, Target
from neuronode.swarm.links.route import Carried, Dial, Relayed, Route, Unreachable, route
from neuronode.swarm.links.sessions import Inbox, Sessions
from neuronode.swarm.membership.table import Peer
from neuronode.swarm.server import BULK, CONTROL
from neuronode.v1 import node_pb2 as pb

# grpcio's asyncio client reports a client stream the server ended early (a refusal before it
# read everything) as this INTERNAL error, hiding the server's status (grpc/grpc#36066).
EARLY_STATUS_BUG = "Internal error from Core"
# Refusals that retrying cannot fix; anything else (UNAVAILABLE, DEADLINE_EXCEEDED) is retried.
FINAL_CODES = {
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNIMPLEMENTED,
}
# Unary calls: method -> response deserializer (requests serialize themselves)
UNARY = {
    "Hello": pb.HelloResponse.FromString,
    "Leave": pb.LeaveResponse.FromString,
    "CheckReachable": pb.ReachResponse.FromString,
    "Status": pb.StatusResponse.FromString,
}
# Server streams: method -> response deserializer (None: raw bytes, parsed without copies)
FETCHES: dict[str, Callable[[bytes], Any] | None] = {
    "FetchContribution": None,
    "FetchState": pb.StateChunk.FromString,
}


class NoRoute(Exception):
    """The member cannot be reached now (why: the message); the caller retries or moves on."""


class Links:
    """Reaching members: routes, unary calls, streams, fetches, announcements; sessions and relays."""

    def __init__(self, ctx: Context, *, inbox: Inbox) -> None:
        self.ctx = ctx
        self.sessions = Sessions(ctx, inbox=inbox)
        self.relay = Relay(ctx, sessions=self.sessions)
        self.resolver = Resolver(clock=ctx.clock)

    async def resolve(self, address: str) -> Target | None:
        """The IP `address` names, which the node dials and counts (neuronode.swarm.links.resolve)."""
        return await self.resolver.resolve(address)

    def route(self, peer_id: str) -> Route:
        peer = self.ctx.table.peers.get(peer_id)
        if peer is None:
            return Unreachable("not a member we know")
        return route(peer, self.ctx.table, self.ctx.reachable, self.sessions.carried)

    def dialable(self, peer: Peer) -> bool:
        """We call `peer` by dialing it (the calls that have no other way: unary, fetches)."""
        return isinstance(route(peer, self.ctx.table, self.ctx.reachable), Dial)

    def deliverable(self, peer_id: str) -> bool:
        """A stream to `peer_id` goes somewhere now (dialed, or over its session)."""
        return isinstance(self.route(peer_id), Dial | Carried)

    def carried_by(self) -> list[str]:
        """The members whose sessions carry us (NodeInfo.carried_by)."""
        return sorted(self.sessions.open)

    # ---- calls ---------------------------------------------------------------------------

    async def dial(self, address: str, method: str, request: Any, *, timeout_s: float, name: str = "") -> Any:
        """A unary control call to `address` (a member, or an address whose id we do not know
        yet; `name`: the host name an IP address was resolved from, for TLS); raises NoRoute for
        no address, grpc.aio.AioRpcError as the call fails."""
        if not address:
            raise NoRoute(f"{method}: no address to dial")
        ctx = self.ctx
        await asyncio.sleep(ctx.faults.before_call(address))
        call = ctx.channels.channel(address, CONTROL, name=name).unary_unary(
            f"/neuronode.v1.Node/{method}", request_serializer=type(request).SerializeToString,
            response_deserializer=UNARY[method])
        return await call(request, timeout=timeout_s, metadata=ctx.security.metadata(method))

    async def call(self, peer_id: str, method: str, request: Any, *, timeout_s: float) -> Any:
        """A unary control call to member `peer_id`, which we must be able to dial."""
        where = self.route(peer_id)
        if not isinstance(where, Dial):
            raise NoRoute(f"{method} to {peer_id}: {describe(where)}")
        return await self.dial(where.address, method, request, timeout_s=timeout_s)

    async def dial_once(self, address: str, method: str, request: Any, *, timeout_s: float, name: str = "") -> Any:
        """A unary call over a connection of its own, closed after (a reachability dial-back:
        it must test a fresh connection to the address, not reuse one)."""
        if not address:
            raise NoRoute(f"{method}: no address to dial")
        channel = self.ctx.security.channel(address, name=name)
        try:
            call = channel.unary_unary(f"/neuronode.v1.Node/{method}", request_serializer=type(request).SerializeToString,
                                       response_deserializer=UNARY[method])
            return await call(request, timeout=timeout_s, metadata=self.ctx.security.metadata(method))
        finally:
            await channel.close()

    async def stream(self, peer_id: str, chunks: AsyncIterator[bytes], *, timeout_s: float) -> Route:
        """One contribution stream (serialized chunks) to member `peer_id`, over the route it has
        now: dialed (PushContribution), or over the session it holds to us. A member left to a
        relay gets it from the relay (what we push the relay); returns the route taken. Raises
        NoRoute, SessionClosed, TimeoutError or grpc.aio.AioRpcError."""
        ctx, where = self.ctx, self.route(peer_id)
        if isinstance(where, Relayed):
            return where
        if isinstance(where, Unreachable):
            raise NoRoute(f"{peer_id}: {where.why}")
        if isinstance(where, Carried):
            await asyncio.wait_for(self.sessions.push(peer_id, chunks), timeout=timeout_s)
            return where
        await asyncio.sleep(ctx.faults.before_call(where.address))
        call = ctx.channels.channel(where.address, BULK).stream_unary(
            "/neuronode.v1.Node/PushContribution", request_serializer=None, response_deserializer=pb.PushAck.FromString)
        await call(chunks, timeout=timeout_s, metadata=ctx.security.metadata("PushContribution"))
        return where

    async def fetch(self, peer_id: str, method: str, request: Any, *, timeout_s: float | None = None) -> Any:
        """A server stream from member `peer_id` (FetchContribution, FetchState), to iterate."""
        where = self.route(peer_id)
        if not isinstance(where, Dial):
            raise NoRoute(f"{method} from {peer_id}: {describe(where)}")
        await asyncio.sleep(self.ctx.faults.before_call(where.address))
        call = self.ctx.channels.channel(where.address, BULK).unary_stream(
            f"/neuronode.v1.Node/{method}", request_serializer=type(request).SerializeToString,
            response_deserializer=FETCHES[method])
        return call(request, timeout=timeout_s, metadata=self.ctx.security.metadata(method))

    def announce(self, greet: Callable[[Peer], Coroutine[Any, Any, Any]], hello: Callable[[], pb.HelloResponse]) -> None:
        """Our news to every live member now: `greet` (a Hello call) to those we dial, `hello()`
        (our signed answer) over the sessions we carry; relays forward it to the rest."""
        ctx = self.ctx
        for peer in ctx.table.alive():
            if self.dialable(peer):
                ctx.tasks.spawn(greet(peer), f"announce-{peer.node_id}")
        if self.sessions.carried:
            self.sessions.announce(hello())


def describe(where: Route) -> str:
    if isinstance(where, Carried):
        return "it cannot be dialed (it holds a session to us)"
    if isinstance(where, Relayed):
        return f"it cannot be dialed, nor can we (relayed by {where.carrier})"
    if isinstance(where, Unreachable):
        return where.why
    return f"dialed at {where.address}"
