"""The gRPC Transport: contributions to and from peers, as client streams of ContributionChunk.

Sending round r: our contribution (already encoded into frames) is pushed to every target over
one client stream each, and again to targets that appear while the round's push window
(`--sync-timeout`) is open; transient failures are retried with backoff until then. Receiving:
`PushContribution` reads raw chunk bytes, checks them chunk by chunk (order, sizes, bounded
decompression, finite values) and as a whole (digest, membership proof), and files the complete
contribution in the round book, where it waits until our round closes (neuronode.averaging.book).
Chunks are framed without protobuf copying their payload (neuronode.swarm.chunks).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from neuronode.averaging.agreement import Receipt, Statement, statement_of
from neuronode.averaging.book import RoundRefused
from neuronode.averaging.transport import MemberView
from neuronode.codec import (
    Assembler,
    Contribution,
    ContributionDigest,
    Phase,
)
from neuronode.events import fields
from neuronode.swarm.admission import Admission
from neuronode.swarm.chunks import ChunkView, header_of, parse_chunk, serialize_chunk
from neuronode.swarm.context import Context
from neuronode.swarm.faults import FaultInjected
from neuronode.swarm.inbound import Inbound, bound_digest, check_same_stream, stream_key
from neuronode.swarm.membership import member_views, reducers, round_peers
from neuronode.swarm.missed import Missed
from neuronode.swarm.receipts import EQUIVOCATION_BAN_S, Receipts
from neuronode.swarm.security import caller_id
from neuronode.swarm.sessions import SessionClosed, Sessions
from neuronode.swarm.wire import PB_TO_CODEC, Refusal
from neuronode.v1 import node_pb2 as pb

if TYPE_CHECKING:
    from neuronode.swarm.relay import Relay

logger = logging.getLogger(__name__)

# grpcio's asyncio client reports a client stream the server ended early (a refusal before it
# read everything) as this INTERNAL error, hiding the server's status (grpc/grpc#36066).
EARLY_STATUS_BUG = "Internal error from Core"
# Refusals that retrying cannot fix; anything else (UNAVAILABLE, DEADLINE_EXCEEDED) is retried.
FINAL_CODES = {
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNIMPLEMENTED,
}


def take(assembler: Assembler, chunk: Any, digest: ContributionDigest) -> None:
    """Decode and store one received chunk (in a worker thread: decompression, checks, hashing)."""
    assembler.take(chunk.chunk_index, chunk.payload, compressed=chunk.compressed, digest=digest)


# ---- sending -----------------------------------------------------------------------------------


@dataclass
class WireCache:
    """One contribution's serialized chunks by index, made once and sent to every peer (the
    same bytes for all), and their common header (tag included)."""

    header: pb.ContributionChunk | None = None
    chunks: dict[int, bytes] = field(default_factory=dict)


@dataclass
class Outbox:
    """What we still push for one (phase, round): one contribution for all, or one per peer."""

    outs: Mapping[str, Contribution] | Contribution
    targets: set[str] | None  # None: every live peer of the round
    deadline: float
    pushed: set[str] = field(default_factory=set)
    wire: dict[int, WireCache] = field(default_factory=dict)  # by id() of the contribution
    # Peers that refused it as out of their round (FAILED_PRECONDITION), with the round each
    # announced then: it is pushed again once that peer moves to another round not past it (a
    # joiner refuses a round too far ahead until it adopted the swarm's state, then listens to it).
    refused_at: dict[str, int] = field(default_factory=dict)

    def for_peer(self, peer_id: str) -> Contribution | None:
        if isinstance(self.outs, Contribution):
            return self.outs
        return self.outs.get(peer_id)

    def cache(self, out: Contribution) -> WireCache:
        return self.wire.setdefault(id(out), WireCache())


@dataclass
class Window:
    """A push window (averaging.Sending): `extend` keeps it open one more --sync-timeout."""

    transport: GrpcTransport
    box: Outbox

    def extend(self) -> None:
        self.box.deadline = self.transport.ctx.clock.now() + self.transport.ctx.cfg.sync_timeout_s
        self.transport.push_pending()


class GrpcTransport:
    """neuronode.averaging.Transport over gRPC client streams (see the module docstring)."""

    def __init__(self, ctx: Context, *, receipts: Receipts, publish_receipt: Callable[[Receipt], Receipt]) -> None:
        self.ctx = ctx
        self.inbound = Inbound(ctx)
        self.ledger = receipts
        self._publish = publish_receipt
        self._outbox: dict[tuple[Phase, int], Outbox] = {}
        self.missed = Missed(self)
        self.sessions: Sessions | None = None  # set by the node: sessions we carry for undialable members
        self.relay: Relay | None = None  # set by the node: what we forward between them

    def carries(self, peer_id: str) -> bool:
        return self.sessions is not None and peer_id in self.sessions.carried

    # ---- averaging.Transport ------------------------------------------------------------------

    @property
    def node_id(self) -> str:
        return self.ctx.cfg.node_id

    @property
    def book(self) -> Any:
        return self.ctx.book

    def round_peers(self, round_id: int) -> set[str]:
        return round_peers(self.ctx.table, round_id, round_lag=self.ctx.cfg.round_lag)

    def alive(self) -> set[str]:
        return {p.node_id for p in self.ctx.table.alive()}

    def reducers(self, members: Iterable[str]) -> set[str]:
        return reducers(self.ctx.table, members, self_dialable=bool(self.ctx.advertise) and self.ctx.reachable != "no")

    def link_rate(self) -> float:
        """Bytes/s our pushes reach together, capped by --max-upload-mbps (0: not measured)."""
        link, upload = self.ctx.upload_meter.rate, self.ctx.upload
        return min(link or upload.bytes_per_s, upload.bytes_per_s) if upload.enabled else link

    def publish_receipt(self, receipt: Receipt) -> Receipt:
        return self._publish(receipt)

    def voice(self, member: str) -> str:
        return self.ctx.table.voice(member)

    def receipts(self, round_id: int, phase: Phase) -> list[Receipt]:
        return self.ledger.receipts(round_id, phase)

    def member_views(self, round_id: int, phase: Phase, members: Iterable[str]) -> list[MemberView]:
        self.ledger.lists.ready(round_id, phase)  # we wait for these receipts: ask for lists we lack
        return member_views(self.ctx.table, self.ledger.makers(round_id, phase), round_id, members,
                            coming=self.ledger.coming(round_id, phase))

    async def fetch(self, statement: Statement, holders: list[str], *, timeout_s: float) -> Contribution | None:
        return await self.missed.fetch(statement, holders, timeout_s=timeout_s)

    def retain(self, round_id: int, phase: Phase, contributions: Iterable[Contribution], *, for_s: float) -> None:
        self.missed.retain(round_id, phase, contributions, for_s=for_s)

    def equivocated(self, member: str, proof: tuple[Statement, Statement]) -> None:
        if self.ctx.table.ban(member, EQUIVOCATION_BAN_S):
            self.ctx.book.notify()

    def send(self, round_id: int, phase: Phase, outs: Contribution | Mapping[str, Contribution], *,
             members: tuple[str, ...] = ()) -> Window:
        for out in ([outs] if isinstance(outs, Contribution) else outs.values()):
            self.sign(out)
        targets = set(members) - {self.node_id} if members else None
        box = self._outbox[(phase, round_id)] = Outbox(outs, targets, self.ctx.clock.now() + self.ctx.cfg.sync_timeout_s)
        for old in [k for k in self._outbox if k[1] < round_id - 1]:
            del self._outbox[old]
        self.push_pending()
        return Window(self, box)

    def sign(self, out: Contribution) -> None:
        """Our signature over the statement of a contribution we send (once)."""
        if not out.signature:
            out.public_key = self.ctx.security.key.public
            out.signature = self.ctx.security.sign_statement(statement_of(out))

    # ---- pushing ----------------------------------------------------------------------------

    def push_pending(self) -> None:
        """Start pushes owed to live peers: new ones, or ones that moved into an open round
        (and forwards we owe as a relay). Cheap to call on every message a peer sends."""
        if self.relay is not None:
            self.relay.pending()
        now, lag = self.ctx.clock.now(), self.ctx.cfg.round_lag
        for (phase, round_id), box in self._outbox.items():
            if now >= box.deadline:
                continue
            for peer in self.ctx.table.alive():
                if peer.node_id in box.pushed or not (peer.address or self.carries(peer.node_id)):
                    continue  # no address to dial yet (it is learning it), and no session
                refused = box.refused_at.get(peer.node_id)
                if refused is not None and (peer.round == refused or peer.round > round_id):
                    continue  # it refused the round where it still is, or it closed the round
                if box.targets is None and peer.round + lag < round_id:
                    continue  # behind: it will catch up by state transfer instead
                listener = phase == Phase.AVERAGED and peer.contributes_from == round_id + 1
                if box.targets is not None and peer.node_id not in box.targets and not listener:
                    continue  # reduce-scatter: members, plus listeners for the averaged shards
                out = box.for_peer(peer.node_id)
                if out is None or (not peer.reachable and not self.carries(peer.node_id)):
                    continue  # nobody dials it: it gets this once its session is up
                box.pushed.add(peer.node_id)
                self.ctx.tasks.spawn(self.push(peer.node_id, peer.address, out, box),
                                     f"push-r{round_id}-p{int(phase)}-{peer.node_id}")

    async def push(self, peer_id: str, address: str, out: Contribution, box: Outbox) -> None:
        """Stream `out` to one peer, retrying transient failures until the window closes."""
        ctx, backoff, hidden = self.ctx, 0.2, 0  # hidden: refusals grpcio reported as INTERNAL
        what = f"round {out.round_id}: {out.phase.label} to {peer_id}"
        while (remaining := box.deadline - ctx.clock.now()) > 0:
            sent = 0
            try:
                await asyncio.sleep(ctx.faults.before_call(address))
                ctx.upload_meter.begin(ctx.clock.now())
                try:
                    if self.carries(peer_id):  # it cannot be dialed: over the session it holds to us
                        await asyncio.wait_for(self.sessions.push(peer_id, self.chunks(  # type: ignore[union-attr]
                            peer_id, address, out, box.cache(out))), timeout=remaining)
                    else:
                        await ctx.channels.push_call(address)(
                            self.chunks(peer_id, address, out, box.cache(out)), timeout=remaining,
                            metadata=ctx.security.metadata("PushContribution"))
                    sent = out.frame_bytes
                finally:
                    ctx.upload_meter.end(ctx.clock.now(), sent)
                logger.debug("round %d: sent our %s to %s", out.round_id, out.phase.label, peer_id,
                             extra=fields("pushed", round_id=out.round_id, peer_id=peer_id, phase=out.phase.name.lower()))
                return
            except (SessionClosed, TimeoutError) as exc:
                logger.debug("%s over its session failed (%s); retrying", what, exc)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and (peer := ctx.table.peers.get(peer_id)):
                    box.refused_at[peer_id] = peer.round  # push_pending retries once it moved
                    box.pushed.discard(peer_id)
                if exc.code() in FINAL_CODES:
                    logger.warning("round %d: peer %s refused our contribution: %s", out.round_id, peer_id,
                                   exc.details(), extra=fields("push_refused", round_id=out.round_id, peer_id=peer_id,
                                                                code=exc.code().name))
                    return
                if exc.code() == grpc.StatusCode.INTERNAL and exc.details() == EARLY_STATUS_BUG:
                    hidden += 1
                    if hidden >= 3:
                        logger.warning("round %d: peer %s keeps ending our stream early (a refusal grpcio "
                                       "reports as INTERNAL); giving up", out.round_id, peer_id)
                        return
                logger.debug("%s failed (%s); retrying", what, exc.code().name)
            await asyncio.sleep(min(backoff, max(0.0, box.deadline - ctx.clock.now())) * random.uniform(0.5, 1.0))
            backoff = min(backoff * 2, 5.0)

    async def chunks(self, peer_id: str, address: str, out: Contribution, wire: WireCache) -> AsyncIterator[bytes]:
        faults = self.ctx.faults
        for frame in out.frames:
            if not faults.chunk_allowed(frame.index, address=address, phase=int(out.phase)):
                raise FaultInjected(f"stream to {peer_id} cut after {frame.index} chunks")
            if faults.plan.delay_s:
                await asyncio.sleep(faults.plan.delay_s)
            data = wire.chunks.get(frame.index)
            if data is None:
                data = wire.chunks[frame.index] = self.serialize(out, wire, frame.index, frame.compressed, frame.data)
            await self.ctx.upload.acquire(len(data))
            self.ctx.counters.sent(peer_id, len(data))
            yield data

    def serialize(self, out: Contribution, wire: WireCache, index: int, compressed: bool, payload: bytes) -> bytes:
        """One chunk of `out` as a serialized ContributionChunk (the same for every peer)."""
        header = wire.header
        if header is None:  # the tag and the header fields are the same for every chunk
            header = wire.header = header_of(out, swarm_id=self.ctx.cfg.swarm_id, tag=self.ctx.security.contribution_tag(
                round_id=out.round_id, sender_id=out.sender_id, codec=out.codec, weight=out.weight,
                total_elements=out.n_elements, contribution_digest=bound_digest(
                    out.digest, out.base_digest, out.phase, out.shard_index, out.members, out.contributors)))
        header.chunk_index = index
        header.compressed = compressed
        return serialize_chunk(header, payload)

    async def drain(self, *, timeout_s: float) -> None:
        """Give contributions still streaming to peers up to `timeout_s` to finish."""
        pushes = self.ctx.tasks.named("push-")
        if pushes:
            logger.info("waiting up to %.0f s for %d pushes still in flight", timeout_s, len(pushes),
                        extra=fields("draining", pushes=len(pushes)))
            await asyncio.wait(pushes, timeout=timeout_s)

    # ---- receiving --------------------------------------------------------------------------

    def push_method(self, admission: Admission) -> grpc.RpcMethodHandler:
        """PushContribution, reading raw chunk bytes (parsed here, without payload copies)."""

        async def push(request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> pb.PushAck:
            if self.ctx.leaving:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "node is shutting down")
            await admission.admit(context)
            try:
                got = await self.receive(request_iterator, proven_id=caller_id(context),
                                         certified_id=admission.certified_id(context) or "")
            except Refusal as exc:
                await admission.refuse(context, exc, "contribution")
            return pb.PushAck(chunks_received=got.data.count)

        return grpc.stream_unary_rpc_method_handler(push, request_deserializer=None,
                                                    response_serializer=pb.PushAck.SerializeToString)

    async def receive(self, chunks: AsyncIterator[Any], *, proven_id: str = "", certified_id: str = "",
                      fetched: Statement | None = None, carrier: str = "") -> Contribution:
        """Validate and file one incoming contribution stream, or (`fetched`: the statement of
        one we asked a holder for) validate it and hand it back without filing it. `carrier`:
        the member whose session delivered it (its own, or one it relays)."""
        first: Any = None
        first_key: tuple[Any, ...] = ()
        assembler: Assembler | None = None
        digest = ContributionDigest()
        loop, book = asyncio.get_running_loop(), self.ctx.book
        next_index = 0
        chunk: Any = None
        data: Any = None
        task, aborted = asyncio.current_task(), []

        def abort(reason: str) -> None:  # the book ends a stream whose round closed, or that idles
            aborted.append(reason)
            if task is not None:
                task.cancel()

        stream = chunks.__aiter__()
        try:
            while True:
                try:  # a stream that never sends its first chunk is not yet in the book: bound it here
                    data = await (stream.__anext__() if first is not None
                                  else asyncio.wait_for(stream.__anext__(), timeout=book.idle_s))
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    raise Refusal("DEADLINE_EXCEEDED", f"PushContribution: no chunk for {book.idle_s:.0f} s; "
                                  "send a stream's chunks without pausing") from None
                chunk = parse_chunk(data, next_index)
                header = chunk.header if isinstance(chunk, ChunkView) else chunk
                if first is None:
                    if fetched is None:
                        if carrier and header.sender_id != carrier:
                            self.inbound.check_relayed(header, carrier)
                        else:
                            self.inbound.check_sender(header, proven_id, certified_id)
                        assembler = self.inbound.open_stream(header, abort)
                    else:
                        assembler = self.inbound.open_fetched(header, fetched)
                    first, first_key = header, stream_key(header)
                else:
                    check_same_stream(first_key, header)
                assert assembler is not None
                if chunk.chunk_index != next_index:
                    raise Refusal("INVALID_ARGUMENT", f"round {first.round_id}: {first.sender_id} sent chunk "
                                  f"{chunk.chunk_index} where chunk {next_index} was due; chunks go in order, once each")
                next_index += 1
                await loop.run_in_executor(self.ctx.executor, take, assembler, chunk, digest)
                book.touch(first.round_id, first.sender_id, Phase(first.phase))
                self.ctx.counters.received(chunk.sender_id, chunk.ByteSize())
            if first is None or assembler is None:
                raise Refusal("INVALID_ARGUMENT", "empty contribution stream")
            if not assembler.complete:
                raise Refusal("DATA_LOSS", f"round {first.round_id}: stream from {first.sender_id} ended "
                              f"with {len(assembler.missing())} of {assembler.count} chunks missing; discarded")
            if digest.hexdigest() != first.contribution_digest:
                raise Refusal("DATA_LOSS", f"round {first.round_id}: contribution from {first.sender_id} "
                              "does not match its digest; discarded")
            peer = self.ctx.table.peers.get(first.sender_id)
            got = Contribution(
                round_id=first.round_id, sender_id=first.sender_id, codec=PB_TO_CODEC[first.codec],
                weight=first.weight, data=assembler, n_elements=first.total_elements,
                digest=first.contribution_digest, chunk_elements=first.chunk_elements, shuffled=first.shuffled,
                base_digest=first.base_digest, phase=Phase(first.phase), shard_index=first.shard_index,
                members=tuple(first.members), contributors=tuple(first.contributors), signature=first.signature,
                public_key=fetched.public_key if fetched is not None else peer.public_key if peer else b"")
            if fetched is None:
                book.finish(got)
                if self.relay is not None and not carrier and got.phase == Phase.WHOLE:
                    self.relay.contribution(got)  # if its maker cannot reach the other members nobody dials
            return got
        except RoundRefused as exc:
            raise Refusal(exc.code, str(exc)) from None
        except ValueError as exc:  # CodecError and friends: malformed payloads
            raise Refusal("INVALID_ARGUMENT", str(exc)) from None
        except asyncio.CancelledError:
            if not aborted or task is None:
                raise
            task.uncancel()  # our own abort, not the server's: answer it
            raise Refusal("ABORTED", f"{aborted[0]}; its buffer is freed") from None
        finally:
            if first is not None and fetched is None:
                book.abort(first.round_id, first.sender_id, Phase(first.phase))
            # A refusal's traceback keeps this frame alive until the garbage collector finds the
            # cycle: do not let it keep a partial contribution (megabytes) alive with it.
            assembler = chunk = data = None  # noqa: F841
