"""Missed contributions: a member that lacks one its round agreed on (neuronode.averaging.agreement)
fetches it from a member that holds it, with FetchContribution; the holder serves what it
retained, chunk by chunk, exactly as its maker signed it. The fetcher checks it like any pushed
contribution (payload checks, digest) and against the statement it asked for, whose signature it
checked when a receipt listed it, so fetching from any holder is as safe as hearing the maker.

Bounds: a holder keeps what a phase averaged in its latest round only (RETAIN_ROUNDS; at most 2x
--sync-timeout), serves each caller at most MAX_FETCHES_PER_CALLER streams at once, and ends a
stream whose reader stalls for STALL_S or outlasts its deadline (as FetchState does).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import grpc

from neuronode.averaging.agreement import Statement, statement_of
from neuronode.codec import Contribution, Phase
from neuronode.events import fields
from neuronode.swarm.admission import Admission, member_request
from neuronode.swarm.chunks import maker_chunks
from neuronode.swarm.context import Context
from neuronode.swarm.inbound import Inbound
from neuronode.swarm.links import Links, NoRoute
from neuronode.swarm.security import caller_id
from neuronode.swarm.wire import MAX_ID_CHARS, MIN_RATE_BYTES_PER_S, STALL_S, Refusal
from neuronode.v1 import node_pb2 as pb

logger = logging.getLogger(__name__)

MAX_FETCHES_PER_CALLER = 2
# Rounds of a phase whose contributions we keep serving: the latest. What round r averaged is
# served from our receipt of it until our receipt of round r + 1, so a member back one round
# behind replays r while we collect r + 1 (which waits for it: it is a member of r + 1).
RETAIN_ROUNDS = 1


class Missed:
    """What we retain for others, what we serve them, and what we fetch ourselves."""

    def __init__(self, ctx: Context, *, links: Links, inbound: Inbound) -> None:
        self.ctx = ctx
        self.links = links
        self.inbound = inbound
        self.kept: dict[Statement, tuple[Contribution, float]] = {}  # -> until (the node's clock)
        self.serving: dict[str, int] = {}  # caller -> streams open

    # ---- holding -------------------------------------------------------------------------------

    def retain(self, round_id: int, phase: Phase, contributions: Iterable[Contribution], *, for_s: float) -> None:
        """Serve `contributions` instead of what we kept of `round_id`'s `phase`, for `for_s`
        at most; of that phase, rounds RETAIN_ROUNDS or more before it are let go now: short
        rounds must not pile up every member's contribution of every round until the time runs
        out (bench sync, all-to-all at 25M fp32: 3.2 GB peak RSS per node, 340,000 page faults
        a round; a node that retains one round: 1.6 GB, about 10,000)."""
        now = self.ctx.clock.now()
        self.expire(now)
        for s in [s for s in self.kept if s.phase == phase and (s.round_id == round_id
                                                               or s.round_id <= round_id - RETAIN_ROUNDS)]:
            del self.kept[s]
        for c in contributions:
            self.kept[statement_of(c)] = (c, now + for_s)

    def expire(self, now: float) -> None:
        for s in [s for s, (_, until) in self.kept.items() if until <= now]:
            del self.kept[s]

    @property
    def retained_bytes(self) -> int:
        return sum(c.data.size_bytes for c, _ in self.kept.values())

    def find(self, request: pb.ContributionRequest) -> Contribution | None:
        self.expire(self.ctx.clock.now())
        for s, (c, _) in self.kept.items():
            if (s.round_id, s.sender, int(s.phase), s.shard_index, s.body) == (
                    request.round_id, request.sender_id, request.phase, request.shard_index, request.body):
                return c
        return None

    # ---- fetching ------------------------------------------------------------------------------

    async def fetch(self, statement: Statement, holders: list[str], *, timeout_s: float) -> Contribution | None:
        """`statement`'s contribution from the first holder that serves it by the deadline."""
        ctx = self.ctx
        deadline = ctx.clock.now() + timeout_s
        for holder in holders:
            peer = ctx.table.peers.get(holder)
            remaining = deadline - ctx.clock.now()
            if remaining <= 0:
                break
            if peer is None or not ctx.table.is_alive(peer) or not self.links.dialable(peer):
                continue  # nobody dials a member that says it cannot be dialed
            request = ctx.security.sign_request("FetchContribution", pb.ContributionRequest(
                node_id=ctx.cfg.node_id, swarm_id=ctx.cfg.swarm_id, round_id=statement.round_id,
                sender_id=statement.sender, phase=int(statement.phase), shard_index=statement.shard_index,  # type: ignore[arg-type]
                body=statement.body), holder)
            try:
                call = await self.links.fetch(holder, "FetchContribution", request, timeout_s=remaining)
                got = await self.inbound.receive(call, fetched=statement)
            except (grpc.aio.AioRpcError, NoRoute) as exc:
                logger.debug("round %d: %s could not serve %s's %s: %s", statement.round_id, holder,
                             statement.sender, statement.phase.label, exc)
                continue
            except Refusal as exc:
                logger.warning("round %d: %s served a bad copy of %s's %s: %s", statement.round_id, holder,
                               statement.sender, statement.phase.label, exc,
                               extra=fields("bad_copy", round_id=statement.round_id, peer_id=holder))
                continue
            logger.info("round %d: fetched %s's %s from %s", statement.round_id, statement.sender,
                        statement.phase.label, holder, extra=fields("fetched", round_id=statement.round_id,
                                                                    peer_id=holder, sender=statement.sender))
            return got
        return None

    # ---- serving -------------------------------------------------------------------------------

    def method(self, admission: Admission) -> grpc.RpcMethodHandler:
        """FetchContribution, answering raw chunk bytes (written with context.write under the
        stall and total deadlines)."""

        async def serve(request: pb.ContributionRequest, context: grpc.aio.ServicerContext) -> None:
            if self.ctx.leaving:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "node is shutting down")
            await admission.admit(context, request.node_id)
            try:
                caller, c = self.admit(request, caller_id(context))
                self.serving[caller] = self.serving.get(caller, 0) + 1
                try:
                    await self.stream(c, caller, context)
                finally:
                    self.serving[caller] -= 1
                    if not self.serving[caller]:
                        del self.serving[caller]
            except Refusal as exc:
                await admission.refuse(context, exc, "contribution request")

        return grpc.unary_stream_rpc_method_handler(serve, request_deserializer=pb.ContributionRequest.FromString,
                                                    response_serializer=None)

    def admit(self, request: pb.ContributionRequest, proven_id: str) -> tuple[str, Contribution]:
        """The member its signature proves asks (its fetch slots' key), and the contribution it
        asks for; raises Refusal otherwise."""
        caller = member_request(self.ctx, "FetchContribution", request, proven_id, "contributions are served")
        if self.serving.get(caller, 0) >= MAX_FETCHES_PER_CALLER:
            raise Refusal("RESOURCE_EXHAUSTED", f"{MAX_FETCHES_PER_CALLER} contribution fetches of yours are "
                          "already streaming here; fetch the next once one finished")
        c = self.find(request)
        if c is None:
            raise Refusal("NOT_FOUND", f"round {request.round_id}: this node does not hold that contribution of "
                          f"{request.sender_id[:MAX_ID_CHARS]} (never received, or no longer kept); ask another holder")
        return caller, c

    async def stream(self, c: Contribution, caller: str, context: grpc.aio.ServicerContext) -> None:
        ctx = self.ctx
        started = ctx.clock.now()
        budget = max(2 * STALL_S, c.data.size_bytes / MIN_RATE_BYTES_PER_S)
        async for data in maker_chunks(c, swarm_id=ctx.cfg.swarm_id, executor=ctx.executor,
                                       zstd_level=ctx.cfg.zstd_level):
            await ctx.upload.acquire(len(data))
            remaining = started + budget - ctx.clock.now()
            try:
                await asyncio.wait_for(context.write(data), timeout=max(0.0, min(STALL_S, remaining)))
            except TimeoutError:
                raise Refusal("DEADLINE_EXCEEDED", f"contribution fetch ended: nothing was read for {STALL_S:.0f} s "
                              "or it ran past its deadline") from None
            ctx.counters.sent(caller, len(data))
        logger.info("round %d: served %s's %s to %s", c.round_id, c.sender_id, c.phase.label, caller,
                    extra=fields("served_contribution", round_id=c.round_id, peer_id=caller, sender=c.sender_id))
