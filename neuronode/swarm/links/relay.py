"""Relays: how two members that nobody can dial (behind NAT, nothing forwarded) reach each other.

Each such member holds a session to every reachable member (neuronode.swarm.links.sessions)
and dials them for everything it sends. A reachable member that carries sessions forwards, over the
receiver's session, what one home member sent it and another needs:

- its Hellos, exactly as it signed them: the receiver checks them as if their maker had called
  (so home members know each other's rounds, digests and receipts);
- its contributions, as it signed them: the receiver checks the maker's signature on the
  statement, whoever delivered it (neuronode.swarm.streams.inbound).

One relay per (maker, receiver): among the members the receiver says carry its sessions
(`NodeInfo.carried_by`), the live one ranked first by a hash of (maker, receiver, member)
(neuronode.swarm.links.route, where the sender reckons the same).
The load spreads over the reachable members, and when the one in charge goes, the receiver's
list changes and the next takes over. A relay can drop or delay what it forwards, never alter it
undetected; a contribution it drops is fetched from another member whose receipt lists it
(neuronode.swarm.streams.missed), or missed as any withheld one.

Bounds: forwarded chunks go at most at --max-relay-mbps (on top of --max-upload-mbps, which
they share with everything the node sends) and only within the contribution's push window
(--sync-timeout after it arrived) while our round is at most one past it, so a relay holds at
most two rounds of each home member's contribution; a relayed Hello waits in the session's
control lane, replaced by its maker's next one. `bytes_relayed` in status counts what went out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from neuronode.codec import Contribution
from neuronode.events import fields
from neuronode.swarm.context import Context
from neuronode.swarm.guard.ratelimit import UploadLimiter
from neuronode.swarm.links.backoff import retry_until
from neuronode.swarm.links.lanes import SessionClosed
from neuronode.swarm.links.route import live_carriers, relay_for
from neuronode.swarm.links.sessions import Sessions
from neuronode.swarm.membership.table import MAX_MEMBERS
from neuronode.swarm.streams.chunks import maker_chunks
from neuronode.v1 import node_pb2 as pb

logger = logging.getLogger(__name__)

MAX_CARRIERS = 64  # members a NodeInfo may name in carried_by


class Relay:
    """What we forward between members that nobody can dial (see the module docstring)."""

    def __init__(self, ctx: Context, *, sessions: Sessions) -> None:
        self.ctx = ctx
        self.sessions = sessions
        self.limit = UploadLimiter(ctx.cfg.max_relay_mbps)
        self.bytes_relayed = 0
        # (round, maker) -> a whole contribution pushed to us, and the end of its push window
        self.held: dict[tuple[int, str], tuple[Contribution, float]] = {}
        self.forwarded: set[tuple[int, str, str]] = set()  # (round, maker, receiver) started
        # (round, maker, receiver) -> the carrier in charge of it when the contribution came (not us)
        self.deferred: dict[tuple[int, str, str], str] = {}
        self.hellos: dict[str, pb.HelloRequest] = {}  # the last Hello of each member nobody can dial

    def receivers(self, maker: str) -> list[str]:
        """Members whose session we carry and to which we relay for `maker`."""
        ctx, me = self.ctx, self.ctx.cfg.node_id
        if ctx.reachable == "no":
            return []  # we cannot be dialed: nobody sends us anything to relay
        out = []
        for receiver in sorted(self.sessions.carried):
            peer = ctx.table.peers.get(receiver)
            if receiver == maker or peer is None or not ctx.table.is_alive(peer):
                continue
            if relay_for(maker, receiver, live_carriers(peer, ctx.table, me=me) | {me}) == me:
                out.append(receiver)
        return out

    def hello(self, request: pb.HelloRequest) -> None:
        """A Hello a member nobody can dial sent us: on to the members we relay to for it (and
        kept: it goes ahead of each contribution of its maker we forward, so the receiver knows
        the maker first)."""
        maker = request.info.node_id
        self.hellos[maker] = request
        if len(self.hellos) > MAX_MEMBERS:  # the peer table's size
            live = {p.node_id for p in self.ctx.table.alive()}
            self.hellos = {k: v for k, v in self.hellos.items() if k in live}
        receivers = self.receivers(maker)
        if receivers:
            msg = pb.SessionMessage(relayed=request)
            for receiver in receivers:
                self.sessions.offer(receiver, maker, msg)

    def contribution(self, c: Contribution) -> None:
        """A whole contribution its maker pushed us: kept for its push window, forwarded to the
        members we relay to for it once its maker says nobody can dial it (now, or when it
        decides so, or when a receiver's session comes up: `pending`). One of a maker we can
        dial is not kept: it reaches everyone itself (and a public swarm keeps nothing longer)."""
        ctx, now = self.ctx, self.ctx.clock.now()
        maker = ctx.table.peers.get(c.sender_id)
        if ctx.reachable == "no" or maker is None or ctx.table.dialable(maker):
            return
        self.held[(c.round_id, c.sender_id)] = (c, now + ctx.cfg.sync_timeout_s)
        me = ctx.cfg.node_id
        for receiver in sorted(self.sessions.carried):  # receivers another carrier relays to now
            peer = ctx.table.peers.get(receiver)
            if receiver != c.sender_id and peer is not None and ctx.table.is_alive(peer):
                carrier = relay_for(c.sender_id, receiver, live_carriers(peer, ctx.table, me=me) | {me})
                if carrier not in (None, me):
                    self.deferred[(c.round_id, c.sender_id, receiver)] = carrier
        self.pending()

    def stale(self, c: Contribution, deadline: float, now: float) -> bool:
        """Past its push window, or of a round the swarm left (we are two rounds on: in step,
        nobody takes it any more). Short rounds under a long --sync-timeout keep no backlog."""
        return deadline <= now or c.round_id + 1 < self.ctx.state.round

    def pending(self) -> None:
        """Start the forwards we owe: cheap to call on every message a peer sends."""
        if not self.held:
            return
        now, table, lag = self.ctx.clock.now(), self.ctx.table, self.ctx.cfg.round_lag
        for key, (c, deadline) in list(self.held.items()):
            if self.stale(c, deadline, now):
                del self.held[key]
                self.forwarded = {f for f in self.forwarded if f[:2] != key}
                self.deferred = {f: v for f, v in self.deferred.items() if f[:2] != key}
                continue
            maker = table.peers.get(c.sender_id)
            if maker is None or maker.reachable:
                continue  # the others dial it themselves
            for receiver in self.receivers(c.sender_id):
                peer = table.peers.get(receiver)
                if peer is None or not peer.round <= c.round_id <= peer.round + lag:
                    continue  # it could not take it now (behind: it catches up first; or past the round): later
                if (*key, receiver) not in self.forwarded:
                    self.forwarded.add((*key, receiver))
                    if (was := self.deferred.pop((*key, receiver), None)) is not None:
                        logger.warning("round %d: relaying %s's %s to %s now: its relay %s is gone (it died, left, "
                                       "or carries %s no more)", c.round_id, c.sender_id, c.phase.label, receiver,
                                       was, receiver, extra=fields("relay_failover", round_id=c.round_id,
                                                                   peer_id=receiver, sender=c.sender_id, relay=was))
                    self.ctx.tasks.spawn(self.forward(receiver, c, deadline),
                                         f"push-relay-r{c.round_id}-{c.sender_id}-{receiver}")

    async def forward(self, receiver: str, c: Contribution, deadline: float) -> None:
        async def attempt(left: float) -> bool:
            hello = self.hellos.get(c.sender_id)
            try:
                await asyncio.wait_for(self.sessions.push(
                    receiver, self.chunks(receiver, c),
                    first=(c.sender_id, pb.SessionMessage(relayed=hello)) if hello is not None else None),
                    timeout=left + self.ctx.cfg.sync_timeout_s)  # begun in the window, it may finish in the next
            except (SessionClosed, TimeoutError) as exc:
                logger.debug("round %d: relaying %s's %s to %s failed (%s); retrying", c.round_id, c.sender_id,
                             c.phase.label, receiver, exc)
                return False
            logger.debug("round %d: relayed %s's %s to %s", c.round_id, c.sender_id, c.phase.label, receiver,
                         extra=fields("relayed", round_id=c.round_id, peer_id=receiver, sender=c.sender_id))
            return True

        await retry_until(deadline, self.ctx.clock, attempt)

    async def chunks(self, receiver: str, c: Contribution) -> AsyncIterator[bytes]:
        """`c`'s chunks as its maker signed them, at the relay's and the node's upload caps."""
        ctx = self.ctx
        async for data in maker_chunks(c, swarm_id=ctx.cfg.swarm_id, executor=ctx.executor,
                                       zstd_level=ctx.cfg.zstd_level):
            await self.limit.acquire(len(data))
            await ctx.upload.acquire(len(data))
            self.bytes_relayed += len(data)
            ctx.counters.sent(receiver, len(data))
            yield data
