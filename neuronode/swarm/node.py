"""The swarm side of a node: a grpc.aio server, peer discovery and heartbeats, and the
per-round exchange of contributions. It moves encoded bytes and knows nothing of models.

Exchange of round r: our contribution (already encoded into frames) is pushed to every live
peer over one client stream each, and again to peers discovered while the round's push window
(`sync_timeout`) is open. Peers' contributions arrive through `PushContribution`, are checked
chunk by chunk (order, sizes, bounded decompression) and as a whole (digest), and wait in the
RoundBook until our round closes (rounds.py states the rule).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from neuronode.codec import (
    Assembler,
    ContributionDigest,
    Frame,
    decode_frame,
    get_codec,
    shard_ranges,
)
from neuronode.errors import ConfigError
from neuronode.security.auth import AuthError
from neuronode.security.certs import peer_common_name
from neuronode.state import GlobalState
from neuronode.swarm.bans import Bans
from neuronode.swarm.faults import FaultInjected, Faults
from neuronode.swarm.membership import CatchUp, PeerTable, agreement, plan_catch_up
from neuronode.swarm.ratelimit import UploadLimiter, UploadMeter
from neuronode.swarm.rounds import Contribution, RoundBook, RoundRefused
from neuronode.swarm.security import NODE_SERVICE_PREFIX as NODE_PREFIX
from neuronode.swarm.security import Security, Undecodable, caller_id
from neuronode.swarm.statesync import Donor, StateProvider, download
from neuronode.swarm.wire import (
    CODEC_TO_PB,
    MAX_ADDRESS_CHARS,
    MAX_ID_CHARS,
    MAX_PEERS_LISTED,
    PB_TO_CODEC,
    PROTOCOL_VERSION,
    SERVER_OPTIONS,
    STATUS_CODES,
    ChunkView,
    Refusal,
    dict_to_status,
    serialize_chunk,
)
from neuronode.v1 import node_pb2 as pb
from neuronode.v1 import node_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)
# A chunk we receive: a ChunkView off the wire (payload not copied), or a message in-process.
Chunk = pb.ContributionChunk | ChunkView

MAX_CHUNK_PAYLOAD = 4 << 20
MAX_RECEIPTS = 4  # NodeInfo.shards_received: rounds a node keeps its receipts for
RECEIPT_POLL_S = 0.005  # how often agree_shards looks at the receipts peers announced
RECEIPT_WAIT_TIMEOUTS = 2  # agree_shards waits this many --sync-timeout for a live member's receipt
MAX_KNOWN_ADDRESSES = 1024
NODE_SERVICE = "neuronode.v1.Node"
# grpcio's asyncio client reports a client stream the server ended early (a refusal before it
# read everything) as this INTERNAL error, hiding the server's status (grpc/grpc#36066).
EARLY_STATUS_BUG = "Internal error from Core"
PHASE_NAMES = {pb.PHASE_UNSPECIFIED: "contribution", pb.PHASE_SHARD: "shard slices",
               pb.PHASE_AVERAGED: "averaged shard"}
# Refusals that retrying cannot fix; anything else (UNAVAILABLE, DEADLINE_EXCEEDED) is retried.
FINAL_CODES = {
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNIMPLEMENTED,
}


@dataclass(frozen=True)
class SwarmConfig:
    """What the swarm layer needs to know; built by the daemon from NodeConfig."""

    node_id: str
    swarm_id: str
    manifest_hash: str
    n_elements: int
    listen: str
    advertise: str
    peers: tuple[str, ...] = ()
    sync_timeout_s: float = 60.0
    min_contributors: int = 1
    heartbeat_s: float = 2.0
    first_round: int = 0
    zstd_level: int = 1
    fault_file: str = ""
    max_upload_mbps: float = 0.0
    # How far a peer's reported round may trail a round it will still contribute to: 1, or 2
    # under --overlap (a node contributes to round r while round r-1's sync is still in flight).
    round_lag: int = 1


@dataclass
class WireCache:
    """An Outgoing's serialized ContributionChunk messages by chunk index, made once and sent to
    every peer (the same bytes for all), and their common header (tag included)."""

    header: pb.ContributionChunk | None = None
    chunks: dict[int, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class Outgoing:
    """Our encoded contribution for one round."""

    round_id: int
    codec: str
    frames: list[Frame]
    digest: str
    n_elements: int
    chunk_elements: int
    weight: float
    shuffled: bool = False
    base_digest: str = ""
    phase: int = pb.PHASE_UNSPECIFIED  # reduce-scatter: PHASE_SHARD or PHASE_AVERAGED
    shard_index: int = 0
    members: tuple[str, ...] = ()
    contributors: tuple[str, ...] = ()
    wire: WireCache = field(default_factory=WireCache, compare=False, repr=False)


@dataclass
class Outbox:
    """What we still push for one (phase, round): one Outgoing for all, or one per peer."""

    outs: dict[str, Outgoing] | Outgoing
    targets: set[str] | None  # None: every live peer that is not behind
    pushed: set[str]
    deadline: float

    def for_peer(self, peer_id: str) -> Outgoing | None:
        if isinstance(self.outs, Outgoing):
            return self.outs
        return self.outs.get(peer_id)


@dataclass
class Counters:
    bytes_sent: int = 0
    bytes_received: int = 0
    per_peer_sent: dict[str, int] = field(default_factory=dict)
    per_peer_received: dict[str, int] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=dict)  # by reason (gRPC status code)


class SwarmNode:
    """Server + clients of one node. Start with `start()`, stop with `stop()`."""

    def __init__(
        self, cfg: SwarmConfig, *, executor: Executor,
        status_provider: Callable[[], dict[str, Any]] | None = None,
        state_provider: StateProvider | None = None,
        security: Security | None = None,
    ) -> None:
        self.cfg = cfg
        self.security = security or Security(node_id=cfg.node_id, swarm_id=cfg.swarm_id)
        self.executor = executor
        self.status_provider = status_provider or dict
        self.table = PeerTable(self_id=cfg.node_id, dead_after_s=max(3 * cfg.heartbeat_s, 5.0))
        self.book = RoundBook(closed_below=cfg.first_round)
        # Reduce-scatter keeps its shard slices in `book` and the averaged shards here.
        self.gather_book = RoundBook(closed_below=cfg.first_round)
        self.counters = Counters()
        self.advertise = cfg.advertise
        self.round = cfg.first_round
        self.contributes_from = 0  # NodeInfo.contributes_from: set when we only listen to a round
        self.receipts: dict[int, frozenset[int]] = {}  # NodeInfo.shards_received
        self.param_digest = ""
        self.own_digests: dict[int, str] = {}
        self.agreement = "unknown"
        self.leaving = False
        self._server: grpc.aio.Server | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._outbox: dict[tuple[int, int], Outbox] = {}  # (phase, round) -> what to push
        self._backoff: dict[str, tuple[float, float]] = {}  # address -> (next dial, delay)
        self._said: dict[str, float] = {}
        self._contact = asyncio.Event()  # set by the first successful hello either way
        self.faults = Faults(cfg.fault_file or None, self_address=cfg.advertise)
        self.donor = Donor(provider=state_provider, manifest_hash=cfg.manifest_hash,
                           zstd_level=cfg.zstd_level, executor=executor, security=self.security)
        self.state_transfers = 0
        self.reachable = "unknown"
        self.upload = UploadLimiter(cfg.max_upload_mbps)
        self.upload_meter = UploadMeter()
        self.bans = Bans()
        # A closed swarm (secret or TLS); only the secret's per-call proofs bind node ids.
        self.authenticated = self.security.enabled
        self.loopback_only = False  # protected mode: no authentication and no --open
        self._dialbacks: dict[str, float] = {}  # node id -> last dial-back we did for it
        for address in cfg.peers:
            self.table.add_address(address)

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> str:
        """Bind the server and start heartbeats; returns the address peers should dial."""
        server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=self.security.interceptors())
        pb_grpc.add_NodeServicer_to_server(NodeService(self), server)
        # Standard gRPC health: NOT_SERVING until the daemon says the node has joined.
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        for service in ("", NODE_SERVICE):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        host, _, port = self.cfg.listen.rpartition(":")
        bound = self.security.add_port(server, self.cfg.listen)
        if bound == 0:
            raise ConfigError(f"--listen {self.cfg.listen}: address in use or not local; choose another port")
        await server.start()
        self._server = server
        if not self.advertise or self.advertise.endswith(":0"):
            adv_host = self.advertise.rpartition(":")[0] if self.advertise else host
            if adv_host in ("0.0.0.0", "[::]", ""):
                adv_host = "127.0.0.1"
            self.advertise = f"{adv_host}:{bound}"
        self.faults.self_address = self.advertise
        self._spawn(self._heartbeat_loop(), "heartbeats")
        logger.info("node %s serving on %s (advertised as %s)", self.cfg.node_id, self.cfg.listen.replace(":0", f":{bound}"), self.advertise)
        return self.advertise

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", NODE_SERVICE):
            await self.health.set(service, status)

    async def stop(self, *, grace_s: float = 2.0) -> None:
        """Tell peers we leave, stop the server (grace for calls in flight), close channels."""
        self.leaving = True
        if self._server is not None:
            await self.health.enter_graceful_shutdown()
        peers = self.table.alive()
        if peers:
            await asyncio.gather(*(self._leave(p.address) for p in peers), return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.stop(grace_s)
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    async def drain(self, *, timeout_s: float) -> None:
        """Give contributions still streaming to peers up to `timeout_s` to finish."""
        pushes = [t for t in self._tasks if t.get_name().startswith("push-")]
        if pushes:
            logger.info("waiting up to %.0f s for %d pushes still in flight", timeout_s, len(pushes))
            await asyncio.wait(pushes, timeout=timeout_s)

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        """Every background task is owned here and cancelled by stop()."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def stub(self, address: str) -> pb_grpc.NodeStub:
        return pb_grpc.NodeStub(self.channel(address))

    def channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self.security.channel(address)
        return channel

    def push_call(self, address: str) -> Any:
        """PushContribution taking already serialized ContributionChunk messages."""
        return self.channel(address).stream_unary(
            f"{NODE_PREFIX}PushContribution", request_serializer=None,
            response_deserializer=pb.PushAck.FromString)

    # ---- membership ------------------------------------------------------------------------

    def node_info(self) -> pb.NodeInfo:
        recent = [pb.RoundDigest(round=r, param_digest=d) for r, d in sorted(self.own_digests.items())]
        info = pb.NodeInfo(
            node_id=self.cfg.node_id, swarm_id=self.cfg.swarm_id, protocol_version=PROTOCOL_VERSION,
            manifest_hash=self.cfg.manifest_hash, advertise=self.advertise, round=self.round,
            contributes_from=self.contributes_from,
            param_digest=self.param_digest, recent_digests=recent, leaving=self.leaving,
        )
        for r, shards in sorted(self.receipts.items()):
            info.shards_received.add(round=r, shards=sorted(shards))
        return info

    def known_peers(self) -> list[pb.PeerRecord]:
        return [pb.PeerRecord(node_id=p.node_id, address=p.address) for p in self.table.alive()][:MAX_PEERS_LISTED]

    def check_info(self, info: pb.NodeInfo) -> None:
        """Refuse a peer of another swarm, protocol or model, with the fix in the message."""
        if (not info.node_id or len(info.node_id) > MAX_ID_CHARS or len(info.swarm_id) > MAX_ID_CHARS
                or len(info.advertise) > MAX_ADDRESS_CHARS or len(info.manifest_hash) > MAX_ID_CHARS
                or len(info.param_digest) > MAX_ID_CHARS or len(info.recent_digests) > 64
                or len(info.shards_received) > MAX_RECEIPTS
                or any(len(r.shards) > MAX_PEERS_LISTED or any(i >= MAX_PEERS_LISTED for i in r.shards)
                       for r in info.shards_received)):
            raise Refusal("INVALID_ARGUMENT", "hello needs a node id and swarm id of at most 128 characters, "
                          f"an address of at most 256, at most 64 recent digests and at most {MAX_RECEIPTS} "
                          f"shard receipts of shard indexes below {MAX_PEERS_LISTED}")
        if info.swarm_id != self.cfg.swarm_id:
            raise Refusal("FAILED_PRECONDITION",
                          f"swarm id mismatch: {info.node_id} is in swarm '{info.swarm_id}', this node "
                          f"({self.cfg.node_id}) is in '{self.cfg.swarm_id}'; start both with the same --swarm-id")
        if info.protocol_version != PROTOCOL_VERSION:
            raise Refusal("FAILED_PRECONDITION",
                          f"protocol version mismatch: {info.node_id} speaks v{info.protocol_version}, "
                          f"this node v{PROTOCOL_VERSION}; run the same neuronode release")
        if info.manifest_hash != self.cfg.manifest_hash:
            raise Refusal("FAILED_PRECONDITION",
                          f"model manifest mismatch: {info.node_id} trains another model "
                          f"({info.manifest_hash[:12]} vs {self.cfg.manifest_hash[:12]} here); "
                          "use the same --task and model-size flags on every node")
        if info.node_id == self.cfg.node_id and info.advertise != self.advertise:
            raise Refusal("ALREADY_EXISTS",
                          f"node id {info.node_id} is already used by the node at {self.advertise}; "
                          "give every node its own --data-dir or --node-id")

    def learn(self, info: pb.NodeInfo, known: list[pb.PeerRecord]) -> None:
        digests = {d.round: d.param_digest for d in list(info.recent_digests)[-16:]}
        self.table.heard_from(
            info.node_id, info.advertise, round=info.round, param_digest=info.param_digest,
            digests=digests, leaving=info.leaving, contributes_from=info.contributes_from,
            receipts={r.round: frozenset(r.shards) for r in info.shards_received},
        )
        for rec in known[:MAX_PEERS_LISTED]:
            if (rec.node_id != self.cfg.node_id and rec.address and len(rec.address) <= MAX_ADDRESS_CHARS
                    and len(self.table.addresses) < MAX_KNOWN_ADDRESSES):
                self.table.add_address(rec.address)
        self._contact.set()
        # A new peer, or one that moved to another round or is leaving, may now be owed an open
        # round's push, or no longer be waited for: cheap to re-check on every message.
        self._push_outbox_to_new_peers()
        self.book.notify()
        self.gather_book.notify()

    async def _heartbeat_loop(self) -> None:
        unanswered_since: float | None = None
        warned_at = 0.0
        while True:
            now = time.monotonic()
            targets = [a for a in self.table.dial_targets()
                       if a != self.advertise and self._backoff.get(a, (0.0, 0.0))[0] <= now]
            results = await asyncio.gather(*(self._hello(a) for a in targets))
            bootstrap_ok = any(ok for a, ok in zip(targets, results, strict=True) if a in self.cfg.peers)
            if self.cfg.peers and not bootstrap_ok and not self.table.alive():
                unanswered_since = unanswered_since or now
                # Say it plainly once a peer had time to start, then every few minutes.
                if now - unanswered_since > 10 and now - warned_at > 300:
                    warned_at = now
                    logger.warning(
                        "no bootstrap peer answered for %.0f s (tried %s); check the address and "
                        "port, that the peer is running, firewalls between you, and that it was "
                        "started with an --advertise address you can reach",
                        now - unanswered_since, ", ".join(self.cfg.peers))
            else:
                unanswered_since, warned_at = None, 0.0
            self.book.notify()  # liveness may have changed: let collectors re-evaluate
            self._push_outbox_to_new_peers()  # a peer may have caught up to an open round
            self._update_agreement()
            await asyncio.sleep(self.cfg.heartbeat_s * random.uniform(0.8, 1.2))

    def say(self, key: str, level: int, msg: str, *args: Any, every_s: float = 300.0) -> None:
        """Log a recurring condition once, then at most every `every_s` seconds."""
        now = time.monotonic()
        if now - self._said.get(key, -every_s) >= every_s:
            self._said[key] = now
            logger.log(level, msg, *args)

    def _dial_failed(self, address: str, *, refused: bool) -> None:
        """Redial with exponential backoff and jitter: up to 30 s when unreachable, 5 min when
        the peer refused us (another swarm or model will not change by itself)."""
        self.table.mark_failure(address)
        _, delay = self._backoff.get(address, (0.0, 0.0))
        cap = 300.0 if refused else 30.0
        if address in self.cfg.peers and not self._contact.is_set():
            cap = self.cfg.heartbeat_s  # keep knocking while we join: the bootstrap may be starting
        if delay >= cap and address not in self.cfg.peers and not any(
                p.address == address for p in self.table.alive()):
            self._forget(address)  # gossiped address that never answers: stop carrying it
            return
        delay = min(cap, max(self.cfg.heartbeat_s, delay * 2))
        self._backoff[address] = (time.monotonic() + delay * random.uniform(0.5, 1.0), delay)

    def _forget(self, address: str) -> None:
        self.table.addresses.discard(address)
        self._backoff.pop(address, None)
        channel = self._channels.pop(address, None)
        if channel is not None:
            self._spawn(channel.close(), f"close-{address}")

    async def _hello(self, address: str) -> bool:
        req = pb.HelloRequest(info=self.node_info(), known_peers=self.known_peers())
        req.auth_tag, req.timestamp_s = self.security.hello_proof(req.info, req.known_peers)
        try:
            await asyncio.sleep(self.faults.before_call(address))
            resp = await self.stub(address).Hello(req, timeout=max(1.0, self.cfg.heartbeat_s),
                                                  metadata=self.security.metadata("Hello"))
        except grpc.aio.AioRpcError as exc:
            refused = exc.code() in FINAL_CODES
            self._dial_failed(address, refused=refused)
            if refused:
                self.say(f"refused-by:{address}", logging.ERROR, "peer at %s refused us: %s",
                         address, exc.details())
            else:
                logger.debug("hello to %s failed: %s", address, exc.code().name)
            return False
        self._backoff.pop(address, None)
        if resp.info.node_id == self.cfg.node_id:
            self.table.addresses.discard(address)  # that address is ourselves
            return True
        try:
            self.check_info(resp.info)
            self.security.check_hello_proof(resp.auth_tag, resp.timestamp_s, resp.info, resp.known_peers)
        except (Refusal, AuthError) as exc:
            self._dial_failed(address, refused=True)
            self.say(f"refusing:{address}", logging.ERROR, "refusing peer at %s: %s", address, exc)
            return False
        self.learn(resp.info, list(resp.known_peers))
        return True

    async def _leave(self, address: str) -> None:
        try:
            self.faults.before_call(address)
            await self.stub(address).Leave(
                pb.LeaveRequest(node_id=self.cfg.node_id, swarm_id=self.cfg.swarm_id), timeout=1.0,
                metadata=self.security.metadata("Leave"))
        except grpc.aio.AioRpcError:
            pass

    # ---- rounds ----------------------------------------------------------------------------

    def expected(self, round_id: int) -> set[str]:
        """Peers whose contribution to `round_id` we wait for: live, not behind, and not only
        listening to it."""
        # A peer two rounds ahead closed this round long ago; one round ahead may still be
        # streaming its contribution to us, so it stays expected.
        ids = {p.node_id for p in self.table.alive()
               if round_id - self.cfg.round_lag <= p.round <= round_id + 1 and p.contributes_from <= round_id}
        return ids | {self.cfg.node_id}

    async def members(self, round_id: int, minimum: int, *, give_up: Callable[[], bool]) -> tuple[str, ...]:
        """Reduce-scatter: the round's members (the expected peers and us, sorted), once there
        are at least `minimum` (--min-peers) of them, or when `give_up()` says stop waiting."""
        every = min(0.5, self.cfg.heartbeat_s)
        while len(members := self.expected(round_id)) < minimum and not give_up():
            self.say(f"members-{round_id}", logging.WARNING, "round %d: %d of --min-peers %d members; "
                     "waiting for more", round_id, len(members), minimum)
            await asyncio.sleep(every)
        return tuple(sorted(members))

    async def exchange(
        self, out: Outgoing | dict[str, Outgoing], own: Contribution, *,
        members: tuple[str, ...] = (),
    ) -> dict[str, Contribution]:
        """Push our contribution and collect the round's; returns contributions by sender.

        All-to-all: `out` goes to every live peer. Reduce-scatter (`members` given): `out` is
        one Outgoing per member (scatter) or one for all (gather), and only members are
        expected. Contributions made from other parameters, or for other members, are dropped.
        """
        phase = own_phase = (out.phase if isinstance(out, Outgoing) else pb.PHASE_SHARD)
        book = self.gather_book if phase == pb.PHASE_AVERAGED else self.book
        round_id = own.round_id
        book.add_own(own)
        targets = set(members) - {self.cfg.node_id} if members else None
        logger.info("round %d: %s ready, sending to %d peers", round_id,
                    PHASE_NAMES[phase], len(targets) if targets is not None else len(self.table.alive()))
        deadline = time.monotonic() + self.cfg.sync_timeout_s
        box = self._outbox[(phase, round_id)] = Outbox(out, targets, set(), deadline)

        def extend() -> None:
            box.deadline = time.monotonic() + self.cfg.sync_timeout_s
            self._push_outbox_to_new_peers()

        for old in [k for k in self._outbox if k[1] < round_id - 1]:
            del self._outbox[old]
        self._push_outbox_to_new_peers()

        def expected() -> set[str]:
            if targets is None:
                return self.expected(round_id)
            alive = {p.node_id for p in self.table.alive()}
            return (targets & alive) | {self.cfg.node_id}

        got = await book.collect(round_id, expected=expected, timeout_s=self.cfg.sync_timeout_s,
                                 min_contributors=self.cfg.min_contributors if own_phase == 0 else 1,
                                 on_extend=extend)
        return self._same_lineage(got, (own.base_digest, own.members), phase)

    async def listen(self, round_id: int, *, phase: int = pb.PHASE_UNSPECIFIED) -> dict[str, Contribution]:
        """Collect a round we do not contribute to (the round we joined in under --overlap):
        the others' contributions, or their averaged shards (`phase` PHASE_AVERAGED)."""
        book = self.book_for(phase)
        logger.info("round %d: listening to the swarm's %s (we contribute from round %d on)",
                    round_id, PHASE_NAMES[phase], round_id + 1)
        got = await book.collect(round_id, expected=lambda: self.expected(round_id) - {self.cfg.node_id},
                                 timeout_s=self.cfg.sync_timeout_s, min_contributors=0)
        # We have no base of our own for this round: follow the one most senders share.
        lineages = Counter((c.base_digest, c.members) for c in got.values())
        best = min(lineages, key=lambda k: (-lineages[k], k)) if lineages else ("", ())
        return self._same_lineage(got, best, phase)

    async def agree_shards(self, round_id: int, members: tuple[str, ...], have: set[int], *,
                           publish: bool = True) -> set[int]:
        """Reduce-scatter: the averaged shards of `round_id` that every member received. We
        publish our receipt (`have`, shard indexes) and wait, up to --sync-timeout, for the
        receipt of every member still alive; a shard missing anywhere then gets no update
        anywhere, so a reducer that died while sending leaves no replica apart. A listener
        (`publish=False`) only reads the members' receipts (docs/protocol.md)."""
        if publish:
            self.receipts[round_id] = frozenset(have)
            for old in sorted(self.receipts)[:-MAX_RECEIPTS]:
                del self.receipts[old]
            self._announce()
        # A member that misses a shard publishes when its own gather deadline passes, up to one
        # --sync-timeout after it started gathering, which was no later than now (we hold its
        # averaged shard, sent when it started) or its scatter's end. Waiting twice that long
        # keeps us from giving up on a receipt that is still coming.
        deadline = time.monotonic() + RECEIPT_WAIT_TIMEOUTS * self.cfg.sync_timeout_s
        while True:
            agreed, waiting = set(have), []
            for member in members:
                peer = self.table.peers.get(member)
                if (member == self.cfg.node_id or peer is None or peer.left or not self.table.is_alive(peer)
                        or peer.contributes_from > round_id):
                    continue  # ours is `have`; one that is gone, or stood aside to listen, publishes none
                receipt = peer.receipts.get(round_id)
                if receipt is not None:
                    agreed &= receipt
                elif peer.round <= round_id:  # still in it (one past it without a receipt listened or
                    waiting.append(member)    # repaired: none will come)
            if not waiting:
                break
            if time.monotonic() >= deadline:
                logger.warning("round %d: no shard receipt from %s by the deadline; applying the "
                               "shards the others received", round_id, ", ".join(waiting))
                break
            await asyncio.sleep(RECEIPT_POLL_S)
        if agreed != have:
            logger.warning("round %d: shards %s did not reach every member; no update for them this "
                           "round, on every member alike", round_id, sorted(have - agreed))
        return agreed

    async def keep_agreed_shards(self, round_id: int, members: tuple[str, ...],
                                 averaged: dict[str, Contribution], *, publish: bool = True) -> dict[str, Contribution]:
        """`averaged` (the gather's contributions) less the shards not every member received."""
        agreed = await self.agree_shards(round_id, members, {c.shard_index for c in averaged.values()},
                                         publish=publish)
        return {k: c for k, c in averaged.items() if c.shard_index in agreed}

    @staticmethod
    def _same_lineage(got: dict[str, Contribution], lineage: tuple[str, tuple[str, ...]],
                      phase: int) -> dict[str, Contribution]:
        """Only contributions made from the same parameters, for the same members, are averaged."""
        kept = {k: c for k, c in got.items() if (c.base_digest, c.members) == lineage}
        for sender in sorted(set(got) - set(kept)):
            logger.warning("round %d: not averaging %s's %s: it was made from other parameters or "
                           "another membership; the repair rule will reconcile us",
                           got[sender].round_id, sender, PHASE_NAMES[phase])
        return kept

    def _push_outbox_to_new_peers(self) -> None:
        now = time.monotonic()
        for (phase, round_id), box in self._outbox.items():
            if now >= box.deadline:
                continue
            for peer in self.table.alive():
                if peer.node_id in box.pushed:
                    continue
                if box.targets is None and peer.round + self.cfg.round_lag < round_id:
                    continue  # behind: it will catch up by state transfer instead
                listener = phase == pb.PHASE_AVERAGED and peer.contributes_from == round_id + 1
                if box.targets is not None and peer.node_id not in box.targets and not listener:
                    continue  # reduce-scatter: members, plus listeners for the averaged shards
                out = box.for_peer(peer.node_id)
                if out is None:
                    continue
                box.pushed.add(peer.node_id)
                self._spawn(self._push(peer.node_id, peer.address, out, box.deadline),
                            f"push-r{round_id}-p{phase}-{peer.node_id}")

    async def _push(self, peer_id: str, address: str, out: Outgoing, deadline: float) -> None:
        """Stream `out` to one peer, retrying transient failures until the deadline."""
        backoff = 0.2
        hidden = 0  # refusals grpcio reported as INTERNAL (see EARLY_STATUS_BUG)
        while (remaining := deadline - time.monotonic()) > 0:
            sent = 0
            try:
                await asyncio.sleep(self.faults.before_call(address))
                self.upload_meter.begin(time.monotonic())
                try:
                    await self.push_call(address)(
                        self._chunks(peer_id, address, out), timeout=remaining,
                        metadata=self.security.metadata("PushContribution"))
                    sent = sum(len(f.data) for f in out.frames)
                finally:
                    self.upload_meter.end(time.monotonic(), sent)
                logger.debug("round %d: sent our %s to %s", out.round_id, PHASE_NAMES[out.phase], peer_id)
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() in FINAL_CODES:
                    logger.warning("round %d: peer %s refused our contribution: %s",
                                   out.round_id, peer_id, exc.details())
                    return
                if exc.code() == grpc.StatusCode.INTERNAL and exc.details() == EARLY_STATUS_BUG:
                    hidden += 1
                    if hidden >= 3:
                        logger.warning("round %d: peer %s keeps ending our stream early (a refusal "
                                       "grpcio reports as INTERNAL); giving up", out.round_id, peer_id)
                        return
                logger.debug("round %d: push to %s failed (%s); retrying", out.round_id, peer_id, exc.code().name)
            await asyncio.sleep(min(backoff, max(0.0, deadline - time.monotonic())) * random.uniform(0.5, 1.0))
            backoff = min(backoff * 2, 5.0)

    @property
    def push_rate(self) -> float:
        """Bytes/s our pushes reach together (0: not measured yet)."""
        return self.upload_meter.rate

    async def _chunks(self, peer_id: str, address: str, out: Outgoing) -> AsyncIterator[bytes]:
        for frame in out.frames:
            if not self.faults.chunk_allowed(frame.index, address=address, phase=out.phase):
                raise FaultInjected(f"stream to {peer_id} cut after {frame.index} chunks")
            if self.faults.plan.delay_s:
                await asyncio.sleep(self.faults.plan.delay_s)
            data = out.wire.chunks.get(frame.index)
            if data is None:
                data = out.wire.chunks[frame.index] = self._serialize_chunk(out, frame)
            await self.upload.acquire(len(data))
            self.counters.bytes_sent += len(data)
            self.counters.per_peer_sent[peer_id] = self.counters.per_peer_sent.get(peer_id, 0) + len(data)
            yield data

    def _serialize_chunk(self, out: Outgoing, frame: Frame) -> bytes:
        """One chunk of `out` as a serialized ContributionChunk (the same for every peer)."""
        header = out.wire.header
        if header is None:  # the tag and the header fields are the same for every chunk
            tag = self.security.contribution_tag(
                round_id=out.round_id, sender_id=self.cfg.node_id,
                contribution_digest=bound_digest(out.digest, out.base_digest, out.phase, out.shard_index,
                                                 out.members, out.contributors),
                codec=out.codec, weight=out.weight, total_elements=out.n_elements)
            header = out.wire.header = pb.ContributionChunk(
                round_id=out.round_id, sender_id=self.cfg.node_id, swarm_id=self.cfg.swarm_id,
                chunk_count=frame.count, codec=CODEC_TO_PB[out.codec], contribution_digest=out.digest,
                weight=out.weight, total_elements=out.n_elements, chunk_elements=out.chunk_elements,
                auth_tag=tag, shuffled=out.shuffled, base_digest=out.base_digest,
                phase=out.phase, shard_index=out.shard_index, shard_count=len(out.members),
                members=out.members, contributors=out.contributors)
        header.chunk_index = frame.index
        header.compressed = frame.compressed
        return serialize_chunk(header, frame.data)

    def record_round(self, round_id: int, param_digest: str) -> None:
        """After our outer step of `round_id`: remember the digest peers compare against."""
        self.round = round_id + 1
        self.param_digest = param_digest
        self.own_digests[round_id + 1] = param_digest
        for old in sorted(self.own_digests)[:-8]:
            del self.own_digests[old]
        self._update_agreement()
        self._announce()

    def _announce(self) -> None:
        """Tell live peers our new round now, not at the next heartbeat: whom a peer waits for
        depends on our round, and rounds can be shorter than a heartbeat period."""
        if self._server is None:
            return
        for peer in self.table.alive():
            self._spawn(self._hello(peer.address), f"announce-{peer.node_id}")

    def _update_agreement(self) -> None:
        state = agreement(self.cfg.node_id, self.round, self.own_digests, self.table.alive())
        if state != self.agreement:
            log = logger.error if state == "diverged" else logger.info
            log("replica agreement: %s at round %d%s", state, self.round,
                "; our parameters differ from the swarm's (repair by state transfer follows)"
                if state == "diverged" else "")
            self.agreement = state

    # ---- catching up -------------------------------------------------------------------------

    async def wait_first_contact(self, timeout_s: float) -> bool:
        """With bootstrap peers, give the first heartbeats time to tell us where the swarm is."""
        if not self.cfg.peers:
            return False
        try:
            await asyncio.wait_for(self._contact.wait(), timeout=timeout_s)
        except TimeoutError:
            return False
        await asyncio.sleep(self.cfg.heartbeat_s * 1.5)  # one more round of hellos: learn the rest
        return True

    async def check_reachable(self) -> None:
        """Ask live peers to dial us back at our advertised address; say plainly if they can't."""
        for peer in self.table.alive()[:3]:
            try:
                resp = await self.stub(peer.address).CheckReachable(
                    pb.ReachRequest(node_id=self.cfg.node_id, swarm_id=self.cfg.swarm_id), timeout=15,
                    metadata=self.security.metadata("CheckReachable"))
            except grpc.aio.AioRpcError:
                continue
            self.reachable = "yes" if resp.reachable else "no"
            if resp.reachable:
                logger.info("reachability: peer %s dialed us back at %s", peer.node_id, resp.address)
            else:
                port = self.advertise.rpartition(":")[2]
                logger.error(
                    "reachability: peer %s cannot reach this node at %s (%s). Peers can't send "
                    "us their contributions: forward TCP port %s on your router to this machine, "
                    "allow it in the firewall, and make --advertise the public HOST:PORT",
                    peer.node_id, resp.address, resp.detail, port)
            return

    async def dial_back(self, node_id: str) -> pb.ReachResponse:
        """Serve CheckReachable: dial a known peer at the address it advertised (never any
        other address, and at most once a minute per peer)."""
        peer = self.table.peers.get(node_id)
        if peer is None:
            raise Refusal("FAILED_PRECONDITION", "say Hello first: only members are dialed back")
        now = time.monotonic()
        if now - self._dialbacks.get(node_id, -60.0) < 60.0:
            raise Refusal("RESOURCE_EXHAUSTED", "one reachability check per minute")
        self._dialbacks[node_id] = now
        channel = self.security.channel(peer.address)
        try:
            await pb_grpc.NodeStub(channel).Status(pb.StatusRequest(), timeout=5,
                                                   metadata=self.security.metadata("Status"))
            return pb.ReachResponse(reachable=True, address=peer.address)
        except grpc.aio.AioRpcError as exc:
            return pb.ReachResponse(reachable=False, address=peer.address,
                                    detail=f"{exc.code().name}: {exc.details()}")
        finally:
            await channel.close()

    def catch_up_plan(self) -> CatchUp | None:
        return plan_catch_up(self.cfg.node_id, self.round, self.own_digests, self.table.alive())

    async def fetch_state(self, donors: list[str]) -> GlobalState | None:
        """Download the global state from the first donor that delivers a verified copy."""
        for donor_id in donors:
            peer = self.table.peers.get(donor_id)
            if peer is None or not self.table.is_alive(peer):
                continue
            try:
                self.faults.before_call(peer.address)
                call = self.stub(peer.address).FetchState(
                    pb.StateRequest(node_id=self.cfg.node_id, swarm_id=self.cfg.swarm_id),
                    timeout=max(60.0, self.cfg.sync_timeout_s), metadata=self.security.metadata("FetchState"))
                state = await download(call, n_elements=self.cfg.n_elements, manifest_hash=self.cfg.manifest_hash,
                                       executor=self.executor, security=self.security)
            except grpc.aio.AioRpcError as exc:
                logger.warning("state transfer from %s failed (%s: %s); trying another donor",
                               donor_id, exc.code().name, exc.details())
                continue
            except (Refusal, AuthError) as exc:
                logger.warning("state from %s refused: %s; trying another donor", donor_id, exc)
                continue
            self.counters.bytes_received += state.params.numel() * 4 * (2 if state.momentum is not None else 1)
            expected = self._published_digest(state.round, donor_id, donors)
            if expected is not None and state.param_digest != expected:
                logger.warning("state from %s is not the swarm's: its round-%d parameters hash to %s, but "
                               "that round's published param_digest is %s; trying another donor",
                               donor_id, state.round, state.param_digest[:12], expected[:12])
                continue
            self.state_transfers += 1
            return state
        return None

    def _published_digest(self, round_id: int, donor_id: str, lineage: list[str]) -> str | None:
        """The param_digest a downloaded state of `round_id` must have: what most other members
        of the donor's lineage published for that round, else what the donor itself published.
        A donor's own header is never enough: a lying donor would vouch for its own state."""
        others = Counter(p.digests[round_id] for p in self.table.alive()
                         if p.node_id in lineage and p.node_id != donor_id and round_id in p.digests)
        if others:
            return min(others, key=lambda d: (-others[d], d))
        donor = self.table.peers.get(donor_id)
        return donor.digests.get(round_id) if donor is not None else None

    def closed_without_us(self, round_id: int) -> list[str]:
        """Peers of our lineage (same parameters at the start of `round_id`) that already closed
        `round_id`, so averaged it without us: we joined, or trained, too late for it."""
        ours = self.own_digests.get(round_id)
        return sorted(p.node_id for p in self.table.alive()
                      if ours is not None and p.round == round_id + 1 and p.digests.get(round_id) == ours)

    def stand_aside(self, round_id: int) -> None:
        """Only listen to `round_id` (see closed_without_us): peers still in it stop waiting for
        us, and reducers send us their averaged shards."""
        self.contributes_from = max(self.contributes_from, round_id + 1)
        self._announce()

    def adopt(self, round_id: int, param_digest: str, *, contributes_from: int = 0) -> None:
        """After loading a downloaded state: forget our old lineage and rounds."""
        self.round = round_id
        self.contributes_from = contributes_from
        self.param_digest = param_digest
        self.own_digests = {round_id: param_digest}
        self.book.reset(round_id)
        self.gather_book.reset(round_id)
        self._update_agreement()
        self._announce()

    # ---- incoming contributions -------------------------------------------------------------

    async def receive(self, chunks: AsyncIterator[Chunk], *, sender: list[str] | None = None,
                      proven_id: str = "", certified_id: str = "") -> int:
        """Validate and store one incoming contribution stream; returns chunks received.
        `sender` gets the claimed sender id as soon as the first chunk is read (for blame)."""
        first: Chunk | None = None
        first_key: tuple[Any, ...] = ()
        assembler: Assembler | None = None
        digest = ContributionDigest()
        loop = asyncio.get_running_loop()
        next_index = 0
        try:
            async for chunk in chunks:
                if isinstance(chunk, Undecodable):
                    raise Refusal("INVALID_ARGUMENT", f"PushContribution: chunk {next_index} is not a valid "
                                  f"ContributionChunk message ({chunk.error}); check that both sides run "
                                  "the same neuronode protocol")
                if first is None:
                    if sender is not None:
                        sender.append(chunk.sender_id[:MAX_ID_CHARS])
                    if certified_id and chunk.sender_id != certified_id:
                        raise Refusal("PERMISSION_DENIED", f"the caller's certificate is for node {certified_id!r}, "
                                      f"not {chunk.sender_id[:MAX_ID_CHARS]!r}; each node speaks only as itself")
                    if proven_id and self.bans.banned_for(f"node:{proven_id}"):
                        raise Refusal("PERMISSION_DENIED", "sender is banned for repeated invalid input")
                    self._check_proof(chunk, proven_id)
                    assembler = self._open_stream(chunk)
                    first, first_key = chunk, stream_key(chunk)
                else:
                    check_same_stream(first_key, chunk)
                assert assembler is not None
                if chunk.chunk_index != next_index:
                    raise Refusal("INVALID_ARGUMENT", f"round {first.round_id}: {first.sender_id} sent chunk "
                                  f"{chunk.chunk_index} where chunk {next_index} was due; chunks go in order, once each")
                next_index += 1
                raw, size = await loop.run_in_executor(self.executor, self._decode_chunk, assembler, chunk, digest)
                assembler.add(chunk.chunk_index, raw, vetted=True)  # _decode_chunk checked it
                self._count_received(chunk.sender_id, size)
            if first is None or assembler is None:
                raise Refusal("INVALID_ARGUMENT", "empty contribution stream")
            if not assembler.complete:
                raise Refusal("DATA_LOSS", f"round {first.round_id}: stream from {first.sender_id} ended "
                              f"with {len(assembler.missing())} of {assembler.count} chunks missing; discarded")
            if digest.hexdigest() != first.contribution_digest:
                raise Refusal("DATA_LOSS", f"round {first.round_id}: contribution from {first.sender_id} "
                              "does not match its digest; discarded")
            self.book_for(first.phase).finish(Contribution(
                first.sender_id, first.round_id, PB_TO_CODEC[first.codec], first.weight, assembler,
                base_digest=first.base_digest, members=tuple(first.members),
                contributors=tuple(first.contributors), shard_index=first.shard_index))
            return assembler.count
        except RoundRefused as exc:
            raise Refusal(exc.code, str(exc)) from None
        except ValueError as exc:  # CodecError and friends: malformed payloads
            raise Refusal("INVALID_ARGUMENT", str(exc)) from None
        finally:
            if first is not None:
                self.book_for(first.phase).abort(first.round_id, first.sender_id)

    def _check_proof(self, chunk: Chunk, proven_id: str) -> None:
        """In a closed swarm: the sender is the caller that proved itself, and the contribution's
        tag binds it to its round and digest (no forgery, no replay into another round)."""
        if not self.security.secret:
            return
        if chunk.sender_id != proven_id:
            raise Refusal("PERMISSION_DENIED", f"caller {proven_id!r} may not send as {chunk.sender_id[:MAX_ID_CHARS]!r}")
        try:
            self.security.check_contribution(
                chunk.auth_tag, round_id=chunk.round_id, sender_id=chunk.sender_id,
                contribution_digest=bound_digest(chunk.contribution_digest, chunk.base_digest, chunk.phase,
                                                 chunk.shard_index, chunk.members, chunk.contributors),
                codec=PB_TO_CODEC.get(chunk.codec, "?"),
                weight=chunk.weight, total_elements=chunk.total_elements)
        except AuthError as exc:
            raise Refusal("PERMISSION_DENIED", f"{exc}: forged or replayed contribution") from None

    def _open_stream(self, chunk: Chunk) -> Assembler:
        """Check the header of a new stream and open its slot in the round book."""
        if chunk.swarm_id != self.cfg.swarm_id:
            raise Refusal("PERMISSION_DENIED", f"contribution for swarm '{chunk.swarm_id}', this is '{self.cfg.swarm_id}'")
        peer = self.table.peers.get(chunk.sender_id)
        if peer is None or peer.left:
            raise Refusal("FAILED_PRECONDITION", f"unknown sender '{chunk.sender_id[:MAX_ID_CHARS]}': say Hello first")
        if self.faults.path and self.faults.cut_off(peer.address):
            raise Refusal("UNAVAILABLE", "fault injected: sender is cut off")
        if chunk.codec not in PB_TO_CODEC:
            raise Refusal("INVALID_ARGUMENT", f"unknown codec {chunk.codec}")
        if chunk.total_elements != self.cfg.n_elements:
            raise Refusal("INVALID_ARGUMENT", f"contribution has {chunk.total_elements} elements, the model has "
                          f"{self.cfg.n_elements}")
        codec = get_codec(PB_TO_CODEC[chunk.codec])
        per_chunk = chunk.chunk_elements
        if per_chunk <= 0 or per_chunk % codec.block_elems or codec.payload_bytes(per_chunk) > MAX_CHUNK_PAYLOAD:
            raise Refusal("INVALID_ARGUMENT", f"chunk_elements {per_chunk} is not a positive multiple of "
                          f"{codec.block_elems} within {MAX_CHUNK_PAYLOAD} bytes")
        if not (chunk.weight > 0 and chunk.weight < 1e15):
            raise Refusal("INVALID_ARGUMENT", f"weight {chunk.weight} must be a positive sample count")
        assembler = Assembler(n_elems=self._payload_elements(chunk, codec.name), codec=codec.name,
                              chunk_bytes=codec.payload_bytes(per_chunk))
        if chunk.chunk_count != assembler.count:
            raise Refusal("INVALID_ARGUMENT", f"chunk_count {chunk.chunk_count} does not match "
                          f"{assembler.count} chunks of {per_chunk} elements")
        self.book_for(chunk.phase).begin(chunk.round_id, chunk.sender_id)
        peer.last_seen = time.monotonic()
        return assembler

    def book_for(self, phase: int) -> RoundBook:
        return self.gather_book if phase == pb.PHASE_AVERAGED else self.book

    def _payload_elements(self, chunk: Chunk, codec: str) -> int:
        """Elements this stream carries: the model, or one reduce-scatter shard of it."""
        if chunk.phase == pb.PHASE_UNSPECIFIED:
            if chunk.members or chunk.shard_count:
                raise Refusal("INVALID_ARGUMENT", "a whole contribution names no shard")
            return self.cfg.n_elements
        if chunk.phase not in (pb.PHASE_SHARD, pb.PHASE_AVERAGED):
            raise Refusal("INVALID_ARGUMENT", f"unknown phase {chunk.phase}")
        members = list(chunk.members)
        if not 0 < len(members) <= MAX_PEERS_LISTED or members != sorted(set(members)) \
                or chunk.shard_count != len(members) or chunk.shard_index >= len(members):
            raise Refusal("INVALID_ARGUMENT", "members must be sorted unique node ids, one shard each")
        reducer = members[chunk.shard_index]
        if chunk.phase == pb.PHASE_SHARD and reducer != self.cfg.node_id:
            raise Refusal("INVALID_ARGUMENT", f"shard {chunk.shard_index} is reduced by {reducer}, not here")
        if chunk.phase == pb.PHASE_AVERAGED and reducer != chunk.sender_id:
            raise Refusal("INVALID_ARGUMENT", f"shard {chunk.shard_index} is reduced by {reducer}, not the sender")
        if len(chunk.contributors) > len(members):
            raise Refusal("INVALID_ARGUMENT", "more contributors than members")
        start, stop = shard_ranges(self.cfg.n_elements, len(members), codec)[chunk.shard_index]
        return stop - start

    @staticmethod
    def _decode_chunk(assembler: Assembler, chunk: Chunk,
                      digest: ContributionDigest) -> tuple[bytes, int]:
        """Bounded decompression, then a payload check that refuses what would decode to NaN/Inf
        before anything is stored: bad values never reach an average. Hashing happens here too, off the loop
        (chunks of one stream are awaited one at a time, so the digest sees them in order)."""
        expected = assembler.expected_raw_len(chunk.chunk_index)
        codec = get_codec(PB_TO_CODEC[chunk.codec])
        width = codec.shuffle_width if chunk.shuffled else 1
        raw = decode_frame(chunk.payload, chunk.compressed, expected_raw_len=expected, shuffle_width=width)
        codec.check_payload(raw, assembler.chunk_elems(chunk.chunk_index))
        digest.update(raw)
        return raw, chunk.ByteSize()

    def _count_received(self, sender_id: str, size: int) -> None:
        self.counters.bytes_received += size
        per = self.counters.per_peer_received
        per[sender_id] = per.get(sender_id, 0) + size

    def snapshot(self) -> dict[str, Any]:
        """Swarm-side status fields."""
        now = time.monotonic()
        return {
            "node_id": self.cfg.node_id, "swarm_id": self.cfg.swarm_id, "advertise": self.advertise,
            "protocol_version": PROTOCOL_VERSION, "agreement": self.agreement,
            "state_transfers": self.state_transfers, "states_served": self.donor.served,
            "reachable": self.reachable,
            "bytes_sent": self.counters.bytes_sent, "bytes_received": self.counters.bytes_received,
            "peers": [
                {"node_id": p.node_id, "address": p.address, "alive": self.table.is_alive(p),
                 "last_seen_s": round(now - p.last_seen, 3) if p.last_seen else -1.0}
                for p in sorted(self.table.peers.values(), key=lambda p: p.node_id)
            ],
        }


