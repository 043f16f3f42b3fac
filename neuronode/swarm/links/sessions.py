"""Sessions: how a node that peers cannot dial (behind NAT, nothing forwarded) takes part.

Such a node (NodeInfo.reachable = NO, neuronode.swarm.membership.reach) is never dialed. It opens one
long-lived `Session` call to every reachable member it knows; the member streams over it what
it would otherwise send by dialing: its signed Hello answer whenever it announces news (round,
receipts), and its contributions, chunk by chunk, several at once as numbered streams; and what
it relays from other members nobody can dial (their Hellos and contributions, as they signed
them: neuronode.swarm.links.relay). The node itself still dials reachable members for
everything it sends. An idle session carries an empty message every KEEPALIVE_S, well inside
the 2-5 minutes after which home routers drop an idle connection.

Control goes first: Hellos (ours and relayed ones, the latest of each maker) wait in a lane of
their own that the writer empties before it takes the next chunk, so a contribution streaming
over a capped home link never delays the news that keeps its receiver's view of the swarm live.

What a session delivers goes up through an `Inbox` (the node implements it); this module knows
nothing of peers or the transport.

Bounds (docs/protocol.md): one session per caller, MAX_SESSIONS per node, only for live members
(a member that dies, leaves or is banned loses it), DATA_MESSAGES chunks waiting per session (a
contribution waits for room: backpressure; neuronode.swarm.links.lanes), and a session is ended when its reader takes
nothing for STALL_S, on either side: the carrier's write, or the holder's check of a chunk
(a stream refused or aborted on the way is drained, never waited for); a held session that
hears nothing for IDLE_S ends too, and is opened again.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from neuronode.events import fields
from neuronode.swarm.context import Context
from neuronode.swarm.guard.admission import Admission, member_request
from neuronode.swarm.guard.interceptors import caller_id
from neuronode.swarm.links.lanes import DATA_MESSAGES, Carried, SessionClosed, fail
from neuronode.swarm.links.route import Dial, route
from neuronode.swarm.wire import STALL_S, Refusal
from neuronode.v1 import node_pb2 as pb

logger = logging.getLogger(__name__)

KEEPALIVE_S = 20.0
IDLE_S = 3 * KEEPALIVE_S  # a held session that hears nothing this long (keepalives included) ended
MAX_SESSIONS = 256
MAX_STREAMS = 8  # contribution streams one session may carry to us at once
STREAM_CHUNKS = 16  # chunks of one stream waiting to be checked


class SessionStuck(Exception):
    """A held session's stream receiver took no chunk for STALL_S: the session is ended."""


class Inbox(Protocol):
    """What sessions hand up to the node, and the one thing they ask of it (our Hello)."""

    def our_hello(self, caller: str) -> pb.HelloResponse:
        """Our signed Hello answer (`caller`: the address the session's call came from)."""

    def carrying(self, peer_id: str) -> None:
        """A session we carry for `peer_id` is up: what we owe it may go over it now."""

    def hello_answer(self, carrier: str, address: str, resp: pb.HelloResponse) -> bool:
        """A Hello answer over the session we hold to `carrier` (dialed at `address`): it speaks
        for the carrier only (an answer of anyone else is dropped: finding 4, SECURITY.md)."""

    def relayed_hello(self, carrier: str, request: pb.HelloRequest) -> None:
        """A Hello of a member nobody can dial, relayed by `carrier` as its maker signed it."""

    async def contribution(self, chunks: AsyncIterator[bytes], *, carrier: str) -> None:
        """One contribution stream `carrier` sent (its own, or one it relays); raises Refusal."""

    def carriers_changed(self) -> None:
        """A session we hold opened or ended: who carries us (NodeInfo.carried_by) changed."""


@dataclass(eq=False)
class Incoming:
    """A contribution stream arriving over a session we hold, and the task checking it."""

    queue: asyncio.Queue[bytes | None]
    task: asyncio.Task[None]


@dataclass
class Inflow:
    """The contribution streams of one session we hold: open ones, and the ids of ended ones
    (finished, refused, dropped) whose late chunks are drained."""

    open: dict[int, Incoming] = field(default_factory=dict)
    ended: deque[int] = field(default_factory=lambda: deque(maxlen=8 * MAX_STREAMS))

    def close(self, stream: int) -> Incoming | None:
        self.ended.append(stream)
        return self.open.pop(stream, None)


