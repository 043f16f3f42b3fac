"""Sessions: how a node that peers cannot dial (behind NAT, nothing forwarded) takes part.

Such a node (NodeInfo.reachable = NO, neuronode.swarm.reach) is never dialed. It opens one
long-lived `Session` call to every reachable member it knows; the member streams over it what
it would otherwise send by dialing: its signed Hello answer whenever it announces news (round,
receipts), and its contributions, chunk by chunk, several at once as numbered streams; and what
it relays from other members nobody can dial (their Hellos and contributions, as they signed
them: neuronode.swarm.relay). The node
itself still dials reachable members for everything it sends (Hello, contributions, fetches,
state transfers). An idle session carries an empty message every KEEPALIVE_S, well inside the
2-5 minutes after which home routers drop an idle connection.

Bounds (docs/protocol.md): one session per caller, MAX_SESSIONS per node, only for live members
(a member that dies, leaves or is banned loses it), a bounded queue per session (a contribution
waits for room: backpressure), and a session whose reader takes nothing for STALL_S is ended.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from neuronode.events import fields
from neuronode.swarm.admission import Admission, member_request
from neuronode.swarm.context import Context
from neuronode.swarm.security import caller_id
from neuronode.swarm.wire import Refusal
from neuronode.v1 import node_pb2 as pb

if TYPE_CHECKING:
    from neuronode.swarm.peers import Peers
    from neuronode.swarm.transport import GrpcTransport

logger = logging.getLogger(__name__)

KEEPALIVE_S = 20.0
STALL_S = 30.0
MAX_SESSIONS = 256
QUEUE_MESSAGES = 64
MAX_STREAMS = 8  # contribution streams one session may carry to us at once
STREAM_CHUNKS = 16  # chunks of one stream waiting to be checked


class SessionClosed(Exception):
    """The session a contribution was streaming over ended; the push is retried."""


Queued = tuple[pb.SessionMessage, "asyncio.Future[None] | None"]  # a message, and who waits for it to go out


@dataclass(eq=False)
class Carried:
    """A session we carry for a member peers cannot dial."""

    peer_id: str
    queue: asyncio.Queue[Queued] = field(default_factory=lambda: asyncio.Queue(QUEUE_MESSAGES))
    streams: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    closed: bool = False

    def put_nowait(self, msg: pb.SessionMessage) -> None:
        self.queue.put_nowait((msg, None))

    async def put(self, msg: pb.SessionMessage, *, written: bool = False) -> None:
        """Queue `msg` (waiting for room); with `written`, return only once it went out on the
        session, and raise SessionClosed if the session ended first (it was dropped)."""
        if self.closed:
            raise SessionClosed(f"the session of {self.peer_id} ended")
        done = asyncio.get_running_loop().create_future() if written else None
        await self.queue.put((msg, done))
        if done is not None:
            await done

    def end(self) -> None:
        """The session ended: what still waited in its queue is dropped, and whoever waits for
        it to go out learns so (a push then goes again, over the next session)."""
        self.closed = True
        while not self.queue.empty():
            fail(self.queue.get_nowait()[1], self.peer_id)


def fail(done: asyncio.Future[None] | None, peer_id: str) -> None:
    if done is not None and not done.done():
        done.set_exception(SessionClosed(f"the session of {peer_id} ended before this went out"))


class Sessions:
    """The sessions we carry for others, and the ones we hold open to reachable members."""

    def __init__(self, ctx: Context, *, peers: Peers, transport: GrpcTransport) -> None:
        self.ctx = ctx
        self.peers = peers
        self.transport = transport
        self.carried: dict[str, Carried] = {}  # member id -> the session we carry for it
        self.held: dict[str, asyncio.Task[None]] = {}  # member id -> our session to it
        self.open: set[str] = set()  # members whose session to us is up (status `sessions`)

    # ---- carrying (a reachable member) -----------------------------------------------------

    def method(self, admission: Admission) -> grpc.RpcMethodHandler:
        async def serve(request: pb.SessionRequest, context: grpc.aio.ServicerContext) -> None:
            if self.ctx.leaving:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "node is shutting down")
            await admission.admit(context)
            await admission.check_certificate(context, request.node_id)
            try:
                self.admit(request, caller_id(context))
                await self.carry(request.node_id, context)
            except Refusal as exc:
                await admission.refuse(context, exc, "session")

        return grpc.unary_stream_rpc_method_handler(serve, request_deserializer=pb.SessionRequest.FromString,
                                                    response_serializer=pb.SessionMessage.SerializeToString)

    def admit(self, request: pb.SessionRequest, proven_id: str) -> None:
        member_request(self.ctx, "Session", request, proven_id, "sessions are carried")
        if len(self.carried) >= MAX_SESSIONS and request.node_id not in self.carried:
            raise Refusal("RESOURCE_EXHAUSTED", f"this node carries {MAX_SESSIONS} sessions, its most; "
                          "open one to another reachable member")

    async def carry(self, peer_id: str, context: grpc.aio.ServicerContext) -> None:
        """Stream to `peer_id` until it goes, leaves, stalls, or opens another session."""
        ctx = self.ctx
        old = self.carried.pop(peer_id, None)
        if old is not None:
            old.end()
        session = self.carried[peer_id] = Carried(peer_id)
        logger.info("carrying a session for %s (peers cannot dial it)", peer_id,
                    extra=fields("session_carried", peer_id=peer_id))
        first = self.hello(context.peer())
        self.ctx.counters.control(sent=first.ByteSize())
        session.put_nowait(pb.SessionMessage(hello=first))
        self.transport.push_pending()  # what we owe it goes over the session now
        done: asyncio.Future[None] | None = None  # the push waiting for the message being written
        try:
            while not session.closed and not ctx.leaving:
                peer = ctx.table.peers.get(peer_id)
                if peer is None or not ctx.table.is_alive(peer):
                    break
                try:
                    msg, done = await asyncio.wait_for(session.queue.get(), timeout=KEEPALIVE_S)
                except TimeoutError:
                    msg = pb.SessionMessage()  # keepalive: routers keep a busy connection open
                try:
                    await asyncio.wait_for(context.write(msg), timeout=STALL_S)
                except TimeoutError:
                    raise Refusal("DEADLINE_EXCEEDED", f"session ended: nothing was read for {STALL_S:.0f} s") from None
                if done is not None and not done.done():
                    done.set_result(None)
                done = None
        finally:
            fail(done, peer_id)
            session.end()  # free what waited: pushes see SessionClosed and retry
            if self.carried.get(peer_id) is session:
                del self.carried[peer_id]

    def hello(self, caller: str = "") -> pb.HelloResponse:
        """Our NodeInfo as a signed Hello answer (what a Hello to the member would return)."""
        resp = pb.HelloResponse(info=self.peers.node_info(), known_peers=self.peers.known_peers(),
                                observed_address=caller.split(":", 1)[-1] if caller else "")
        self.ctx.security.sign_hello(resp)
        return resp

    def announce(self) -> None:
        """Our news to every member we carry a session for (it cannot be dialed)."""
        if not self.carried:
            return
        msg = pb.SessionMessage(hello=self.hello())
        for session in self.carried.values():
            if not session.queue.full():  # a full queue is busy with chunks: the next announcement carries it
                session.put_nowait(msg)
                self.ctx.counters.control(sent=msg.hello.ByteSize())

    def offer(self, peer_id: str, msg: pb.SessionMessage) -> None:
        """`msg` to `peer_id`'s session if it has room (a Hello we relay: the next one carries
        the same news, so a busy session may drop it)."""
        session = self.carried.get(peer_id)
        if session is not None and not session.closed and not session.queue.full():
            session.put_nowait(msg)

    async def push(self, peer_id: str, chunks: AsyncIterator[bytes], *, first: pb.SessionMessage | None = None) -> None:
        """One contribution to `peer_id` over the session we carry for it (after `first`: the
        Hello of the member whose contribution we relay, so that it knows the sender)."""
        session = self.carried.get(peer_id)
        if session is None:
            raise SessionClosed(f"no session of {peer_id}")
        if first is not None:
            await session.put(first)
        stream = next(session.streams)
        async for data in chunks:
            await session.put(pb.SessionMessage(chunk=data, stream=stream))
        await session.put(pb.SessionMessage(stream=stream, end=True), written=True)  # else it goes again

    # ---- holding (a node peers cannot dial) ----------------------------------------------------

    async def hold_all(self) -> None:
        """While peers cannot dial us, keep a session open to every reachable live member."""
        ctx = self.ctx
        while True:
            wanted = {p.node_id: p for p in ctx.table.alive() if ctx.table.dialable(p)} \
                if ctx.reachable == "no" else {}
            for peer_id in [i for i in self.held if i not in wanted]:
                self.held.pop(peer_id).cancel()
            for peer_id, peer in wanted.items():
                if peer_id not in self.held or self.held[peer_id].done():
                    self.held[peer_id] = ctx.tasks.spawn(self.hold(peer_id, peer.address), f"session-{peer_id}")
            await ctx.clock.sleep(ctx.cfg.heartbeat_s)

    async def hold(self, peer_id: str, address: str) -> None:
        ctx = self.ctx
        request = ctx.security.sign_request("Session", pb.SessionRequest(node_id=ctx.cfg.node_id,
                                                                         swarm_id=ctx.cfg.swarm_id))
        streams: dict[int, asyncio.Queue[Any]] = {}
        try:
            call = ctx.channels.session_call(address)(request, metadata=ctx.security.metadata("Session"))
            async for msg in call:
                if peer_id not in self.open:
                    self.open.add(peer_id)
                    logger.info("taking part through %s's session (not reachable from the internet)", peer_id,
                                extra=fields("session_open", peer_id=peer_id))
                    self.peers.announce()  # who carries us (NodeInfo.carried_by) decides who relays to us
                await self.take(peer_id, address, msg, streams)
        except grpc.aio.AioRpcError as exc:
            logger.debug("session to %s ended: %s %s", peer_id, exc.code().name, exc.details())
        finally:
            if peer_id in self.open:
                self.open.discard(peer_id)
                if not self.ctx.leaving:
                    self.peers.announce()  # another carrier relays to us now
            for queue in streams.values():
                queue.put_nowait(None)  # a stream cut short: its receiver refuses it (DATA_LOSS)

    async def take(self, peer_id: str, address: str, msg: pb.SessionMessage, streams: dict[int, asyncio.Queue[Any]]) -> None:
        """One message of a session we hold."""
        if msg.HasField("hello"):
            await self.ctx.security.check_ahead(msg.hello)  # signatures off the loop
            self.peers.take_answer(address, msg.hello)
        elif msg.HasField("relayed"):
            await self.ctx.security.check_ahead(msg.relayed)
            self.peers.take_relayed(peer_id, msg.relayed)
        elif msg.end:
            queue = streams.pop(msg.stream, None)
            if queue is not None:
                await queue.put(None)
        elif msg.chunk:
            queue = streams.get(msg.stream)
            if queue is None:
                if len(streams) >= MAX_STREAMS:
                    return  # more than a member has reason to send at once: dropped, its stream fails
                queue = streams[msg.stream] = asyncio.Queue(STREAM_CHUNKS)
                self.ctx.tasks.spawn(self.receive(peer_id, queue), f"session-stream-{peer_id}")
            await queue.put(msg.chunk)  # waits while the receiver checks earlier chunks: backpressure

    async def receive(self, peer_id: str, queue: asyncio.Queue[Any]) -> None:
        async def chunks() -> AsyncIterator[bytes]:
            while (chunk := await queue.get()) is not None:
                yield chunk

        try:
            await self.transport.receive(chunks(), proven_id=peer_id if self.ctx.security.secret else "", carrier=peer_id)
        except Refusal as exc:
            self.ctx.say(f"session-refused:{peer_id}", logging.WARNING, "refused a contribution %s sent over its "
                         "session: %s", peer_id, exc, extra=fields("refused", what="contribution", code=exc.code,
                                                                   detail=str(exc)))
