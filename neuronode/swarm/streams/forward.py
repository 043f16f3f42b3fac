"""Forwarding under `--averaging gather`: a whole contribution a member receives goes on to its
children in the maker's tree (neuronode.averaging.sortition), exactly as its maker signed it, so
that no maker uploads N copies.

Each receiver checks the maker's signature on the statement and the digest over the chunks,
whoever delivered it (neuronode.swarm.streams.inbound), so a forwarder can drop or delay what it
forwards, never alter it undetected; the round book charges a stall to the forwarder (`via`),
and a child that missed a contribution fetches it from a member whose receipt lists it
(neuronode.swarm.streams.missed). The chunks are serialized once for all children (off the event loop)
and let go when the last forward ends; forwards are retried until the push window closes
(--sync-timeout after the contribution arrived), as our own pushes are.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from neuronode.averaging.sortition import Draws
from neuronode.codec import Contribution, Phase
from neuronode.events import fields
from neuronode.swarm.context import Context
from neuronode.swarm.links import Links, NoRoute, SessionClosed, retry_until
from neuronode.swarm.links.links import FINAL_CODES
from neuronode.swarm.membership.table import round_peers
from neuronode.swarm.streams.chunks import maker_chunks

logger = logging.getLogger(__name__)


@dataclass
class Copy:
    """One contribution's chunks, serialized once for every child, while forwards of it run."""

    contribution: Contribution
    chunks: list[bytes] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    forwards: int = 0


class Forward:
    """What we forward down the makers' trees (see the module docstring)."""

    def __init__(self, ctx: Context, *, links: Links) -> None:
        self.ctx = ctx
        self.links = links
        self.draws = Draws(ctx.cfg.settings.gather_makers)
        self.bytes_forwarded = 0

    def children(self, c: Contribution) -> list[str]:
        """Our children in `c`'s maker's tree for its round ([] unless the swarm gathers)."""
        ctx = self.ctx
        k = ctx.cfg.settings.gather_makers
        if ctx.cfg.settings.averaging != "gather" or c.phase != Phase.WHOLE or not k:
            return []
        me = ctx.cfg.node_id
        draw = self.draws.current(c.round_id, c.base_digest,
                                  round_peers(ctx.table, c.round_id, round_lag=ctx.cfg.round_lag) | {me})
        return [child for child in draw.children(c.sender_id, me, k) if child != c.sender_id]

    def contribution(self, c: Contribution) -> None:
        """A whole contribution pushed or forwarded to us, complete and checked: on to our children."""
        children = self.children(c)
        if not children:
            return
        copy = Copy(c, forwards=len(children))
        ctx = self.ctx
        deadline = ctx.clock.now() + ctx.cfg.sync_timeout_s
        ctx.tasks.spawn(self.serialize(copy), f"forward-serialize-r{c.round_id}-{c.sender_id}")
        for child in children:
            ctx.tasks.spawn(self.forward(child, copy, deadline), f"push-forward-r{c.round_id}-{c.sender_id}-{child}")

    async def serialize(self, copy: Copy) -> None:
        c, ctx = copy.contribution, self.ctx
        try:
            async for data in maker_chunks(c, swarm_id=ctx.cfg.swarm_id, executor=ctx.executor,
                                           zstd_level=ctx.cfg.zstd_level):
                copy.chunks.append(data)
        finally:
            copy.ready.set()

    async def forward(self, child: str, copy: Copy, deadline: float) -> None:
        c, ctx = copy.contribution, self.ctx

        async def attempt(left: float) -> bool:
            try:
                await self.links.stream(child, self.chunks(child, copy), timeout_s=left + ctx.cfg.sync_timeout_s)
            except (NoRoute, SessionClosed, TimeoutError) as exc:
                logger.debug("round %d: forwarding %s's contribution to %s failed (%s); retrying", c.round_id,
                             c.sender_id, child, exc)
                return False
            except grpc.aio.AioRpcError as exc:
                return exc.code() in FINAL_CODES  # it holds it already, or refuses it: retrying cannot help
            logger.debug("round %d: forwarded %s's contribution to %s", c.round_id, c.sender_id, child,
                         extra=fields("forwarded", round_id=c.round_id, peer_id=child, sender=c.sender_id))
            return True

        try:
            await retry_until(deadline, ctx.clock, attempt)
        finally:
            copy.forwards -= 1
            if not copy.forwards:
                copy.chunks = []

    async def chunks(self, child: str, copy: Copy) -> AsyncIterator[bytes]:
        await copy.ready.wait()
        if len(copy.chunks) != copy.contribution.data.count:
            raise NoRoute("the contribution could not be serialized")
        for data in copy.chunks:
            await self.ctx.upload.acquire(len(data))
            self.bytes_forwarded += len(data)
            self.ctx.counters.sent(child, len(data))
            yield data
