"""Missed contributions: a member that lacks one its round agreed on (neuronode.averaging.agreement)
fetches it from a member that holds it, with FetchContribution; the holder serves what it
retained, chunk by chunk, exactly as its maker signed it. The fetcher checks it like any pushed
contribution (payload checks, digest) and against the statement it asked for, whose signature it
checked when a receipt listed it, so fetching from any holder is as safe as hearing the maker.

Catching up by rounds (docs/protocol.md, "Catching up by rounds"): a member also keeps, for
each of its CATCHUP_ROUNDS newest rounds, what a member that holds the round's start needs to
apply it: the averaged update it applied (one fp32 contribution of phase UPDATE, signed by it,
served to FetchContribution with that phase and an empty body), or the round's agreed
contributions, whichever is fewer bytes (`keep_round`; the caller decides). The fetcher checks
an update's header and signature as it reads it (neuronode.swarm.streams.inbound), and what it applies
against the digests a quorum of hosts published for the round's end (neuronode.node.catchup).

Bounds: a holder keeps what a phase averaged in its latest round only (RETAIN_ROUNDS; at most 2x
--sync-timeout), or while its round is one it keeps for catching up (CATCHUP_ROUNDS rounds, each
at most the update's 4 bytes per parameter: 12 bytes per parameter in all, 1.5 times the fp32
state with its momentum), serves each caller host FETCHES_PER_HOST streams at once and
MAX_FETCHES in all, and ends a stream whose reader does not keep the pace
(neuronode.swarm.statesync.serving, as FetchState does): k ids on one host take one host's share of our
uplink, never the rest of it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc

from neuronode.averaging.agreement import Statement, statement_of
from neuronode.codec import Contribution, Phase
from neuronode.events import fields
from neuronode.quorum import voice
from neuronode.swarm.context import Context
from neuronode.swarm.guard.admission import Admission, caller_host, end_call, member_request
from neuronode.swarm.guard.interceptors import caller_id
from neuronode.swarm.links import Links, NoRoute
from neuronode.swarm.statesync.serving import Pace, Slots
from neuronode.swarm.streams.chunks import maker_chunks
from neuronode.swarm.streams.inbound import Inbound
from neuronode.swarm.wire import MAX_ID_CHARS, STALL_S, Refusal
from neuronode.v1 import node_pb2 as pb

logger = logging.getLogger(__name__)

FETCHES_PER_HOST = 2  # contribution streams served at once to one caller host
MAX_FETCHES = 4  # ... and to all callers together
CATCHUP_ROUNDS = 3  # rounds a member keeps for catching up (the receipts of as many ride in every Hello)
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
        self.slots = Slots(per_host=FETCHES_PER_HOST, total=MAX_FETCHES, what="contribution fetches")
        self.rounds: dict[int, list[Statement]] = {}  # round -> what we keep of it for catching up
        self.stall_s = STALL_S  # a stream nothing is read from for this long is ended

    @property
    def serving(self) -> dict[str, int]:
        """Streams open per caller host (voice)."""
        return self.slots.held

    # ---- holding -------------------------------------------------------------------------------

    def retain(self, round_id: int, phase: Phase, contributions: Iterable[Contribution], *, for_s: float) -> None:
        """Serve `contributions` instead of what we kept of `round_id`'s `phase`, for `for_s`
        at most; of that phase, rounds RETAIN_ROUNDS or more before it are let go now: short
        rounds must not pile up every member's contribution of every round until the time runs
        out (bench sync, all-to-all at 25M fp32: 3.2 GB peak RSS per node, 340,000 page faults
        a round; a node that retains one round: 1.6 GB, about 10,000)."""
        now = self.ctx.clock.now()
        self.expire(now)
        pinned = {s for kept in self.rounds.values() for s in kept}  # what catching up needs stays
        for s in [s for s in self.kept if s.phase == phase and s not in pinned
                  and (s.round_id == round_id or s.round_id <= round_id - RETAIN_ROUNDS)]:
            del self.kept[s]
        for c in contributions:
            s = statement_of(c)
            if s not in pinned:
                self.kept[s] = (c, now + for_s)

    def keep_round(self, round_id: int, contributions: Iterable[Contribution]) -> None:
        """Keep what catching up by `round_id` needs (our averaged update, or the round's agreed
        contributions) while it is one of our CATCHUP_ROUNDS newest kept rounds; older rounds
        are let go."""
        statements = []
        for c in contributions:
            s = statement_of(c)
            self.kept[s] = (c, math.inf)
            statements.append(s)
        self.rounds[round_id] = statements
        for r in sorted(self.rounds)[:-CATCHUP_ROUNDS]:
            for s in self.rounds.pop(r):
                self.kept.pop(s, None)

    @property
    def kept_rounds(self) -> list[int]:
        """The rounds we keep for catching up (oldest first)."""
        return sorted(self.rounds)

    def expire(self, now: float) -> None:
        for s in [s for s, (_, until) in self.kept.items() if until <= now]:
            del self.kept[s]

    @property
    def retained_bytes(self) -> int:
        return sum(c.data.size_bytes for c, _ in self.kept.values())

    def find(self, request: pb.ContributionRequest) -> Contribution | None:
        """What `request` asks for: the contribution its statement names, or (phase UPDATE, our
        own id, body empty) our averaged update of its round."""
        self.expire(self.ctx.clock.now())
        update = request.phase == Phase.UPDATE and not request.body
        for s, (c, _) in self.kept.items():
            if (s.round_id, s.sender, int(s.phase), s.shard_index) == (
                    request.round_id, request.sender_id, request.phase, request.shard_index) \
                    and (update or s.body == request.body):
                return c
        return None

    # ---- fetching ------------------------------------------------------------------------------

    async def fetch(self, statement: Statement, holders: list[str], *, timeout_s: float) -> Contribution | None:
        """`statement`'s contribution from the first holder that serves it by the deadline."""
        return await self.from_holders(
            statement.round_id, statement.sender, statement.phase, holders, timeout_s=timeout_s,
            ask=lambda holder: pb.ContributionRequest(
                round_id=statement.round_id, sender_id=statement.sender, phase=int(statement.phase),  # type: ignore[arg-type]
                shard_index=statement.shard_index, body=statement.body),
            receive=lambda holder, call: self.inbound.receive(call, fetched=statement))

    async def fetch_update(self, round_id: int, holders: list[str], *, base_digest: str,
                           timeout_s: float) -> Contribution | None:
        """The averaged update of `round_id` the first of `holders` that keeps one applied
        (made from `base_digest`, signed by that holder), by the deadline."""
        return await self.from_holders(
            round_id, "", Phase.UPDATE, holders, timeout_s=timeout_s,
            ask=lambda holder: pb.ContributionRequest(round_id=round_id, sender_id=holder,
                                                      phase=int(Phase.UPDATE)),  # type: ignore[arg-type]
            receive=lambda holder, call: self.inbound.receive(call, update=(round_id, holder, base_digest)))

    async def from_holders(self, round_id: int, sender: str, phase: Phase, holders: list[str], *, timeout_s: float,
                           ask: Callable[[str], pb.ContributionRequest],
                           receive: Callable[[str, AsyncIterator[Any]], Awaitable[Contribution]]) -> Contribution | None:
        """What `ask(holder)` requests, from the first holder that serves it whole (`receive`
        checks it) by the deadline; None if none does. `sender` "": each holder's own."""
        ctx = self.ctx
        deadline = ctx.clock.now() + timeout_s
        for holder in holders:
            peer = ctx.table.peers.get(holder)
            remaining = deadline - ctx.clock.now()
            if remaining <= 0:
                break
            if peer is None or not ctx.table.is_alive(peer) or not self.links.dialable(peer):
                continue  # nobody dials a member that says it cannot be dialed
            request = ask(holder)
            request.node_id, request.swarm_id = ctx.cfg.node_id, ctx.cfg.swarm_id
            request = ctx.security.sign_request("FetchContribution", request, holder)
            maker = sender or holder
            try:
                call = await self.links.fetch(holder, "FetchContribution", request, timeout_s=remaining)
                got = await receive(holder, call)
            except (grpc.aio.AioRpcError, NoRoute) as exc:
                logger.debug("round %d: %s could not serve %s's %s: %s", round_id, holder, maker, phase.label, exc)
                continue
            except Refusal as exc:
                logger.warning("round %d: %s served a bad copy of %s's %s: %s", round_id, holder, maker,
                               phase.label, exc, extra=fields("bad_copy", round_id=round_id, peer_id=holder))
                continue
            logger.info("round %d: fetched %s's %s from %s", round_id, maker, phase.label, holder,
                        extra=fields("fetched", round_id=round_id, peer_id=holder, sender=maker))
            return got
        return None

    # ---- serving -------------------------------------------------------------------------------

    def method(self, admission: Admission) -> grpc.RpcMethodHandler:
        """FetchContribution, answering raw chunk bytes (written with context.write under the
        stall and total deadlines)."""

        async def serve(request: pb.ContributionRequest, context: grpc.aio.ServicerContext) -> None:
            if self.ctx.leaving:
                await end_call(context, grpc.StatusCode.UNAVAILABLE, "node is shutting down")
            await admission.admit(context, request.node_id)
            try:
                caller, c = self.admit(request, caller_id(context))
                with self.slots.take(voice(caller, caller_host(context))):  # its host's slot, never its id's
                    await self.stream(c, caller, context)
            except Refusal as exc:
                await admission.refuse(context, exc, "contribution request")

        return grpc.unary_stream_rpc_method_handler(serve, request_deserializer=pb.ContributionRequest.FromString,
                                                    response_serializer=None)

    def admit(self, request: pb.ContributionRequest, proven_id: str) -> tuple[str, Contribution]:
        """The member its signature proves asks, and the contribution it asks for; raises
        Refusal otherwise."""
        caller = member_request(self.ctx, "FetchContribution", request, proven_id, "contributions are served")
        c = self.find(request)
        if c is None:
            raise Refusal("NOT_FOUND", f"round {request.round_id}: this node does not hold that contribution of "
                          f"{request.sender_id[:MAX_ID_CHARS]} (never received, or no longer kept); ask another holder")
        return caller, c

    async def stream(self, c: Contribution, caller: str, context: grpc.aio.ServicerContext) -> None:
        ctx = self.ctx
        pace = Pace(ctx.clock.now, what="contribution fetch", stall_s=self.stall_s)
        async for data in maker_chunks(c, swarm_id=ctx.cfg.swarm_id, executor=ctx.executor,
                                       zstd_level=ctx.cfg.zstd_level):
            await pace.limited(ctx.upload.acquire(len(data)))
            await pace.write(context.write(data), len(data))
            ctx.counters.sent(caller, len(data))
        logger.info("round %d: served %s's %s to %s", c.round_id, c.sender_id, c.phase.label, caller,
                    extra=fields("served_contribution", round_id=c.round_id, peer_id=caller, sender=c.sender_id))
