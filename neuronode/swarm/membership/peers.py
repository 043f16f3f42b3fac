"""Meeting peers: Hello (which doubles as the heartbeat and peer exchange), announcements of our
round, Leave, redial backoff, and replica agreement as our peers' digests tell it."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from dataclasses import replace

import grpc

from neuronode.averaging.agreement import Receipt
from neuronode.config import is_loopback_host
from neuronode.events import fields
from neuronode.security.auth import AuthError
from neuronode.security.identity import is_derived
from neuronode.swarm.context import Context
from neuronode.swarm.links import Links, NoRoute
from neuronode.swarm.links.links import FINAL_CODES
from neuronode.swarm.links.relay import MAX_CARRIERS
from neuronode.swarm.membership.hello_checks import check_info
from neuronode.swarm.membership.lineage import agreement
from neuronode.swarm.membership.table import (
    MAX_MEMBERS,
    KeyMismatch,
    Peer,
    TableFull,
    heartbeat_targets,
)
from neuronode.swarm.receipts.receipts import Receipts
from neuronode.swarm.wire import (
    MAX_ADDRESS_CHARS,
    MAX_ID_CHARS,
    MAX_PEERS_LISTED,
    PROTOCOL_VERSION,
    Refusal,
    settings_to_pb,
)
from neuronode.v1 import node_pb2 as pb

logger = logging.getLogger(__name__)

REACHABILITY_TO_PB = {"unknown": pb.REACHABILITY_UNSPECIFIED, "yes": pb.REACHABILITY_YES, "no": pb.REACHABILITY_NO}

PEX_SAMPLE = 8  # peers a Hello to a member that knows the swarm lists
OFF_LOOP_PEERS = 256  # with this many live peers, agreement is worked out in a worker thread


class Peers:
    """Who we greet and what we tell them; `on_news` runs after every message a peer sends,
    `observe(peer_id, address)` when a peer tells us where it sees our connection come from."""

    def __init__(self, ctx: Context, *, links: Links, receipts: Receipts, on_news: Callable[[], None],
                 observe: Callable[[str, str], None] = lambda peer_id, address: None) -> None:
        self.ctx = ctx
        self.links = links
        self.on_news = on_news
        self.observe = observe
        self.receipts = receipts
        self.agreement = "unknown"
        self._mark = 0  # what the latest node_info(to=...) told its peer (Receipts.fill)
        self._backoff: dict[str, tuple[float, float]] = {}  # address -> (next dial, delay)
        self._contact = asyncio.Event()  # set by the first successful hello either way
        self.refusals: dict[str, str] = {}  # address -> why the peer there refused us, or we it (until it answers)
        self._refused = asyncio.Event()  # every bootstrap peer refused us before any contact: joining ends
        for address in ctx.cfg.peers:
            ctx.table.add_address(address, bootstrap=True)

    # ---- what we say ---------------------------------------------------------------------

    def info_for(self, to: str | None) -> tuple[pb.NodeInfo, int]:
        """`node_info(to)` and the mark to pass to `delivered` once `to` got it."""
        info = self.node_info(to)
        return info, self._mark

    def node_info(self, to: str | None = None) -> pb.NodeInfo:
        """What we tell everyone (`to` None), or peer `to` (the receipts and echoes it lacks only)."""
        ctx, state = self.ctx, self.ctx.state
        if ctx.reachable == "no" or not ctx.cfg.sampled_membership:
            to = None  # relays forward our Hellos as signed to the others: they must say everything
        info = pb.NodeInfo(
            node_id=ctx.cfg.node_id, swarm_id=ctx.cfg.swarm_id, protocol_version=PROTOCOL_VERSION,
            manifest_hash=ctx.cfg.manifest_hash, advertise=ctx.advertise, round=state.round,
            contributes_from=state.contributes_from, param_digest=state.param_digest,
            recent_digests=[pb.RoundDigest(round=r, param_digest=d, momentum_digest=m) for r, d, m in state.recent()],
            leaving=ctx.leaving, settings=settings_to_pb(ctx.cfg.settings), public_key=ctx.security.key.public,
            reachable=REACHABILITY_TO_PB[ctx.reachable],
            carried_by=self.links.carried_by()[:MAX_CARRIERS] if ctx.reachable == "no" else [])
        self._mark = self.receipts.fill(info, to=to)
        return info

    def delivered(self, to: str, mark: int) -> None:
        self.receipts.sent(to, mark)

    def known_peers(self, *, full: bool = True) -> list[pb.PeerRecord]:
        """Peer exchange: every live member we can dial (to a newcomer), else a random sample of
        PEX_SAMPLE of them (a member greets every address it learns, so news of a newcomer
        spreads from the newcomer itself; docs/protocol.md gives the cost)."""
        table = self.ctx.table
        dialable = [p for p in table.alive() if self.links.dialable(p)]  # nobody can use the rest
        if not full and table.min_fanout < MAX_MEMBERS:  # (the greet-everyone reference lists all)
            dialable = random.sample(dialable, min(len(dialable), PEX_SAMPLE))
        return [pb.PeerRecord(node_id=p.node_id, address=p.address) for p in dialable][:MAX_PEERS_LISTED]

    def publish_receipt(self, receipt: Receipt) -> Receipt:
        standing = self.receipts.publish(receipt)
        self.announce()
        return standing

    def announce(self) -> None:
        """Tell live peers our news now, not at the next heartbeat: whom a peer waits for
        depends on our round, and rounds can be shorter than a heartbeat period."""
        if self.ctx.started:
            self.links.announce(self.greet, self.session_hello)

    async def greet(self, peer: Peer) -> bool:
        return await self.hello(peer.address, to=peer.node_id)

    def session_hello(self, caller: str = "") -> pb.HelloResponse:
        """Our NodeInfo as a signed Hello answer (what a Hello to us would return), for the
        sessions we carry (`caller`: where the session's call came from)."""
        resp = pb.HelloResponse(info=self.node_info(), known_peers=self.known_peers(),
                                observed_address=caller.split(":", 1)[-1] if caller else "")
        self.ctx.security.sign_hello(resp)
        return resp

    def ask(self, maker: str) -> None:
        """Greet `maker` now: our Hello names the receipt of it we could not rebuild
        (NodeInfo.wanted), and its answer carries what we asked for (its ids, or its statements
        whole)."""
        table = self.ctx.table
        peer = table.peers.get(maker)
        if self.ctx.started and peer is not None and table.is_alive(peer) and self.links.dialable(peer):
            self.ctx.tasks.spawn(self.hello(peer.address, to=maker), f"want-{maker}")

    # ---- what we hear --------------------------------------------------------------------

    def check_info(self, info: pb.NodeInfo) -> None:
        check_info(info, self.ctx)

    def learn(self, info: pb.NodeInfo, known: list[pb.PeerRecord], *, host: str, verified: bool = True,
              dialed: str = "", said_at: int = 0) -> None:
        """Record what a peer (calling from, or reached at, `host`; at `dialed`, when we dialed
        it) said in a Hello whose signature (over its time `said_at`) was checked; raises
        TableFull for a new id the table cannot take and KeyMismatch for a known id under another
        key. A peer still learning its address (none advertised) is known at the address we
        reached it at."""
        table = self.ctx.table
        back = table.heard_from(
            info.node_id, info.advertise or dialed, round=info.round, param_digest=info.param_digest,
            digests={d.round: d.param_digest for d in list(info.recent_digests)[-16:]},
            momenta={d.round: d.momentum_digest for d in list(info.recent_digests)[-16:]},
            leaving=info.leaving, contributes_from=info.contributes_from, host=host,
            public_key=info.public_key, verified=verified, reachable=info.reachable != pb.REACHABILITY_NO,
            carried_by=tuple(info.carried_by), advertised=bool(info.advertise), said_at=said_at)
        if dialed and info.advertise and dialed != info.advertise and dialed not in table.bootstrap:
            table.addresses.discard(dialed)  # the IP its advertised name resolved to: one address per member
        if back:  # new, or back after it was gone (a restart, a healed partition): rounds wait for it again
            self.ctx.book.lateness.forgive(info.node_id)
            self.receipts.forget(info.node_id)  # and it holds nothing we sent before
        if verified:  # once its id is bound to its key (heard_from refuses another key)
            self.receipts.take(info)
        local = self.on_loopback()  # each listed address is taken as the IP it names (links.resolve)
        self.links.resolver.each([rec.address for rec in known[:MAX_PEERS_LISTED] if rec.node_id != self.ctx.cfg.node_id
                                  and len(rec.address) <= MAX_ADDRESS_CHARS],
                                 lambda ips: table.add_gossiped(ips, local=local, cap=MAX_MEMBERS), spawn=self.ctx.tasks.spawn)
        self._contact.set()
        # A new peer, or one that moved to another round or is leaving, may now be owed an open
        # round's push, or no longer be waited for: cheap to re-check on every message.
        self.on_news()

    def on_loopback(self) -> bool:
        """We are on this machine's loopback (a swarm on one machine): peers listed there are ours to dial."""
        return is_loopback_host((self.ctx.advertise or self.ctx.cfg.listen).rpartition(":")[0].strip("[]"))

    # ---- heartbeats ------------------------------------------------------------------------

    async def heartbeats(self) -> None:
        ctx = self.ctx
        unanswered_since: float | None = None
        warned_at = 0.0
        while True:
            now = ctx.clock.now()
            live = {p.address: p.node_id for p in ctx.table.alive()}
            targets = [a for a in heartbeat_targets(ctx.table, skip=[ctx.advertise])
                       if self._backoff.get(a, (0.0, 0.0))[0] <= now]
            results = await asyncio.gather(*(self.hello(a, to=live.get(a)) for a in targets))
            bootstrap_ok = any(ok for a, ok in zip(targets, results, strict=True) if a in ctx.cfg.peers)
            silent = [a for a in ctx.cfg.peers if a not in self.refusals]  # a refusal said why already
            if silent and not bootstrap_ok and not ctx.table.alive():
                unanswered_since = unanswered_since or now
                # Say it plainly once a peer had time to start, then every few minutes.
                if now - unanswered_since > 10 and now - warned_at > 300:
                    warned_at = now
                    logger.warning(
                        "no bootstrap peer answered for %.0f s (tried %s); check the address and "
                        "port, that the peer is running, firewalls between you, and that it was "
                        "started with an --advertise address you can reach",
                        now - unanswered_since, ", ".join(silent),
                        extra=fields("bootstrap_unanswered", peers=silent, seconds=round(now - unanswered_since)))
            else:
                unanswered_since, warned_at = None, 0.0
            self.on_news()  # liveness may have changed: collectors and pushes re-evaluate
            await self.refresh_agreement()
            await ctx.clock.sleep(ctx.cfg.heartbeat_s * random.uniform(0.8, 1.2))

    async def wait_first_contact(self, timeout_s: float) -> bool:
        """With bootstrap peers, give the first heartbeats time to tell us where the swarm is;
        False at once when every bootstrap peer refused us (SwarmNode.refused says why)."""
        if not self.ctx.cfg.peers:
            return False
        contact, refused = (asyncio.ensure_future(e.wait()) for e in (self._contact, self._refused))
        try:
            await asyncio.wait({contact, refused}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (contact, refused):
                task.cancel()
        if not self._contact.is_set():
            return False
        await self.ctx.clock.sleep(self.ctx.cfg.heartbeat_s * 1.5)  # one more round of hellos: learn the rest
        return True

    def dial_failed(self, address: str, *, refused: bool) -> None:
        """Redial with exponential backoff and jitter: up to 30 s when unreachable, 5 min when
        the peer refused us (another swarm or model will not change by itself)."""
        ctx = self.ctx
        ctx.table.mark_failure(address)
        _, delay = self._backoff.get(address, (0.0, 0.0))
        cap = 300.0 if refused else 30.0
        if address in ctx.cfg.peers and not self._contact.is_set():
            cap = ctx.cfg.heartbeat_s  # keep knocking while we join: the bootstrap may be starting
        if delay >= cap and address not in ctx.cfg.peers and not any(
                p.address == address for p in ctx.table.alive()):
            self.forget(address)  # gossiped address that never answers: stop carrying it
            return
        delay = min(cap, max(ctx.cfg.heartbeat_s, delay * 2))
        self._backoff[address] = (ctx.clock.now() + delay * random.uniform(0.5, 1.0), delay)

    def refused_by(self, address: str, why: str) -> None:
        """A refusal that will not change by itself (another swarm, model, setting or secret):
        kept until that peer answers; once every bootstrap peer refused us before any contact,
        joining ends (the node stops with the reasons rather than train alone)."""
        self.refusals[address] = why
        peers = self.ctx.cfg.peers
        if peers and not self._contact.is_set() and all(p in self.refusals for p in peers):
            self._refused.set()

    def forget(self, address: str) -> None:
        self.ctx.table.addresses.discard(address)
        self._backoff.pop(address, None)
        for channel in self.ctx.channels.pop(address):
            self.ctx.tasks.spawn(channel.close(), f"close-{address}")

    async def hello(self, address: str, *, to: str | None = None) -> bool:
        """Greet the node at `address` (live peer `to`: only the receipts and echoes it lacks,
        a sample of the peers we know; anyone else: everything)."""
        ctx = self.ctx
        target = await self.links.resolve(address)  # the IP we dial: the host of whoever answers
        if target is None:  # a name that does not resolve
            self.dial_failed(address, refused=False)
            return False
        info, mark = self.info_for(to)
        req = pb.HelloRequest(info=info, known_peers=self.known_peers(full=to is None))
        ctx.security.sign_hello(req)
        try:
            resp = await self.links.dial(target.address, "Hello", req, timeout_s=max(1.0, ctx.cfg.heartbeat_s),
                                         name=target.name)
        except NoRoute:
            return False
        except grpc.aio.AioRpcError as exc:
            refused = exc.code() in FINAL_CODES
            self.dial_failed(address, refused=refused)
            if refused:
                self.refused_by(address, exc.details() or exc.code().name)
                ctx.say(f"refused-by:{address}", logging.ERROR, "peer at %s refused us: %s", address, exc.details(),
                        extra=fields("refused_by", address=address, code=exc.code().name, detail=exc.details()))
            elif exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # retried, but say why: a limit may need raising
                ctx.say(f"turned-away:{address}", logging.WARNING, "peer at %s turned us away for now (we retry): %s",
                        address, exc.details(), extra=fields("refused_by", address=address, code=exc.code().name,
                                                              detail=exc.details()))
            else:
                logger.debug("hello to %s failed: %s", address, exc.code().name)
            return False
        self._backoff.pop(address, None)
        self.refusals.pop(address, None)
        ctx.counters.control(sent=req.ByteSize(), received=resp.ByteSize())
        if to is not None and resp.info.node_id == to:
            self.delivered(to, mark)
        if resp.info.node_id == ctx.cfg.node_id:
            ctx.table.addresses.discard(address)  # that address is ourselves
            return True
        await ctx.security.check_ahead(resp)  # its signatures, off the event loop
        return self.take_answer(address, resp, host=target.ip)

    def take_answer(self, address: str, resp: pb.HelloResponse, *, host: str = "", carrier: str = "") -> bool:
        """A peer's Hello answer: to our Hello to `address` (the member is at the IP we dialed,
        `host`), or over the session we hold to `carrier`, where it speaks for the carrier only
        and moves no host (a carrier could forward any member's fresh signed answer; our Hellos
        to the carrier tell us where it is). Check it and learn from it."""
        ctx = self.ctx
        if carrier and resp.info.node_id != carrier:
            ctx.say(f"forwarded:{carrier}", logging.WARNING, "not taking %s's Hello answer over %s's session: a "
                    "session speaks for its carrier only", resp.info.node_id[:MAX_ID_CHARS], carrier,
                    extra=fields("refused", what="hello over a session", peer_id=carrier, detail="not the carrier's"))
            return False
        try:
            self.check_info(resp.info)
            ctx.security.check_hello_proof(resp.auth_tag, resp.timestamp_s, resp.info, resp.known_peers)
            ctx.security.check_hello_signature(resp)
            # Under mutual TLS a named id is a member once its own Hello (whose certificate names
            # it) reached us; an answer cannot show us the server's certificate name.
            verified = not ctx.security.tls_files or is_derived(resp.info.node_id)
            self.learn(resp.info, list(resp.known_peers), host=host, verified=verified, dialed=address,
                       said_at=resp.timestamp_s)
        except (Refusal, AuthError, KeyMismatch) as exc:
            self.dial_failed(address, refused=True)
            self.refused_by(address, str(exc))
            ctx.say(f"refusing:{address}", logging.ERROR, "refusing peer at %s: %s", address, exc,
                    extra=fields("refusing_peer", address=address, detail=str(exc)))
            return False
        except TableFull as exc:
            ctx.say(f"table-full:{address}", logging.WARNING, "not recording the peer at %s: %s", address, exc)
            return False
        if resp.observed_address:
            self.observe(resp.info.node_id, resp.observed_address)
        return True

    def take_relayed(self, carrier: str, request: pb.HelloRequest) -> None:
        """A Hello of a member nobody can dial, relayed by `carrier` as its maker signed it
        (neuronode.swarm.links.relay): checked as if the maker had called us. Members known only
        through one carrier count toward that carrier's --max-ids-per-host."""
        ctx, info = self.ctx, request.info
        if info.node_id == ctx.cfg.node_id or info.reachable != pb.REACHABILITY_NO:
            return  # ours, or a member we dial ourselves
        try:
            self.check_info(info)
            ctx.security.check_hello_proof(request.auth_tag, request.timestamp_s, info, request.known_peers)
            ctx.security.check_hello_signature(request)
            verified = not ctx.security.tls_files or is_derived(info.node_id)
            self.learn(info, list(request.known_peers), host=f"relayed-by:{carrier}", verified=verified,
                       said_at=request.timestamp_s)
        except (Refusal, AuthError, KeyMismatch, TableFull) as exc:
            ctx.say(f"relayed:{carrier}", logging.WARNING, "not taking the Hello of %s that %s relayed: %s",
                    info.node_id[:MAX_ID_CHARS], carrier, exc,
                    extra=fields("refused", what="relayed hello", peer_id=carrier, detail=str(exc)))

    def relayable(self, request: pb.HelloRequest) -> None:
        """A Hello a member nobody can dial sent us: on to the members we relay to for it."""
        self.links.relay.hello(request)

    async def leave(self, peer_id: str) -> None:
        ctx = self.ctx
        request = ctx.security.sign_request("Leave", pb.LeaveRequest(node_id=ctx.cfg.node_id, swarm_id=ctx.cfg.swarm_id),
                                           peer_id)
        try:
            await self.links.call(peer_id, "Leave", request, timeout_s=1.0)
        except (grpc.aio.AioRpcError, NoRoute):
            pass

    async def refresh_agreement(self) -> None:
        """update_agreement, off the event loop when the table is large (on copies of what it
        holds, so the loop may change the table meanwhile)."""
        alive = self.ctx.table.alive()
        if len(alive) < OFF_LOOP_PEERS:
            self.update_agreement()
            return
        state = self.ctx.state
        own_round, own = state.round, dict(state.digests)
        copies = [replace(p, digests=dict(p.digests)) for p in alive]
        verdict = await asyncio.get_running_loop().run_in_executor(
            self.ctx.executor, agreement, self.ctx.cfg.node_id, own_round, own, copies)
        self.say_agreement(verdict)

    def update_agreement(self) -> None:
        state = self.ctx.state
        self.say_agreement(agreement(self.ctx.cfg.node_id, state.round, state.digests, self.ctx.table.alive()))

    def say_agreement(self, now: str) -> None:
        state = self.ctx.state
        if now != self.agreement:
            log = logger.error if now == "diverged" else logger.info
            log("replica agreement: %s at round %d%s", now, state.round,
                "; our parameters differ from the swarm's (repair by state transfer follows)"
                if now == "diverged" else "", extra=fields("agreement", round_id=state.round, state=now))
            self.agreement = now
