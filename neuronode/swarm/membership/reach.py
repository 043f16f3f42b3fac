"""Reachability and the address peers see: can our peers dial us back, and where?

Every Hello answer tells the caller the address its connection came from
(`HelloResponse.observed_address`). A node with a wildcard --listen and no --advertise takes
the host a quorum of its peers agree on (`trust.agreed_host`) with its own listen port as its
candidate address, and asks three peers on distinct hosts, drawn at random among the live ones
(`trust.askers`: ids cheap to grind to a low prefix choose nothing), to dial it back there
(CheckReachable): with a majority of them saying yes it advertises it; with a majority saying
no it is unreachable (behind NAT) and says so
(NodeInfo.reachable), nobody dials it, and it takes part through sessions it opens to
reachable members (neuronode.swarm.links.sessions). `--reachable yes|no` skips the dial-back.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from pathlib import Path

import grpc

from neuronode.config import is_wildcard_host
from neuronode.events import fields
from neuronode.quorum import voice
from neuronode.swarm.context import Context
from neuronode.swarm.guard.trust import ASKED, agreed_host, askers, reachability
from neuronode.swarm.links import Links, NoRoute
from neuronode.swarm.links.resolve import Resolver, canonical_ip, join, literal, split
from neuronode.swarm.membership.table import Peer
from neuronode.swarm.wire import MAX_ADDRESS_CHARS, Refusal
from neuronode.v1 import node_pb2 as pb

logger = logging.getLogger(__name__)

DIAL_BACK_EVERY_S = 60.0
RECHECK_S = 600.0  # a verdict is checked again this often (a router's port forward may change)
RETRY_S = 30.0  # after a check without a quorum
SETTLE_HEARTBEATS = 3  # heartbeats to wait for more hosts before asking fewer than three


def host_of(address: str) -> str:
    return address.rpartition(":")[0].strip("[]")


def join_host_port(host: str, port: int | str) -> str:
    return join(host, port)


class Reach:
    """Our address and reachability; `on_change` runs when either changed."""

    def __init__(self, ctx: Context, *, links: Links, on_change: Callable[[], None] = lambda: None) -> None:
        self.ctx = ctx
        self.links = links
        self.on_change = on_change
        self.observed: dict[str, str] = {}  # peer id -> the host it sees our connections come from
        self.checked_for = ""  # the address the current verdict is about
        self.checked_at = -RECHECK_S
        self._dialbacks: dict[str, float] = {}  # caller's host (quorum.voice) -> last dial-back we did for it
        self._said_tls = ""
        self.decided = ("unknown", ctx.advertise)  # the verdict and address we last announced
        self.settled_since: float | None = None  # since when we know a peer to ask
        self._checking = asyncio.Lock()
        self.rng = random.Random()  # whom to ask (trust.askers)
        if ctx.cfg.reachable == "no":  # before our first Hello: nobody is to dial us, ever
            ctx.reachable = "no"

    @property
    def reachable(self) -> str:
        return self.ctx.reachable

    @property
    def learning(self) -> bool:
        """No --advertise and a wildcard --listen: our address comes from what peers see."""
        return not self.ctx.cfg.advertise and is_wildcard_host(host_of(self.ctx.cfg.listen))

    # ---- the address peers see ----------------------------------------------------------------

    def observe(self, peer_id: str, observed_address: str) -> None:
        """A peer's Hello answer told us where our connection came from."""
        host = host_of(observed_address)
        if host and len(observed_address) <= MAX_ADDRESS_CHARS:
            self.observed[peer_id] = host
            for gone in [p for p in self.observed if p not in self.ctx.table.peers]:
                del self.observed[gone]

    @property
    def observed_host(self) -> str:
        return agreed_host(self.observed, self.ctx.table.voice) or ""

    def target(self) -> str:
        """The address to be dialed at: --advertise (or --listen's), else the learned candidate."""
        if not self.learning:
            return self.ctx.advertise
        host = self.observed_host
        return join_host_port(host, self.ctx.bound_port) if host and self.ctx.bound_port else ""

    # ---- the verdict ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Keep our address and reachability current (a supervised task of the node)."""
        while True:
            await self.step()
            await self.ctx.clock.sleep(self.ctx.cfg.heartbeat_s)

    async def step(self, *, again: bool = False) -> None:
        """Check our address when it is new, or its verdict old (`again`: now, whatever the
        last verdict); one check at a time (a peer dials a member back once a minute)."""
        async with self._checking:
            if again:
                self.checked_for = ""
            await self._step()

    async def _step(self) -> None:
        ctx, target = self.ctx, self.target()
        forced = ctx.cfg.reachable
        if forced == "no" or (forced == "yes" and target):  # --reachable: no dial-back
            self.decide(forced, target)
            return
        if not target or forced != "auto":
            return
        now = ctx.clock.now()
        if target == self.checked_for and now - self.checked_at < RECHECK_S:
            return
        asked = askers([p for p in ctx.table.alive() if self.links.dialable(p)], rng=self.rng)
        if not asked:
            self.settled_since = None
            return
        # Before asking fewer than three hosts, give the swarm a few heartbeats to introduce the
        # rest: the first peer to answer us must not decide alone.
        self.settled_since = self.settled_since if self.settled_since is not None else now
        if len(asked) < ASKED and now - self.settled_since < SETTLE_HEARTBEATS * ctx.cfg.heartbeat_s:
            return
        verdict = await self.check(target, asked)
        self.checked_for, self.checked_at = target, now if verdict != "unknown" else now - RECHECK_S + RETRY_S
        if verdict != "unknown":
            self.decide(verdict, target)

    def decide(self, verdict: str, target: str) -> None:
        """Apply a verdict about `target`: advertise it (reachable), or take part through
        sessions (unreachable); tell peers at once."""
        ctx = self.ctx
        if verdict == "yes" and self.learning and not self.certified(target):
            verdict = "no"  # peers could not check our certificate at that host
        advertise = target if verdict == "yes" or not self.learning else ""
        if (verdict, advertise) == self.decided:
            return
        self.decided = (verdict, advertise)
        ctx.reachable, ctx.advertise = verdict, advertise
        ctx.faults.self_address = advertise
        if verdict == "yes":
            logger.info("reachable: peers dial this node at %s", target,
                        extra=fields("reachability", reachable=True, address=target))
        else:
            port = target.rpartition(":")[2]
            logger.info("not reachable from the internet (peers cannot dial %s); taking part through sessions to "
                        "reachable members. Forwarding TCP port %s to this machine (and --advertise with the "
                        "public address) would let it serve others too (docs/volunteer.md)", target, port,
                        extra=fields("reachability", reachable=False, address=target))
        self.on_change()

    def certified(self, target: str) -> bool:
        """Under mutual TLS, a learned host must be one our certificate names."""
        tls = self.ctx.security.tls_files
        if tls is None:
            return True
        from neuronode.security.certs import cert_hosts

        host, hosts = host_of(target), cert_hosts(Path(tls[0]))
        if host in hosts:
            return True
        if self._said_tls != host:
            self._said_tls = host
            logger.error("peers see this node at %s, but --tls-cert is valid for %s only: not advertising it; "
                         "issue a certificate with --host %s, or set --advertise", host, ", ".join(hosts), host)
        return False

    async def check(self, target: str, asked: list[Peer]) -> str:
        """Ask `asked` (up to three live peers on distinct hosts) to dial us back at `target`; the
        verdict needs a majority of the hosts that answered (neuronode.swarm.guard.trust.reachability)."""
        answers = await asyncio.gather(*(self.ask(p.node_id, target) for p in asked))
        said = [(peer, resp) for peer, resp in zip(asked, answers, strict=True) if resp is not None]
        verdict = reachability([(p.node_id, resp.reachable) for p, resp in said], self.ctx.table.voice)
        if verdict == "unknown" and said:
            logger.warning("reachability: peers disagree whether they can dial us back at %s (%s); not deciding",
                           target, ", ".join(f"{p.node_id}: {'yes' if r.reachable else 'no'}" for p, r in said),
                           extra=fields("reachability", reachable=None, address=target))
        return verdict

    async def ask(self, peer_id: str, target: str) -> pb.ReachResponse | None:
        ctx = self.ctx
        request = pb.ReachRequest(node_id=ctx.cfg.node_id, swarm_id=ctx.cfg.swarm_id,
                                  address=target if target != ctx.advertise else "")
        try:
            answer: pb.ReachResponse = await self.links.call(
                peer_id, "CheckReachable", ctx.security.sign_request("CheckReachable", request, peer_id),
                timeout_s=15)
        except (grpc.aio.AioRpcError, NoRoute):
            return None
        return answer

    # ---- serving dial-backs ----------------------------------------------------------------------

    async def dial_back(self, node_id: str, caller_host: str, address: str = "") -> pb.ReachResponse:
        """Serve CheckReachable: dial a live member back at the address it advertised in its own
        Hello (or the one it asks about, before it advertises it), only if that address names the
        IP the call came from (never another machine: no scanning through us), and then that
        very IP, never the name again (a name resolved twice may name another machine the second
        time: DNS rebinding); at most once a minute per host; answer yes or no, nothing more."""
        ctx = self.ctx
        peer = ctx.table.peers.get(node_id)
        if peer is None or not ctx.table.is_alive(peer):
            raise Refusal("FAILED_PRECONDITION", "say Hello first: only live members are dialed back")
        address = address or peer.address
        parts = split(address) if len(address) <= MAX_ADDRESS_CHARS else None
        if parts is None:
            raise Refusal("INVALID_ARGUMENT", "the address to dial back must be HOST:PORT")
        name, port = parts
        caller = canonical_ip(caller_host)
        if not caller or caller not in await Resolver.lookup_all(name):
            raise Refusal("PERMISSION_DENIED", f"you ask about {address[:MAX_ADDRESS_CHARS]}, but call from "
                          f"{caller_host}; a node is dialed back only at the host it calls from")
        now = ctx.clock.now()
        slot = voice(node_id, caller)  # one per host, whatever ids it runs (per id on our loopback)
        if now - self._dialbacks.get(slot, -DIAL_BACK_EVERY_S) < DIAL_BACK_EVERY_S:
            raise Refusal("RESOURCE_EXHAUSTED", "one reachability check per minute per host")
        self._dialbacks[slot] = now
        for old in [k for k, t in self._dialbacks.items() if now - t >= DIAL_BACK_EVERY_S]:
            del self._dialbacks[old]
        try:
            await self.links.dial_once(join(caller, port), "Status", pb.StatusRequest(), timeout_s=5,
                                       name="" if literal(address) else name)
            return pb.ReachResponse(reachable=True, address=address)
        except (grpc.aio.AioRpcError, NoRoute):
            return pb.ReachResponse(reachable=False, address=address)