class Sessions:
    """The sessions we carry for others, and the ones we hold open to reachable members."""

    def __init__(self, ctx: Context, *, inbox: Inbox) -> None:
        self.ctx = ctx
        self.inbox = inbox
        self.carried: dict[str, Carried] = {}  # member id -> the session we carry for it
        self.held: dict[str, asyncio.Task[None]] = {}  # member id -> our session to it
        self.open: set[str] = set()  # members whose session to us is up (status `sessions`)

    # ---- carrying (a reachable member) -----------------------------------------------------

    def method(self, admission: Admission) -> grpc.RpcMethodHandler:
        async def serve(request: pb.SessionRequest, context: grpc.aio.ServicerContext) -> None:
            if self.ctx.leaving:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "node is shutting down")
            await admission.admit(context, request.node_id)
            try:
                await self.carry(self.admit(request, caller_id(context)), context)
            except Refusal as exc:
                await admission.refuse(context, exc, "session")

        return grpc.unary_stream_rpc_method_handler(serve, request_deserializer=pb.SessionRequest.FromString,
                                                    response_serializer=pb.SessionMessage.SerializeToString)

    def admit(self, request: pb.SessionRequest, proven_id: str) -> str:
        """The member whose session this is (the id its signature proves); raises Refusal."""
        caller = member_request(self.ctx, "Session", request, proven_id, "sessions are carried")
        if len(self.carried) >= MAX_SESSIONS and caller not in self.carried:
            raise Refusal("RESOURCE_EXHAUSTED", f"this node carries {MAX_SESSIONS} sessions, its most; "
                          "open one to another reachable member")
        return caller

    async def carry(self, peer_id: str, context: grpc.aio.ServicerContext) -> None:
        """Stream to `peer_id` until it goes, leaves, stalls, or opens another session."""
        ctx = self.ctx
        old = self.carried.pop(peer_id, None)
        if old is not None:
            old.end()
        session = self.carried[peer_id] = Carried(peer_id)
        logger.info("carrying a session for %s (peers cannot dial it)", peer_id,
                    extra=fields("session_carried", peer_id=peer_id))
        first = self.inbox.our_hello(context.peer())
        self.ctx.counters.control(sent=first.ByteSize())
        session.offer("", pb.SessionMessage(hello=first))
        self.inbox.carrying(peer_id)  # what we owe it goes over the session now
        done: asyncio.Future[None] | None = None  # the push waiting for the message being written
        try:
            while not session.closed and not ctx.leaving:
                peer = ctx.table.peers.get(peer_id)
                if peer is None or not ctx.table.is_alive(peer):
                    break
                item = await session.take(KEEPALIVE_S)
                msg, done = item if item is not None else (pb.SessionMessage(), None)  # keepalive
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

    def announce(self, hello: pb.HelloResponse) -> None:
        """Our news to every member we carry a session for (it cannot be dialed)."""
        if not self.carried:
            return
        msg = pb.SessionMessage(hello=hello)
        for session in self.carried.values():
            session.offer("", msg)  # replaces older news still waiting
            self.ctx.counters.control(sent=msg.hello.ByteSize())

    def offer(self, peer_id: str, maker: str, msg: pb.SessionMessage) -> None:
        """A Hello of `maker` we relay, to `peer_id`'s session (it replaces an older one waiting)."""
        session = self.carried.get(peer_id)
        if session is not None:
            session.offer(maker, msg)

    async def push(self, peer_id: str, chunks: AsyncIterator[bytes], *, first: tuple[str, pb.SessionMessage] | None = None) -> None:
        """One contribution to `peer_id` over the session we carry for it (after `first`: the
        maker and Hello of the member whose contribution we relay, so that it knows the sender).
        A push that fails or is cancelled part way ends its stream, so its receiver drops it."""
        session = self.carried.get(peer_id)
        if session is None:
            raise SessionClosed(f"no session of {peer_id}")
        if first is not None:
            session.offer(*first)
        stream = next(session.streams)
        try:
            async for data in chunks:
                await session.put(pb.SessionMessage(chunk=data, stream=stream))
        except BaseException:
            if not session.closed and len(session.data) < DATA_MESSAGES:
                session.data.append((pb.SessionMessage(stream=stream, end=True), None))  # cut short: DATA_LOSS there
                session.ready.set()
            raise
        await session.put(pb.SessionMessage(stream=stream, end=True), written=True)  # else it goes again

    # ---- holding (a node peers cannot dial) ----------------------------------------------------

    async def hold_all(self) -> None:
        """While peers cannot dial us, keep a session open to every reachable live member."""
        ctx = self.ctx
        while True:
            wanted = {p.node_id: r.address for p in ctx.table.alive()
                      if isinstance(r := route(p, ctx.table, ctx.reachable), Dial)} if ctx.reachable == "no" else {}
            for peer_id in [i for i in self.held if i not in wanted]:
                self.held.pop(peer_id).cancel()
            for peer_id, address in wanted.items():
                if peer_id not in self.held or self.held[peer_id].done():
                    self.held[peer_id] = ctx.tasks.spawn(self.hold(peer_id, address), f"session-{peer_id}")
            await ctx.clock.sleep(ctx.cfg.heartbeat_s)

    async def hold(self, peer_id: str, address: str) -> None:
        """One session to `peer_id`, until it ends (then hold_all opens another)."""
        ctx = self.ctx
        request = ctx.security.sign_request("Session", pb.SessionRequest(node_id=ctx.cfg.node_id,
                                                                         swarm_id=ctx.cfg.swarm_id), peer_id)
        flows = Inflow()
        call = None
        ended = False  # the carrier ended the session itself (it leaves, or dropped us), rather than dying
        try:
            await asyncio.sleep(ctx.faults.before_call(address))
            call = ctx.channels.session_call(address)(request, metadata=ctx.security.metadata("Session"))
            messages = call.__aiter__()
            while True:
                try:
                    msg = await asyncio.wait_for(messages.__anext__(), timeout=IDLE_S)
                except StopAsyncIteration:
                    ended = True
                    break
                except TimeoutError:
                    logger.info("session to %s heard nothing for %.0f s; opening another", peer_id, IDLE_S,
                                extra=fields("session_silent", peer_id=peer_id))
                    break
                if peer_id not in self.open:
                    self.open.add(peer_id)
                    logger.info("taking part through %s's session (not reachable from the internet)", peer_id,
                                extra=fields("session_open", peer_id=peer_id))
                    self.inbox.carriers_changed()  # who carries us (NodeInfo.carried_by) decides who relays to us
                await self.take(peer_id, address, msg, flows)
        except grpc.aio.AioRpcError as exc:
            logger.debug("session to %s ended: %s %s", peer_id, exc.code().name, exc.details())
        except SessionStuck as exc:
            logger.warning("session to %s ended: %s; opening another", peer_id, exc,
                           extra=fields("session_stuck", peer_id=peer_id))
        finally:
            if call is not None:
                call.cancel()
            for incoming in flows.open.values():
                incoming.task.cancel()  # a stream cut short: its receiver frees what it reserved
            if peer_id in self.open:
                self.open.discard(peer_id)
                if not self.ctx.leaving:
                    self.lost(peer_id, ended=ended)
                    self.inbox.carriers_changed()  # another carrier relays to us now

    def lost(self, peer_id: str, *, ended: bool) -> None:
        """The session `peer_id` carried for us is over: `carrier_left` when it `ended` it or said
        it leaves, `carrier_lost` when it broke off (the carrier died, or its link did)."""
        peer, rest = self.ctx.table.peers.get(peer_id), ", ".join(sorted(self.open)) or "no other member yet"
        left = ended or (peer is not None and peer.left)
        logger.log(logging.INFO if left else logging.WARNING, "our session to %s %s; taking part through %s", peer_id,
                   "ended (it left)" if left else "broke off (it died, or its link did)", rest,
                   extra=fields("carrier_left" if left else "carrier_lost", peer_id=peer_id, carried_by=sorted(self.open)))

    async def take(self, peer_id: str, address: str, msg: pb.SessionMessage, flows: Inflow) -> None:
        """One message of a session we hold."""
        if msg.HasField("hello"):
            await self.ctx.security.check_ahead(msg.hello)  # signatures off the loop
            self.inbox.hello_answer(peer_id, address, msg.hello)
        elif msg.HasField("relayed"):
            await self.ctx.security.check_ahead(msg.relayed)
            self.inbox.relayed_hello(peer_id, msg.relayed)
        elif msg.end:
            incoming = flows.close(msg.stream)
            if incoming is not None:
                await self.feed(incoming, None)
        elif msg.chunk:
            incoming = flows.open.get(msg.stream)
            if incoming is None:
                if msg.stream in flows.ended:
                    return  # the rest of a stream that ended here: drained
                if sum(not i.task.done() for i in flows.open.values()) >= MAX_STREAMS:
                    flows.ended.append(msg.stream)  # more than a member has reason to send at once: dropped
                    return
                queue: asyncio.Queue[bytes | None] = asyncio.Queue(STREAM_CHUNKS)
                task = self.ctx.tasks.spawn(self.receive(peer_id, queue), f"session-stream-{peer_id}")
                incoming = flows.open[msg.stream] = Incoming(queue, task)
            await self.feed(incoming, msg.chunk)

    async def feed(self, incoming: Incoming, chunk: bytes | None) -> None:
        """Hand one chunk (None: the end) to a stream's receiver, waiting while it checks the
        ones before (backpressure), but never for a receiver that finished (refused, aborted:
        the rest of its stream is drained) and never longer than STALL_S (SessionStuck)."""
        if incoming.task.done():
            return
        put = asyncio.ensure_future(incoming.queue.put(chunk))
        try:
            await asyncio.wait({put, incoming.task}, timeout=STALL_S, return_when=asyncio.FIRST_COMPLETED)
        finally:
            put.cancel()
        if not put.done() or put.cancelled():
            if not incoming.task.done():
                raise SessionStuck(f"a contribution stream took no chunk for {STALL_S:.0f} s")

    async def receive(self, peer_id: str, queue: asyncio.Queue[bytes | None]) -> None:
        async def chunks() -> AsyncIterator[bytes]:
            while (chunk := await queue.get()) is not None:
                yield chunk

        try:
            await self.inbox.contribution(chunks(), carrier=peer_id)
        except Refusal as exc:
            self.ctx.say(f"session-refused:{peer_id}", logging.WARNING, "refused a contribution %s sent over its "
                         "session: %s", peer_id, exc, extra=fields("refused", what="contribution", code=exc.code,
                                                                   detail=str(exc)))
