"""Reachability: can our peers dial us back at the address we advertise?"""

from __future__ import annotations

import asyncio
import ipaddress
import logging

import grpc

from neuronode.events import fields
from neuronode.swarm.context import Context
from neuronode.swarm.trust import reachability
from neuronode.swarm.wire import MAX_ADDRESS_CHARS, Refusal
from neuronode.v1 import node_pb2 as pb
from neuronode.v1 import node_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

DIAL_BACK_EVERY_S = 60.0


class Reach:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.reachable = "unknown"
        self._dialbacks: dict[str, float] = {}  # node id -> last dial-back we did for it

    async def check(self) -> None:
        """Ask up to three live peers to dial us back at our advertised address; the verdict
        needs a quorum of them (neuronode.swarm.trust.reachability), and we say plainly if they
        can't reach us."""
        ctx = self.ctx
        asked = ctx.table.alive()[:3]
        answers = await asyncio.gather(*(self.ask(p.address) for p in asked))
        said = [(peer, resp) for peer, resp in zip(asked, answers, strict=True) if resp is not None]
        self.reachable = reachability(resp.reachable for _, resp in said)
        if self.reachable == "unknown" and said:
            logger.warning("reachability: peers disagree whether they can dial us back at %s (%s); not deciding",
                           ctx.advertise, ", ".join(f"{p.node_id}: {'yes' if r.reachable else 'no'}" for p, r in said),
                           extra=fields("reachability", reachable=None, address=ctx.advertise))
        for peer, resp in said:
            if resp.reachable != (self.reachable == "yes") or self.reachable == "unknown":
                continue
            if resp.reachable:
                logger.info("reachability: peer %s dialed us back at %s", peer.node_id, resp.address,
                            extra=fields("reachability", peer_id=peer.node_id, reachable=True, address=resp.address))
            else:
                port = ctx.advertise.rpartition(":")[2]
                logger.error(
                    "reachability: peer %s cannot reach this node at %s. Peers can't send "
                    "us their contributions: forward TCP port %s on your router to this machine, "
                    "allow it in the firewall, and make --advertise the public HOST:PORT",
                    peer.node_id, resp.address, port,
                    extra=fields("reachability", peer_id=peer.node_id, reachable=False, address=resp.address))
            return

    async def ask(self, address: str) -> pb.ReachResponse | None:
        ctx = self.ctx
        try:
            return await ctx.channels.stub(address).CheckReachable(
                ctx.security.sign_request("CheckReachable", pb.ReachRequest(node_id=ctx.cfg.node_id, swarm_id=ctx.cfg.swarm_id)), timeout=15,
                metadata=ctx.security.metadata("CheckReachable"))
        except grpc.aio.AioRpcError:
            return None

    async def dial_back(self, node_id: str, caller_host: str) -> pb.ReachResponse:
        """Serve CheckReachable: dial a live member back at the address it advertised in its own
        Hello, only if that address is the host the call came from (never another machine: no
        scanning through us), at most once a minute per member; answer yes or no, nothing more."""
        ctx = self.ctx
        peer = ctx.table.peers.get(node_id)
        if peer is None or not ctx.table.is_alive(peer):
            raise Refusal("FAILED_PRECONDITION", "say Hello first: only live members are dialed back")
        host = peer.address.rpartition(":")[0].strip("[]")
        if caller_host not in await self.resolve(host):
            raise Refusal("PERMISSION_DENIED", f"you advertise {peer.address[:MAX_ADDRESS_CHARS]}, but call from "
                          f"{caller_host}; a node is dialed back only at the host it calls from")
        now = ctx.clock.now()
        if now - self._dialbacks.get(node_id, -DIAL_BACK_EVERY_S) < DIAL_BACK_EVERY_S:
            raise Refusal("RESOURCE_EXHAUSTED", "one reachability check per minute")
        self._dialbacks[node_id] = now
        for old in [k for k, t in self._dialbacks.items() if now - t >= DIAL_BACK_EVERY_S]:
            del self._dialbacks[old]
        channel = ctx.security.channel(peer.address)
        try:
            await pb_grpc.NodeStub(channel).Status(pb.StatusRequest(), timeout=5,
                                                   metadata=ctx.security.metadata("Status"))
            return pb.ReachResponse(reachable=True, address=peer.address)
        except grpc.aio.AioRpcError:
            return pb.ReachResponse(reachable=False, address=peer.address)
        finally:
            await channel.close()

    @staticmethod
    async def resolve(host: str) -> set[str]:
        """The addresses `host` names (itself if it is one), resolved without blocking the loop."""
        try:
            ipaddress.ip_address(host)
            return {host}
        except ValueError:
            pass
        try:
            infos = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(host, None), timeout=5)
        except (OSError, TimeoutError):
            return set()
        return {str(info[4][0]) for info in infos}