def bound_digest(digest: str, base_digest: str, phase: int, shard_index: int,
                 members: Any, contributors: Any) -> str:
    """Everything a contribution's tag must bind besides round, sender, codec, weight and size:
    its payload digest, the parameters it started from and its reduce-scatter role."""
    return json.dumps([digest, base_digest, int(phase), int(shard_index), list(members), list(contributors)])


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


STREAM_FIELDS = ("round_id", "sender_id", "chunk_count", "codec", "contribution_digest", "weight",
                 "total_elements", "chunk_elements", "swarm_id", "auth_tag", "shuffled", "base_digest",
                 "phase", "shard_index", "shard_count", "members", "contributors")


def stream_key(chunk: Chunk) -> tuple[Any, ...]:
    """The header fields every chunk of one stream must repeat unchanged."""
    header = chunk.header if isinstance(chunk, ChunkView) else chunk
    return tuple(getattr(header, name) for name in STREAM_FIELDS)


def check_same_stream(first: tuple[Any, ...], chunk: Chunk) -> None:
    """Header fields may not change within one stream (`first`: the first chunk's stream_key)."""
    key = stream_key(chunk)
    if key != first:
        name = next(n for n, a, b in zip(STREAM_FIELDS, first, key, strict=True) if a != b)
        raise Refusal("INVALID_ARGUMENT", f"{name} changed within one contribution stream")


