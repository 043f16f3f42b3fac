"""The gRPC face of a node (service neuronode.v1.Node). Every refusal maps to a status code and
a message a person can act on. PushContribution is served by the inbound path
(neuronode.swarm.streams.inbound), which reads the raw chunk bytes."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import grpc

from neuronode.quorum import voice
from neuronode.security.auth import AuthError
from neuronode.swarm.context import Context
from neuronode.swarm.guard.admission import (
    Admission,
    caller_host,
    end_call,
    member_request,
    signed_by,
)
from neuronode.swarm.guard.interceptors import NODE_SERVICE_PREFIX, caller_id
from neuronode.swarm.membership.peers import PEX_SAMPLE, Peers
from neuronode.swarm.membership.reach import Reach
from neuronode.swarm.membership.table import KeyMismatch, TableFull
from neuronode.swarm.statesync.donor import Donor
from neuronode.swarm.wire import MAX_ID_CHARS, Refusal, dict_to_status
from neuronode.v1 import node_pb2 as pb
from neuronode.v1 import node_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


class NodeService(pb_grpc.NodeServicer):
    def __init__(self, ctx: Context, *, admission: Admission, peers: Peers, reach: Reach, donor: Donor,
                 status: Callable[[], dict[str, Any]]) -> None:
        self.ctx = ctx
        self.admission = admission
        self.peers = peers
        self.reach = reach
        self.donor = donor
        self.status = status

    async def Hello(self, request: pb.HelloRequest, context: grpc.aio.ServicerContext) -> pb.HelloResponse:
        ctx, info = self.ctx, request.info
        if ctx.leaving:
            await end_call(context, grpc.StatusCode.UNAVAILABLE, "node is shutting down")
        await self.admission.admit(context, info.node_id)
        if ctx.faults.path and ctx.faults.cut_off(info.advertise):
            await end_call(context, grpc.StatusCode.UNAVAILABLE, "fault injected: caller is cut off")
        await ctx.security.check_ahead(request)  # its signatures, off the event loop
        try:
            self.peers.check_info(info)
            proven = caller_id(context)
            if ctx.security.secret and proven != info.node_id:
                raise Refusal("PERMISSION_DENIED", f"caller {proven!r} may not say hello as "
                              f"{info.node_id[:MAX_ID_CHARS]!r}")
            try:
                ctx.security.check_hello_proof(request.auth_tag, request.timestamp_s, info, request.known_peers)
            except AuthError as exc:
                raise Refusal("UNAUTHENTICATED", f"{exc}; the Hello's content does not match its proof "
                              "(rewritten on the way, or another secret)") from None
            try:
                ctx.security.check_hello_signature(request)
            except AuthError as exc:
                raise Refusal("UNAUTHENTICATED", f"{exc}; every Hello is signed by its node's key") from None
            caller = ctx.table.peers.get(info.node_id)
            # A newcomer (or one back, or one that lists fewer peers than a sample holds: it
            # restarted) gets every peer we know; a member that knows the swarm, a sample.
            known = (caller is not None and ctx.table.is_alive(caller)
                     and len(request.known_peers) >= min(PEX_SAMPLE, len(ctx.table.alive()) - 1))
            if info.node_id != ctx.cfg.node_id:
                self.peers.learn(info, list(request.known_peers), host=caller_host(context), said_at=request.timestamp_s)
                if info.reachable == pb.REACHABILITY_NO:
                    self.peers.relayable(request)  # the other members nobody dials hear it through us
        except KeyMismatch as exc:
            await self.admission.refuse(context, Refusal("PERMISSION_DENIED", str(exc)), "hello")
        except TableFull as exc:
            await self.admission.refuse(context, Refusal("RESOURCE_EXHAUSTED", str(exc)), "hello")
        except Refusal as exc:
            await self.admission.refuse(context, exc, "hello")
        to = info.node_id if known else None
        answer, mark = self.peers.info_for(to)
        resp = pb.HelloResponse(info=answer, known_peers=self.peers.known_peers(full=not known),
                                observed_address=context.peer().split(":", 1)[-1])  # where the caller's connection comes from
        ctx.security.sign_hello(resp)
        ctx.counters.control(sent=resp.ByteSize(), received=request.ByteSize())
        if to is not None:
            self.peers.delivered(to, mark)
        return resp

    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext) -> pb.LeaveResponse:
        ctx = self.ctx
        await self.admission.admit(context, request.node_id)
        if ctx.security.secret and caller_id(context) != request.node_id:
            await end_call(context, grpc.StatusCode.PERMISSION_DENIED, "a node can only announce its own leave")
        peer = ctx.table.peers.get(request.node_id)
        if peer is None or not peer.public_key:
            return pb.LeaveResponse()  # a node we hold no key for: nothing to mark (nobody can prove it left)
        try:
            signed_by(ctx, "Leave", request, peer)
        except Refusal as exc:
            await self.admission.refuse(context, exc, "Leave")
        if request.swarm_id == ctx.cfg.swarm_id and ctx.table.mark_left(request.node_id, said_at=request.timestamp_s):
            ctx.book.notify()
        return pb.LeaveResponse()

    async def FetchState(self, request: pb.StateRequest, context: grpc.aio.ServicerContext) -> None:
        ctx = self.ctx
        await self.admission.admit(context, request.node_id)
        try:
            caller = member_request(ctx, "FetchState", request, caller_id(context), "state is served")
        except Refusal as exc:
            await self.admission.refuse(context, exc, "state request")
            raise  # unreachable: refuse raises

        async def write(msg: pb.StateChunk) -> None:
            ctx.counters.bytes_sent += msg.ByteSize()
            await context.write(msg)

        try:  # its slot is its host's (a voice: neuronode.quorum), never its id's
            await self.donor.serve(caller, write, voice=voice(caller, caller_host(context)), request=request)
        except Refusal as exc:
            await self.admission.refuse(context, exc, "state request")

    async def CheckReachable(self, request: pb.ReachRequest, context: grpc.aio.ServicerContext) -> pb.ReachResponse:
        await self.admission.admit(context, request.node_id)
        try:
            if request.swarm_id != self.ctx.cfg.swarm_id:
                raise Refusal("PERMISSION_DENIED", "another swarm")
            caller = member_request(self.ctx, "CheckReachable", request, caller_id(context),
                                    "reachability checks are answered")
            return await self.reach.dial_back(caller, caller_host(context), request.address)
        except Refusal as exc:
            await self.admission.refuse(context, exc, "reachability check")
            raise  # unreachable: refuse raises

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        await self.admission.admit_local_or_member(context, NODE_SERVICE_PREFIX + "Status")
        return dict_to_status(self.status())
