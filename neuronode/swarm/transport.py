"""The gRPC Transport: the averaging protocols' `Transport` over the swarm (outbox and round rules).

Sending round r: our contribution (already encoded into frames) goes to every member of the
round over one stream each (neuronode.swarm.links routes it: dialed, over the member's session,
or left to its relay), and again to members that appear while the round's push window
(`--sync-timeout`) is open; transient failures are retried until then. Receiving is the
inbound path's (neuronode.swarm.streams.inbound): complete contributions wait in the round book until
our round closes (neuronode.averaging.book).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from neuronode.averaging.agreement import Receipt, Statement, statement_of
from neuronode.averaging.lateness import CLOSED_HERE
from neuronode.averaging.transport import MemberView
from neuronode.codec import Contribution, Phase
from neuronode.events import fields
from neuronode.swarm.context import Context
from neuronode.swarm.faults import FaultInjected
from neuronode.swarm.links import Links, NoRoute, SessionClosed, retry_until
from neuronode.swarm.links.links import EARLY_STATUS_BUG, FINAL_CODES
from neuronode.swarm.membership.hosts import canonical_ip
from neuronode.swarm.membership.table import member_views, moved_past, reducers, round_peers
from neuronode.swarm.receipts.receipts import EQUIVOCATION_BAN_S, Receipts
from neuronode.swarm.streams.chunks import header_of, serialize_chunk
from neuronode.swarm.streams.headers import bound_digest
from neuronode.swarm.streams.inbound import Inbound
from neuronode.swarm.streams.missed import Missed
from neuronode.v1 import node_pb2 as pb

logger = logging.getLogger(__name__)


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
    # By id() of the contribution, while pushes of it are in flight (`in_flight`): the last one to
    # end lets the bytes go (a peer that appears later gets them serialized again).
    wire: dict[int, WireCache] = field(default_factory=dict)
    in_flight: int = 0
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
    """neuronode.averaging.Transport over the swarm's links (see the module docstring)."""

    def __init__(self, ctx: Context, *, links: Links, inbound: Inbound, receipts: Receipts,
                 publish_receipt: Callable[[Receipt], Receipt], own_host: Callable[[], str] = str) -> None:
        self.ctx = ctx
        self.links = links
        self.ledger = receipts
        self._publish = publish_receipt
        self._own_host = own_host  # the host our peers agree they see us at (neuronode.swarm.membership.reach)
        self._outbox: dict[tuple[Phase, int], Outbox] = {}
        self.missed = Missed(ctx, links=links, inbound=inbound)

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

    def moved_past(self, round_id: int) -> bool:
        return moved_past(self.ctx.table, round_id, round_lag=self.ctx.cfg.round_lag)

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

    def own_host(self) -> str:
        return canonical_ip(self._own_host())

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

    def keep_round(self, round_id: int, contributions: Iterable[Contribution]) -> None:
        kept = list(contributions)
        for c in kept:
            if c.sender_id == self.node_id:
                self.sign(c)  # our averaged update: served as we signed it
        self.missed.keep_round(round_id, kept)

    async def fetch_update(self, round_id: int, holders: list[str], *, base_digest: str,
                           timeout_s: float) -> Contribution | None:
        return await self.missed.fetch_update(round_id, holders, base_digest=base_digest, timeout_s=timeout_s)

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
        self.links.relay.pending()
        now, lag = self.ctx.clock.now(), self.ctx.cfg.round_lag
        for (phase, round_id), box in self._outbox.items():
            if now >= box.deadline:
                continue
            for peer in self.ctx.table.alive():
                if peer.node_id in box.pushed or not self.links.deliverable(peer.node_id):
                    continue  # no route yet: no address (it is learning it), or its session is not up
                refused = box.refused_at.get(peer.node_id)
                if refused is not None and (peer.round == refused or peer.round > round_id):
                    continue  # it refused the round where it still is, or it closed the round
                if box.targets is None and peer.round + lag < round_id:
                    continue  # behind: it will catch up by state transfer instead
                listener = phase == Phase.AVERAGED and peer.contributes_from == round_id + 1
                if box.targets is not None and peer.node_id not in box.targets and not listener:
                    continue  # reduce-scatter: members, plus listeners for the averaged shards
                out = box.for_peer(peer.node_id)
                if out is None:
                    continue
                box.pushed.add(peer.node_id)
                box.in_flight += 1
                self.ctx.tasks.spawn(self.push(peer.node_id, out, box),
                                     f"push-r{round_id}-p{int(phase)}-{peer.node_id}")

    async def push(self, peer_id: str, out: Contribution, box: Outbox) -> None:
        """Stream `out` to one peer, retrying transient failures until the window closes."""
        what, hidden = f"round {out.round_id}: {out.phase.label} to {peer_id}", [0]  # refusals grpcio hid

        async def attempt(left: float) -> bool:
            ctx, sent = self.ctx, 0
            ctx.upload_meter.begin(ctx.clock.now())
            try:
                # A stream begun in the window may finish in the next: receivers wait for one that moves.
                await self.links.stream(peer_id, self.chunks(peer_id, out, box.cache(out)),
                                        timeout_s=left + ctx.cfg.sync_timeout_s)
                sent = out.frame_bytes
            except (NoRoute, SessionClosed, TimeoutError, FaultInjected) as exc:
                logger.debug("%s failed (%s); retrying", what, exc)
                return False
            except grpc.aio.AioRpcError as exc:
                return self.refused(peer_id, out, box, exc, hidden)
            finally:
                ctx.upload_meter.end(ctx.clock.now(), sent)
            logger.debug("round %d: sent our %s to %s", out.round_id, out.phase.label, peer_id,
                         extra=fields("pushed", round_id=out.round_id, peer_id=peer_id, phase=out.phase.name.lower()))
            return True

        try:
            await retry_until(box.deadline, self.ctx.clock, attempt)
        finally:
            box.in_flight -= 1
            if not box.in_flight:
                box.wire.clear()

    def refused(self, peer_id: str, out: Contribution, box: Outbox, exc: grpc.aio.AioRpcError, hidden: list[int]) -> bool:
        """A failed push: True when retrying cannot help (a refusal), False to retry."""
        if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and (peer := self.ctx.table.peers.get(peer_id)):
            box.refused_at[peer_id] = peer.round  # push_pending retries once it moved
            box.pushed.discard(peer_id)
            if CLOSED_HERE in (exc.details() or ""):  # it closed the round without us: we wait for it no more there
                self.ctx.book.lateness.left(out.phase, out.round_id, peer_id)
                self.ctx.book.notify()
        if exc.code() in FINAL_CODES:
            logger.warning("round %d: peer %s refused our contribution: %s", out.round_id, peer_id, exc.details(),
                           extra=fields("push_refused", round_id=out.round_id, peer_id=peer_id, code=exc.code().name))
            return True
        if exc.code() == grpc.StatusCode.INTERNAL and exc.details() == EARLY_STATUS_BUG:
            hidden[0] += 1
            if hidden[0] >= 3:
                logger.warning("round %d: peer %s keeps ending our stream early (a refusal grpcio reports as "
                               "INTERNAL); giving up", out.round_id, peer_id)
                return True
        logger.debug("round %d: %s to %s failed (%s); retrying", out.round_id, out.phase.label, peer_id,
                     exc.code().name)
        return False

    async def chunks(self, peer_id: str, out: Contribution, wire: WireCache) -> AsyncIterator[bytes]:
        faults, peer = self.ctx.faults, self.ctx.table.peers.get(peer_id)
        address = peer.address if peer is not None else ""
        for frame in out.frames:
            if not faults.chunk_allowed(frame.index, address=address, phase=int(out.phase)):
                raise FaultInjected(f"stream to {peer_id} cut after {frame.index} chunks")
            if faults.plan.delay_s:
                await self.ctx.clock.sleep(faults.plan.delay_s)
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