class NodeService(pb_grpc.NodeServicer):
    """The gRPC face of a SwarmNode. Every refusal maps to a status code and a clear message."""

    def __init__(self, node: SwarmNode) -> None:
        self.node = node

    def caller_key(self, context: grpc.aio.ServicerContext, node_id: str = "") -> str:
        """Whom to blame for bad input: the node id when ids are authenticated (a closed
        swarm), else the caller's IP; loopback callers are never banned (they are local)."""
        proven = caller_id(context) if self.node.security.secret else ""
        if proven:  # a proven id, never a claimed one: no member can get another banned
            return f"node:{proven}"
        host = context.peer().split(":", 1)[-1].rsplit(":", 1)[0].strip("[]")
        return "" if is_loopback(host) else f"ip:{host}"

    async def check_certificate(self, context: grpc.aio.ServicerContext, claimed_id: str) -> None:
        """With mutual TLS a caller speaks only as the node its certificate names."""
        if self.node.security.tls_files is None:
            return
        name = peer_common_name(context.auth_context())
        if name is not None and claimed_id != name:
            self.node.counters.refusals["PERMISSION_DENIED"] = self.node.counters.refusals.get(
                "PERMISSION_DENIED", 0) + 1
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"the caller's certificate is for node {name!r}, not "
                                f"{claimed_id[:MAX_ID_CHARS]!r}; each node speaks only as itself")

    async def check_ban(self, context: grpc.aio.ServicerContext, node_id: str = "") -> None:
        """Admit a caller: loopback only in protected mode, and never a banned one."""
        if self.node.loopback_only:
            host = context.peer().split(":", 1)[-1].rsplit(":", 1)[0].strip("[]")
            if not is_loopback(host):
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    "this node serves loopback callers only (no --secret-file, TLS or --open)")
        key = self.caller_key(context, node_id)
        left = self.node.bans.banned_for(key) if key else 0.0
        if left > 0:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"banned for {left:.0f} more seconds after repeated invalid input")

    async def _abort(self, context: grpc.aio.ServicerContext, exc: Refusal, what: str,
                     node_id: str = "") -> None:
        message = str(exc)
        if len(message) > 1024:  # never echo a caller's oversized strings back
            message = message[:1000] + "... (truncated)"
        reason = exc.code.lower()
        self.node.counters.refusals[reason] = self.node.counters.refusals.get(reason, 0) + 1
        key = self.caller_key(context, node_id)
        if key and exc.code in ("INVALID_ARGUMENT", "DATA_LOSS", "PERMISSION_DENIED", "UNAUTHENTICATED"):
            self.node.bans.strike(key)
        host = context.peer().rsplit(":", 1)[0]  # not the ephemeral port: one key per caller host
        self.node.say(f"refused:{what}:{host}:{exc.code}", logging.WARNING,
                      "refused %s from %s: %s", what, context.peer(), message, every_s=60.0)
        await context.abort(STATUS_CODES[exc.code], message)

    async def Hello(self, request: pb.HelloRequest, context: grpc.aio.ServicerContext) -> pb.HelloResponse:
        if self.node.leaving:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "node is shutting down")
        await self.check_ban(context, request.info.node_id)
        await self.check_certificate(context, request.info.node_id)
        if self.node.faults.path and self.node.faults.cut_off(request.info.advertise):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "fault injected: caller is cut off")
        try:
            self.node.check_info(request.info)
        except Refusal as exc:
            await self._abort(context, exc, "hello", request.info.node_id)
        proven = caller_id(context)
        if self.node.security.secret and proven != request.info.node_id:
            await self._abort(context, Refusal("PERMISSION_DENIED", f"caller {proven!r} may not say hello as "
                                               f"{request.info.node_id[:MAX_ID_CHARS]!r}"), "hello")
        try:
            self.node.security.check_hello_proof(request.auth_tag, request.timestamp_s, request.info,
                                                 request.known_peers)
        except AuthError as exc:
            await self._abort(context, Refusal("UNAUTHENTICATED", f"{exc}; the Hello's content does not match "
                                               "its proof (rewritten on the way, or another secret)"), "hello")
        if request.info.node_id != self.node.cfg.node_id:
            self.node.learn(request.info, list(request.known_peers))
        resp = pb.HelloResponse(info=self.node.node_info(), known_peers=self.node.known_peers())
        resp.auth_tag, resp.timestamp_s = self.node.security.hello_proof(resp.info, resp.known_peers)
        return resp

    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext) -> pb.LeaveResponse:
        await self.check_ban(context, request.node_id)
        await self.check_certificate(context, request.node_id)
        if self.node.security.secret and caller_id(context) != request.node_id:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "a node can only announce its own leave")
        if request.swarm_id == self.node.cfg.swarm_id and self.node.table.mark_left(request.node_id):
            self.node.book.notify()
        return pb.LeaveResponse()

    async def PushContribution(
        self, request_iterator: AsyncIterator[Chunk], context: grpc.aio.ServicerContext,
    ) -> pb.PushAck:
        if self.node.leaving:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "node is shutting down")
        await self.check_ban(context)
        sender: list[str] = []
        try:
            certified = peer_common_name(context.auth_context()) if self.node.security.tls_files else None
            count = await self.node.receive(request_iterator, sender=sender, proven_id=caller_id(context),
                                            certified_id=certified or "")
        except Refusal as exc:
            await self._abort(context, exc, "contribution", sender[0] if sender else "")
        return pb.PushAck(chunks_received=count)

    async def FetchState(
        self, request: pb.StateRequest, context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.StateChunk]:
        await self.check_ban(context, request.node_id)
        await self.check_certificate(context, request.node_id)
        peer = self.node.table.peers.get(request.node_id)
        if request.swarm_id != self.node.cfg.swarm_id or peer is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "state is served to members only: say Hello first")
        try:
            async for msg in self.node.donor.serve(context):
                size = msg.ByteSize()  # state chunks are rare; contributions avoid this
                await self.node.upload.acquire(size)
                self.node.counters.bytes_sent += size
                yield msg
        except Refusal as exc:
            await self._abort(context, exc, "state request")
        logger.info("served the global state to %s", request.node_id)

    async def CheckReachable(self, request: pb.ReachRequest, context: grpc.aio.ServicerContext) -> pb.ReachResponse:
        await self.check_ban(context, request.node_id)
        await self.check_certificate(context, request.node_id)
        try:
            if request.swarm_id != self.node.cfg.swarm_id:
                raise Refusal("PERMISSION_DENIED", "another swarm")
            return await self.node.dial_back(request.node_id)
        except Refusal as exc:
            await self._abort(context, exc, "reachability check")
            raise  # unreachable: abort raises

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        await self.check_ban(context)
        host = context.peer().split(":", 1)[-1].rsplit(":", 1)[0].strip("[]")
        if self.node.security.secret and not is_loopback(host):
            try:  # Status is open to local health checks, members only from elsewhere
                self.node.security.verify_metadata(context.invocation_metadata(), NODE_PREFIX + "Status")
            except AuthError as exc:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        return dict_to_status({**self.node.status_provider(), **self.node.snapshot()})
