"""The swarm side of a node: one object composed of the parts in this package, offering the
daemon a narrow interface and the averaging protocols their Transport. It moves encoded bytes
and knows nothing of models.

Parts: `links` (how a member is reached: routes, sessions, relays; every call goes through
it), `server` (the grpc.aio server and health), `service` (the gRPC handlers, with
`admission`), `inbound` (every contribution stream that comes in), `transport` (the outbox and
round rules: the averaging Transport), `peers` (Hello, heartbeats, announcements, agreement),
`reach` (dial-backs), `fetcher` and `donor` (state transfer). They share one `Context`
(settings, credentials, peer table, round book, round state), get what they need when they are
built, and the node is the `Inbox` its sessions hand what they deliver to.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from typing import Any

from neuronode.averaging import RoundBook, RoundState
from neuronode.clock import Clock
from neuronode.config import is_wildcard_host
from neuronode.state import GlobalState
from neuronode.swarm.context import Context, SwarmConfig, buffered_bytes_bound
from neuronode.swarm.faults import FaultPlan
from neuronode.swarm.guard.admission import Admission
from neuronode.swarm.guard.proofs import Security
from neuronode.swarm.guard.trust import closed_without_us, witnesses
from neuronode.swarm.links import Links
from neuronode.swarm.membership.lineage import CatchUp, believable, plan_catch_up
from neuronode.swarm.membership.peers import Peers
from neuronode.swarm.membership.reach import Reach, host_of, join_host_port
from neuronode.swarm.membership.table import PeerTable
from neuronode.swarm.receipts.receipts import Receipts
from neuronode.swarm.server import Counters, Server
from neuronode.swarm.service import NodeService
from neuronode.swarm.statesync.statesync import (
    Donor,
    StateFetch,
    StateProvider,
    TransferProgress,
    Verify,
)
from neuronode.swarm.streams.forward import Forward
from neuronode.swarm.streams.inbound import Inbound
from neuronode.swarm.transport import GrpcTransport
from neuronode.swarm.wire import PROTOCOL_VERSION
from neuronode.v1 import node_pb2 as pb

logger = logging.getLogger(__name__)

__all__ = ["SwarmConfig", "SwarmNode"]


class SwarmNode:
    """Server + clients of one node. Start with `start()`, stop with `stop()`."""

    def __init__(
        self, cfg: SwarmConfig, *, executor: Executor, state: RoundState | None = None,
        status_provider: Callable[[], dict[str, Any]] | None = None,
        state_provider: StateProvider | None = None, security: Security | None = None,
        clock: Clock | None = None, loopback_only: bool = False,
        on_download: Callable[[TransferProgress], None] = lambda progress: None,
    ) -> None:
        self.state = state or RoundState()
        ctx = self.ctx = Context(cfg, security=security or Security(node_id=cfg.node_id, swarm_id=cfg.swarm_id),
                                 state=self.state, executor=executor, clock=clock or Clock(),
                                 loopback_only=loopback_only)
        self.status_provider = status_provider or dict
        self.receipts = Receipts(ctx, on_change=ctx.book.notify, on_want=self._want)
        self.links = Links(ctx, inbox=self)
        self.sessions, self.relay = self.links.sessions, self.links.relay
        self.reach = Reach(ctx, links=self.links, on_change=self._reach_changed)
        self.peers = Peers(ctx, links=self.links, receipts=self.receipts, on_news=self._news, observe=self.reach.observe)
        self.forward = Forward(ctx, links=self.links)
        self.inbound = Inbound(ctx, relay=self.relay, forward=self.forward)
        self.transport = GrpcTransport(ctx, links=self.links, inbound=self.inbound, receipts=self.receipts,
                                       publish_receipt=self.peers.publish_receipt,
                                       own_host=lambda: self.reach.observed_host)
        self.fetcher = StateFetch(ctx, links=self.links, on_progress=on_download)
        self.donor = Donor(provider=state_provider, manifest_hash=cfg.manifest_hash, zstd_level=cfg.zstd_level,
                           executor=executor, security=ctx.security, upload=ctx.upload.acquire)
        admission = Admission(ctx)
        service = NodeService(ctx, admission=admission, peers=self.peers, reach=self.reach, donor=self.donor,
                              status=self.status)
        self.server = Server(ctx.security, servicer=service,
                             methods={"PushContribution": self.inbound.method(admission),
                                      "FetchContribution": self.transport.missed.method(admission),
                                      "Session": self.sessions.method(admission)},
                             admit=admission.admit_local_or_member)
        self._epoch = self.state.epoch
        self.state.on_change.append(self._state_changed)
        # What tests and the daemon read most (the same objects as the context's).
        self.cfg: SwarmConfig = cfg
        self.table: PeerTable = ctx.table
        self.book: RoundBook = ctx.book
        self.counters: Counters = ctx.counters

    @property
    def advertise(self) -> str:
        """The address peers dial (known once the server is bound)."""
        return self.ctx.advertise

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> str:
        """Bind the server and start heartbeats; returns the address peers should dial."""
        ctx = self.ctx
        bound = ctx.bound_port = await self.server.start(ctx.cfg.listen)
        if not ctx.advertise or ctx.advertise.endswith(":0"):
            adv_host = host_of(ctx.advertise or ctx.cfg.listen)
            # A wildcard says nothing about where peers reach us: learned from them (reach.py).
            ctx.advertise = "" if is_wildcard_host(adv_host) else join_host_port(adv_host, bound)
        ctx.faults.self_address = ctx.advertise
        ctx.started = True
        ctx.tasks.supervise(self.peers.heartbeats, "heartbeats")
        ctx.tasks.supervise(self.watch_streams, "stream-watch")
        ctx.tasks.supervise(self.reach.run, "reachability")
        ctx.tasks.supervise(self.sessions.hold_all, "sessions")
        logger.info("node %s serving on %s (%s)", ctx.cfg.node_id, ctx.cfg.listen.replace(":0", f":{bound}"),
                    f"advertised as {ctx.advertise}" if ctx.advertise else "its address learned from what peers see")
        return ctx.advertise

    async def set_serving(self, serving: bool) -> None:
        await self.server.set_serving(serving)

    async def stop(self, *, grace_s: float = 2.0) -> None:
        """Tell peers we leave, stop the server (grace for calls in flight), close channels."""
        ctx = self.ctx
        ctx.leaving = True
        await self.server.leaving()
        peers = [p for p in ctx.table.alive() if self.links.dialable(p)]
        if peers:
            await asyncio.gather(*(self.peers.leave(p.node_id) for p in peers), return_exceptions=True)
        await ctx.tasks.stop()
        await self.server.stop(grace_s)
        await ctx.channels.close_all()

    async def watch_streams(self) -> None:
        """Abort contribution streams that stopped sending (the round book's idle limit)."""
        while True:
            self.ctx.book.expire()
            await self.ctx.clock.sleep(1.0)

    async def drain(self, *, timeout_s: float) -> None:
        """Before we go: let our last pushes finish, and stay (serving what others fetch from us)
        until every live peer reached our round, so that a member slower to close the last round
        can still fetch a contribution it missed. At most `timeout_s` in all."""
        ctx = self.ctx
        deadline = ctx.clock.now() + timeout_s
        await self.transport.drain(timeout_s=timeout_s)
        while (left := deadline - ctx.clock.now()) > 0:
            changed = ctx.book.changed()
            behind = sorted(p.node_id for p in ctx.table.alive() if p.round < self.state.round)
            if not behind:
                return
            logger.debug("waiting up to %.0f s for %s to finish round %d", left, ", ".join(behind), self.state.round - 1)
            await ctx.clock.wait(changed, left)

    # ---- what our sessions hand up (neuronode.swarm.links.Inbox) -------------------------------

    def our_hello(self, caller: str) -> pb.HelloResponse:
        return self.peers.session_hello(caller)

    def carrying(self, peer_id: str) -> None:
        self.transport.push_pending()

    def hello_answer(self, carrier: str, address: str, resp: pb.HelloResponse) -> bool:
        return self.peers.take_answer(address, resp, carrier=carrier)

    def relayed_hello(self, carrier: str, request: pb.HelloRequest) -> None:
        self.peers.take_relayed(carrier, request)

    async def contribution(self, chunks: AsyncIterator[bytes], *, carrier: str) -> None:
        await self.inbound.receive(chunks, proven_id=carrier if self.ctx.security.secret else "", carrier=carrier)

    def carriers_changed(self) -> None:
        self.peers.announce()

    def _want(self, maker: str) -> None:
        self.peers.ask(maker)

    def _news(self) -> None:
        self.transport.push_pending()
        self.ctx.book.notify()

    def _reach_changed(self) -> None:
        """Our address or reachability changed: tell peers at once (whether to dial us)."""
        self.peers.announce()
        self._news()

    def _state_changed(self) -> None:
        if self.state.epoch != self._epoch:  # adopted the swarm's state: forget our old rounds
            self._epoch = self.state.epoch
            self.ctx.book.reset(self.state.round)
        else:  # rounds we applied without collecting them (caught up by rounds) are closed
            self.ctx.book.advance(self.state.round)
        self.peers.update_agreement()
        self.peers.announce()

    # ---- what the daemon asks ------------------------------------------------------------

    async def wait_first_contact(self, timeout_s: float) -> bool:
        return await self.peers.wait_first_contact(timeout_s)

    async def check_reachable(self, *, again: bool = False) -> None:
        await self.reach.step(again=again)

    def refused(self) -> str:
        """Why we cannot join: every bootstrap peer refused us (or we it: another swarm, model or
        setting), one line per peer; "" while any may still take us."""
        peers, refusals = self.cfg.peers, self.peers.refusals
        if not peers or any(p not in refusals for p in peers) or self.table.alive():
            return ""
        return "; ".join(f"{p}: {refusals[p]}" for p in peers)

    def catch_up_plan(self) -> CatchUp | None:
        return plan_catch_up(self.cfg.node_id, self.state.round, self.state.digests, self.table.alive())

    async def fetch_state(self, donors: list[str], *, verify: Verify = lambda _: None) -> GlobalState | None:
        """The swarm's state from `donors` (those we can dial, in this order; neuronode.swarm.statesync.statesync)."""
        return await self.fetcher.fetch(donors, verify=verify)

    def closed_without_us(self, round_id: int) -> list[str]:
        """Peers of our lineage (same parameters at the start of `round_id`) that already closed
        `round_id`, so averaged it without us (we joined, or trained, too late for it), when
        enough of them say so (neuronode.swarm.guard.trust.closed_without_us)."""
        return closed_without_us(round_id, self.state.digests.get(round_id), self.table.alive())

    def vouched(self, round_id: int, param_digest: str, momentum_digest: str) -> bool:
        """Whether a quorum of the other live hosts published this state for `round_id`
        (neuronode.swarm.guard.trust.witnesses): what a replayed round must reach."""
        return witnesses(round_id, param_digest, self.cfg.node_id, self.table.alive(), momentum_digest).accepted

    def holders(self, round_id: int, param_digest: str) -> list[str]:
        """Live members we can dial that applied `round_id` from `param_digest` (they published
        it for the round's start, and a digest for its end): who may serve what catching up by
        that round needs (neuronode.swarm.streams.missed). Their word is checked after (`vouched`)."""
        return sorted(p.node_id for p in believable(self.table.alive())
                      if p.digests.get(round_id) == param_digest and round_id + 1 in p.digests
                      and self.links.dialable(p))

    def alive_count(self) -> int:
        return len(self.table.alive())

    def restore_counters(self, *, bytes_sent: int, bytes_received: int) -> None:
        """Continue the byte counters of a previous run (from its checkpoint)."""
        self.counters.bytes_sent, self.counters.bytes_received = bytes_sent, bytes_received

    def traffic(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """Copies of bytes sent and received by peer, and refusals by reason (for metrics)."""
        c = self.counters
        return dict(c.per_peer_sent), dict(c.per_peer_received), dict(c.refusals)

    def fault_plan(self) -> FaultPlan | None:
        """The fault file's current plan (tests and drills), None without --fault-file."""
        faults = self.ctx.faults
        return faults.refresh() if faults.path else None

    def status(self) -> dict[str, Any]:
        return {**self.status_provider(), **self.snapshot()}

    def snapshot(self) -> dict[str, Any]:
        """Swarm-side status fields."""
        ctx, now = self.ctx, self.ctx.clock.now()
        return {
            "node_id": ctx.cfg.node_id, "swarm_id": ctx.cfg.swarm_id, "advertise": ctx.advertise,
            "protocol_version": PROTOCOL_VERSION, "agreement": self.peers.agreement,
            "state_transfers": self.fetcher.transfers, "states_served": self.donor.served,
            "reachable": self.reach.reachable, "observed_address": self.reach.observed_host,
            "sessions": sorted(self.sessions.open), "bytes_relayed": self.relay.bytes_relayed,
            "bytes_sent": ctx.counters.bytes_sent, "bytes_received": ctx.counters.bytes_received,
            "control_bytes_sent": ctx.counters.control_bytes_sent,
            "control_bytes_received": ctx.counters.control_bytes_received,
            "buffered_bytes": ctx.book.buffered_bytes, **self.fetcher.progress.fields(),
            # Members that hold bytes here were live when their streams opened (one may have died since).
            "buffered_bytes_bound": buffered_bytes_bound(
                ctx.cfg, len({p.node_id for p in self.table.alive()} | ctx.book.senders())),
            "peers": [
                {"node_id": p.node_id, "address": p.address, "alive": self.table.is_alive(p),
                 "last_seen_s": round(now - p.last_seen, 3) if p.last_seen else -1.0}
                for p in sorted(self.table.peers.values(), key=lambda p: p.node_id)
            ],
        }
