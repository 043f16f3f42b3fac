"""An adversary harness: real nodes (real grpc.aio, valid credentials) whose protocol behaviour a
test scripts, to show that one lying member changes nothing (SECURITY.md, "Lying members").

In process: `claim` makes a SwarmNode's Hellos claim other rounds or digests, `lie_about_reach`
makes it answer every dial-back request with a lie, and `nan_frames` lets a donor stream NaN
(our own donor refuses to encode it; a hostile one need not).

As a process: `Liar` is a `neuronode start` (forked from the warm server, like helpers.Node)
that runs one of BEHAVIOURS and is otherwise an honest member: it trains, contributes and
answers like everyone else.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import torch
from helpers import FORKS, Forked, Node, run_cli

from neuronode.codec import Frame
from neuronode.state import STATE_CHUNK_ELEMENTS, GlobalState, state_digest
from neuronode.v1 import node_pb2 as pb

FAKE_DIGEST = "f" * 64


# ---- in process ------------------------------------------------------------------------------


def claim(node: Any, *, round_offset: int = 0, digests: dict[int, str] | None = None) -> None:
    """From now on `node`'s Hellos claim `round_offset` more completed rounds than it has, and
    add `digests` ({round: param_digest}) to its recent digests."""
    honest = node.peers.node_info

    def lying(*args: Any, **kwargs: Any) -> pb.NodeInfo:
        info = honest(*args, **kwargs)
        info.round += round_offset
        for round_id, digest in sorted((digests or {}).items()):
            info.recent_digests.add(round=round_id, param_digest=digest)
        return info

    node.peers.node_info = lying


def lie_about_reach(node: Any, *, reachable: bool) -> None:
    """`node` answers every CheckReachable with `reachable`, without dialing anyone."""

    async def lying(node_id: str, caller_host: str, address: str = "") -> pb.ReachResponse:
        peer = node.table.peers.get(node_id)
        return pb.ReachResponse(reachable=reachable, address=peer.address if peer else "")

    node.reach.dial_back = lying


def nan_chunk(vector: torch.Tensor, index: int, *, zstd_level: int) -> Frame:
    """statedonor.encode_chunk without the finiteness check: chunk `index` as a raw fp32 frame."""
    step = STATE_CHUNK_ELEMENTS
    raw = vector[index * step:(index + 1) * step].contiguous().numpy().astype("<f4").tobytes()
    return Frame(index=0, count=1, compressed=False, data=raw, raw_len=len(raw))


def published(node: Any, s: GlobalState) -> None:
    """`node` publishes `s` as its state at s.round: what witnesses vouch for (its param_digest
    and chunks_root), as a member holding it does."""
    node.state.adopted(s.round, s.param_digest, state_digest(s)[1], listen=False)


def sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().astype("<f4").tobytes()).hexdigest()


def state(params: torch.Tensor, *, round_id: int = 7, momentum: torch.Tensor | None = None) -> GlobalState:
    """A state whose header digest matches its parameters (a liar's donation is self-consistent)."""
    return GlobalState(round=round_id, param_digest=sha256(params), params=params, momentum=momentum,
                       inner_steps_total=10 * round_id)


# ---- as a process ------------------------------------------------------------------------------


def doctor(snapshot: Callable[[Any], GlobalState], change: Callable[[GlobalState], GlobalState]) -> Callable[[Any], GlobalState]:
    def lying(trainer: Any) -> GlobalState:
        return change(snapshot(trainer))

    return lying


def _doctored(s: GlobalState) -> GlobalState:
    params = s.params + 0.5  # finite, plausible in norm, not the swarm's
    return GlobalState(s.round, sha256(params), params, s.momentum, s.inner_steps_total)


def _nan(s: GlobalState) -> GlobalState:
    params = s.params.clone()
    params[::97] = float("nan")
    return GlobalState(s.round, sha256(params), params, s.momentum, s.inner_steps_total)


def _huge_momentum(s: GlobalState) -> GlobalState:
    return GlobalState(s.round, s.param_digest, s.params, torch.full_like(s.params, 1e30), s.inner_steps_total)


def _momentum_x3(s: GlobalState) -> GlobalState:
    """The swarm's parameters (their digest is the swarm's), momentum three times the swarm's:
    within the 10x bound, and enough to pull a joiner off the swarm at its first outer step."""
    return GlobalState(s.round, s.param_digest, s.params, None if s.momentum is None else 3 * s.momentum,
                       s.inner_steps_total)


AHEAD: dict[str, str] = {}  # an ahead-doctored liar's published round: its doctored parameters' digests


def _ahead(s: GlobalState) -> GlobalState:
    """A state one round ahead of the swarm's, with other parameters (finite, plausible in norm)
    and the swarm's momentum: what an ahead-doctored liar serves, self-consistent with what it
    publishes (`ahead_digests`)."""
    params = s.params + 0.5
    return GlobalState(s.round + 1, sha256(params), params, s.momentum, s.inner_steps_total)


def ahead_digests(digests: Callable[[Any], None]) -> Callable[[Any], None]:
    """Trainer.digests that also keeps the doctored state's digests for the liar's Hellos."""
    def lying(trainer: Any) -> None:
        digests(trainer)
        ahead = _ahead(trainer.global_state())  # what it serves: its chunk list is what it publishes
        AHEAD.update(param=ahead.param_digest, momentum=state_digest(ahead)[1])

    return lying


def claiming_ahead(honest_info: Callable[..., pb.NodeInfo]) -> Callable[..., pb.NodeInfo]:
    """Hellos that claim one round more than the node has, with the doctored state's digests."""
    def lying(self: Any, *args: Any, **kwargs: Any) -> pb.NodeInfo:
        info = honest_info(self, *args, **kwargs)
        if AHEAD:
            info.round += 1
            info.param_digest = AHEAD["param"]
            info.recent_digests.add(round=info.round, param_digest=AHEAD["param"], momentum_digest=AHEAD["momentum"])
        return info

    return lying


def stalling(chunks: Callable[..., AsyncIterator[bytes]]) -> Callable[..., AsyncIterator[bytes]]:
    async def lying(self: Any, peer_id: str, *args: Any) -> AsyncIterator[bytes]:  # (address,) out, wire
        sent, out = 0, args[-2]
        async for data in chunks(self, peer_id, *args):
            sent += 1
            if sent == len(out.frames):
                await asyncio.Event().wait()  # keeps the stream open, never finishes it
            yield data

    return lying


def holding(start: Callable[[Any], Awaitable[str]]) -> Callable[[Any], Awaitable[str]]:
    async def lying(self: Any) -> str:
        address = await start(self)
        self.ctx.tasks.spawn(hold_state_slots(self), "hold-state")
        return address

    return lying


async def hold_state_slots(node: Any) -> None:
    """Keep two FetchState calls open at every live member, reading only their first message;
    open them again whenever a member ends one."""
    from neuronode.v1 import node_pb2_grpc as pb_grpc

    held: dict[str, list[Any]] = {}
    channels: dict[str, Any] = {}
    while True:
        for peer in node.table.alive():
            if peer.address not in channels:  # no BDP probing: the receive window stays 64 KiB, so
                channels[peer.address] = grpc.aio.insecure_channel(  # a donor's writes block at once
                    peer.address, options=[("grpc.http2.bdp_probe", 0)])
            calls = [c for c in held.get(peer.node_id, []) if not c.done()]
            while len(calls) < 2:
                call = pb_grpc.NodeStub(channels[peer.address]).FetchState(
                    node.ctx.security.sign_request(  # a new one each: a signed request is good once
                        "FetchState", pb.StateRequest(node_id=node.cfg.node_id, swarm_id=node.cfg.swarm_id),
                        peer.node_id),
                    metadata=node.ctx.security.metadata("FetchState"))
                calls.append(call)
                try:
                    await call.read()
                except grpc.aio.AioRpcError:
                    break
            held[peer.node_id] = calls
        await asyncio.sleep(0.5)


SLOW_READ_S = 20.0  # a slow-state liar reads one message of each held download this often (under the 30 s stall)


def reading_slowly(start: Callable[[Any], Awaitable[str]]) -> Callable[[Any], Awaitable[str]]:
    async def lying(self: Any) -> str:
        address = await start(self)
        self.ctx.tasks.spawn(read_state_slowly(self), "slow-state")
        return address

    return lying


async def read_state_slowly(node: Any) -> None:
    """Keep a FetchState call open at every live member, reading one message every SLOW_READ_S
    (a chunk every 20 s: never a stall, far under the rate a transfer must keep); open it again
    whenever a member ends one. Each download whose header came is logged (`holding_state`)."""
    import logging

    from neuronode.events import fields
    from neuronode.v1 import node_pb2_grpc as pb_grpc

    log = logging.getLogger("neuronode.adversary")
    channels: dict[str, Any] = {}

    async def hold(peer_id: str, address: str) -> None:
        if address not in channels:  # no BDP probing: the receive window stays 64 KiB
            channels[address] = grpc.aio.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0)])
        call = pb_grpc.NodeStub(channels[address]).FetchState(
            node.ctx.security.sign_request("FetchState", pb.StateRequest(node_id=node.cfg.node_id,
                                                                         swarm_id=node.cfg.swarm_id), peer_id),
            metadata=node.ctx.security.metadata("FetchState"))
        try:
            await call.read()
            log.info("holding %s's state download", peer_id, extra=fields("holding_state", peer_id=peer_id))
            while await call.read() != grpc.aio.EOF:  # noqa: ASYNC110 - the slowness is the attack
                await asyncio.sleep(SLOW_READ_S)
        except grpc.aio.AioRpcError as exc:
            log.info("%s ended our state download: %s", peer_id, exc.code().name,
                     extra=fields("held_state_ended", peer_id=peer_id, code=exc.code().name))
        finally:
            call.cancel()

    holding: dict[str, asyncio.Task[None]] = {}
    while True:
        for peer in node.table.alive():
            task = holding.get(peer.node_id)
            if task is None or task.done():
                holding[peer.node_id] = node.ctx.tasks.spawn(hold(peer.node_id, peer.address), f"slow-{peer.node_id}")
        await asyncio.sleep(0.5)


def impersonating(victim: str, honest_info: Callable[[Any], pb.NodeInfo]) -> Callable[[Any], pb.NodeInfo]:
    def lying(self: Any, *args: Any, **kwargs: Any) -> pb.NodeInfo:
        info = honest_info(self, *args, **kwargs)
        # Once the swarm formed (every member knows every other: a named id is bound to the first
        # key a node sees it with, so speaking first would squat it; SECURITY.md says so).
        if self.ctx.state.round >= 1 and victim in {p.node_id for p in self.ctx.table.alive()}:
            info.node_id = victim  # signed with our own key: we have no other
        return info

    return lying


GHOSTS = 30
HONEST_MEMBERS = 4  # tests/test_adversary_swarm.py runs four


def haunting(start: Callable[[Any], Awaitable[str]]) -> Callable[[Any], Awaitable[str]]:
    async def lying(self: Any) -> str:
        address = await start(self)
        ghosts = [await ghost(f"ghost-{n}") for n in range(GHOSTS)]
        honest_known = self.peers.known_peers

        def known(**kwargs: Any) -> list[pb.PeerRecord]:  # once the swarm formed (on one host, ghosts that
            listed = honest_known(**kwargs)                  # come first would take the honest members' places)
            if len(self.table.alive()) < HONEST_MEMBERS:
                return listed
            return [*listed, *(pb.PeerRecord(node_id=g, address=a) for g, a, _ in ghosts)]

        self.peers.known_peers = known
        self.ghost_servers = ghosts  # kept alive with the node
        return address

    return lying


async def ghost(node_id: str) -> tuple[str, str, Any]:
    """A gRPC server that answers Hello as `node_id` (signed with a key of its own) and refuses
    everything else (UNIMPLEMENTED)."""
    from neuronode.security.identity import NodeKey
    from neuronode.swarm.guard.proofs import Security
    from neuronode.swarm.wire import PROTOCOL_VERSION
    from neuronode.v1 import node_pb2_grpc as pb_grpc

    key, server = NodeKey.generate(), grpc.aio.server()
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"

    class Ghost(pb_grpc.NodeServicer):
        async def Hello(self, request: pb.HelloRequest, context: Any) -> pb.HelloResponse:  # noqa: N802
            response = pb.HelloResponse(info=pb.NodeInfo(
                node_id=node_id, swarm_id=request.info.swarm_id, protocol_version=PROTOCOL_VERSION,
                manifest_hash=request.info.manifest_hash, advertise=address, settings=request.info.settings,
                round=request.info.round))
            Security(node_id=node_id, swarm_id=request.info.swarm_id, key=key).sign_hello(response)
            return response

    pb_grpc.add_NodeServicer_to_server(Ghost(), server)
    await server.start()
    return node_id, address, server


NAMED: list[str] = []  # the addresses a named-ghosts liar lists, set by its test before `apply`


def naming(start: Callable[[Any], Awaitable[str]]) -> Callable[[Any], Awaitable[str]]:
    """Once the swarm formed, list NAMED (names and spellings of this host, each a port of its
    own) and answer Hello on each under a made-up id, with a key of its own: what this node
    says of itself (its round and digests: whatever it lies), so every name is one more voice
    for its lie wherever a name counts as a host."""

    async def lying(self: Any) -> str:
        address = await start(self)
        self.ghost_servers = [await echo(self, f"ghost-{n:02d}", listed) for n, listed in enumerate(NAMED)]
        honest_known = self.peers.known_peers

        def known(**kwargs: Any) -> list[pb.PeerRecord]:
            listed = honest_known(**kwargs)
            if len(self.table.alive()) < HONEST_MEMBERS:
                return listed
            return [*listed, *(pb.PeerRecord(node_id=f"ghost-{n:02d}", address=a) for n, a in enumerate(NAMED))]

        self.peers.known_peers = known
        return address

    return lying


async def echo(node: Any, node_id: str, listed: str) -> Any:
    """A gRPC server on this host's port of `listed` answering Hello as `node_id`, saying what
    `node` says of itself (its receipts aside: they are its own), signed with a key of its own."""
    from neuronode.security.identity import NodeKey
    from neuronode.swarm.guard.proofs import Security
    from neuronode.v1 import node_pb2_grpc as pb_grpc

    key, server = NodeKey.generate(), grpc.aio.server()
    server.add_insecure_port(f"0.0.0.0:{listed.rpartition(':')[2]}")

    class Echo(pb_grpc.NodeServicer):
        async def Hello(self, request: pb.HelloRequest, context: Any) -> pb.HelloResponse:  # noqa: N802
            if request.info.node_id == node.cfg.node_id:  # its own node is not fooled by it
                await context.abort(grpc.StatusCode.UNAVAILABLE, "not for you")
            info = pb.NodeInfo()
            info.CopyFrom(node.peers.node_info())
            for name in ("receipts", "disputed", "echoes", "carried_by"):
                info.ClearField(name)  # type: ignore[arg-type]
            info.node_id, info.advertise = node_id, listed
            response = pb.HelloResponse(info=info)
            Security(node_id=node_id, swarm_id=info.swarm_id, key=key).sign_hello(response)
            return response

    pb_grpc.add_NodeServicer_to_server(Echo(), server)
    await server.start()
    return server


def claiming_own(honest_info: Callable[..., pb.NodeInfo]) -> Callable[..., pb.NodeInfo]:
    """Hellos that claim one round more than the node has with the doctored state's digests
    as the whole of its history: a lineage of its own, not the swarm's (not the seed's)."""
    def lying(self: Any, *args: Any, **kwargs: Any) -> pb.NodeInfo:
        info = honest_info(self, *args, **kwargs)
        if AHEAD:
            info.round += 1
            info.param_digest = AHEAD["param"]
            del info.recent_digests[:]
            info.recent_digests.add(round=info.round, param_digest=AHEAD["param"], momentum_digest=AHEAD["momentum"])
        return info

    return lying


VICTIM = "h1"  # the member a liar tells something else than the rest
SKIPPED = ("h4",)  # the member a half-pushing liar leaves out (three of four hosts hold it: a quorum)


def equivocating(push: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    """Push to VICTIM another contribution than to everyone else (half the weight: within the
    swarm's --max-weight), signed all the same: two statements for one slot."""

    async def lying(self: Any, peer_id: str, *args: Any) -> None:  # (address,) out, box
        *where, out, box = args
        if peer_id == VICTIM and out.phase == 0:
            out = dataclasses.replace(out, weight=out.weight / 2, signature=b"")
            if hasattr(self, "sign"):  # the release under test signs statements itself
                self.sign(out)
        await push(self, peer_id, *where, out, box)

    return lying


def half_pushing(push: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    """Push our contribution to three of the four honest members only."""

    async def lying(self: Any, peer_id: str, *args: Any) -> None:  # (address,) out, box
        if peer_id in SKIPPED and args[-2].phase == 0:
            return
        await push(self, peer_id, *args)

    return lying


def receipt_lying(hello: Callable[..., Awaitable[bool]], honest_info: Callable[[Any], pb.NodeInfo]) -> tuple[Any, Any]:
    """Hellos to VICTIM carry a receipt without the newest receipt's last entry (re-signed: the
    liar's own word, only not the one the others get)."""
    target: dict[int, str] = {}

    def info(self: Any, *args: Any, **kwargs: Any) -> pb.NodeInfo:
        out = honest_info(self, *args, **kwargs)
        victim = self.ctx.table.peers.get(VICTIM)
        if victim is None or target.get(id(self)) != victim.address:
            return out
        if "shards_received" in pb.NodeInfo.DESCRIPTOR.fields_by_name:  # the release before receipts were signed
            if out.shards_received and out.shards_received[-1].shards:
                del out.shards_received[-1].shards[-1]
            return out
        from neuronode.codec.contribution import Phase
        from neuronode.swarm.receipts.wire import receipt_to_pb

        for i, m in enumerate(out.receipts):
            own = self.receipts.own.get((m.round, Phase(m.phase)))
            if own is not None and own.statements:  # whole, whatever form the honest one took
                r = dataclasses.replace(own, statements=own.statements[:-1], listed_digest=b"")
                r = dataclasses.replace(r, signature=self.ctx.security.sign_receipt(r))
                out.receipts[i].CopyFrom(receipt_to_pb(r))
        return out

    async def lying_hello(self: Any, address: str, *args: Any, **kwargs: Any) -> bool:
        target[id(self)] = address  # hello() builds its request first thing, before it awaits
        return await hello(self, address, *args, **kwargs)

    return info, lying_hello


def apply(behaviour: str) -> None:
    """Patch this (forked) process so its node lies as `behaviour` says."""
    from neuronode.node.trainer import Trainer
    from neuronode.swarm.membership.peers import Peers
    from neuronode.swarm.statesync import donor as statedonor

    honest_info = Peers.node_info

    def claiming(round_offset: int, fake: bool) -> Callable[[Peers], pb.NodeInfo]:
        def lying(self: Peers, *args: Any, **kwargs: Any) -> pb.NodeInfo:
            info = honest_info(self, *args, **kwargs)
            info.round += round_offset
            if fake:  # the swarm's history, then a newest round nobody else has
                info.recent_digests.add(round=info.round, param_digest=FAKE_DIGEST)
            return info

        return lying

    if behaviour == "claim-rounds":  # 1000 rounds ahead, in the swarm's own lineage
        Peers.node_info = claiming(1000, fake=True)  # type: ignore[method-assign]
    elif behaviour == "claim-closed":  # "I closed your round already": stand aside and listen to me
        Peers.node_info = claiming(1, fake=False)  # type: ignore[method-assign]
    elif behaviour in ("doctored-state", "nan-state", "huge-momentum", "doctored-momentum"):
        change = {"doctored-state": _doctored, "nan-state": _nan, "huge-momentum": _huge_momentum,
                  "doctored-momentum": _momentum_x3}[behaviour]
        Trainer.snapshot = doctor(Trainer.snapshot, change)  # type: ignore[method-assign]
        statedonor.encode_chunk = nan_chunk  # a hostile donor encodes what it likes
    elif behaviour in ("ahead-doctored", "own-lineage"):  # one round ahead, with a doctored state it serves
        Trainer.digests = ahead_digests(Trainer.digests)  # type: ignore[method-assign]
        Trainer.snapshot = doctor(Trainer.snapshot, _ahead)  # type: ignore[method-assign]
        # ahead-doctored: in the swarm's lineage; own-lineage: a history of its own (while a swarm starts)
        Peers.node_info = (claiming_ahead if behaviour == "ahead-doctored" else claiming_own)(  # type: ignore[method-assign]
            honest_info)
    elif behaviour == "named-ghosts":  # its host under the names and spellings in NAMED, each a voice of its lie
        from neuronode.swarm.node import SwarmNode

        SwarmNode.start = naming(SwarmNode.start)  # type: ignore[method-assign]
    elif behaviour == "stall-streams":  # every contribution stream stops before its last chunk
        from neuronode.swarm.transport import GrpcTransport

        GrpcTransport.chunks = stalling(GrpcTransport.chunks)  # type: ignore[method-assign]
    elif behaviour == "hold-state":  # opens state downloads at every member, never reads them, serves none
        from neuronode.swarm.node import SwarmNode
        from neuronode.swarm.wire import Refusal

        async def serve_none(self: Any, caller: str, write: Any, **resume: Any) -> None:
            raise Refusal("UNAVAILABLE", "busy")

        SwarmNode.start = holding(SwarmNode.start)  # type: ignore[method-assign]
        statedonor.Donor.serve = serve_none  # type: ignore[method-assign]
    elif behaviour == "slow-state":  # reads a state download at every member, a chunk every 20 s; serves none
        from neuronode.swarm.node import SwarmNode
        from neuronode.swarm.wire import Refusal

        async def refuse_all(self: Any, caller: str, write: Any, **resume: Any) -> None:
            raise Refusal("UNAVAILABLE", "busy")

        SwarmNode.start = reading_slowly(SwarmNode.start)  # type: ignore[method-assign]
        statedonor.Donor.serve = refuse_all  # type: ignore[method-assign]
    elif behaviour == "impersonate":  # once it knows h2, says every Hello as h2 (from its own address)
        Peers.node_info = impersonating("h2", honest_info)  # type: ignore[method-assign]
    elif behaviour == "ghosts":  # lists 30 addresses of its host, each answering Hello under a made-up id
        from neuronode.swarm.node import SwarmNode

        SwarmNode.start = haunting(SwarmNode.start)  # type: ignore[method-assign]
    elif behaviour == "equivocate-contributions":  # VICTIM gets a contribution of half the weight
        from neuronode.swarm.transport import GrpcTransport

        GrpcTransport.push = equivocating(GrpcTransport.push)  # type: ignore[method-assign]
    elif behaviour == "half-push":  # its contribution reaches h1, h2 and h3 only
        from neuronode.swarm.transport import GrpcTransport

        GrpcTransport.push = half_pushing(GrpcTransport.push)  # type: ignore[method-assign]
    elif behaviour == "equivocate-receipts":  # VICTIM hears another receipt than the others
        Peers.node_info, Peers.hello = receipt_lying(Peers.hello, honest_info)  # type: ignore[method-assign]
    elif behaviour in ("heavy-flip", "flip"):  # its pseudo-gradient x -10; heavy-flip claims weight 1e14 too
        from neuronode.node.trainer import Trainer

        Trainer.pseudo_gradient = flipping(Trainer.pseudo_gradient)  # type: ignore[method-assign]
        if behaviour == "heavy-flip":
            Trainer.weight = lambda self: HEAVY  # type: ignore[method-assign]
    elif behaviour == "just-in-time":  # its contribution and its receipt land just before each deadline
        from neuronode.averaging.protocol import Averaging
        from neuronode.swarm.transport import GrpcTransport

        GrpcTransport.push = pushing_late(GrpcTransport.push)  # type: ignore[method-assign]
        Averaging.agree = agreeing_late(Averaging.agree)  # type: ignore[method-assign]
    elif behaviour not in ("codec", "outer-lr"):  # those two only run with other flags
        raise ValueError(f"unknown behaviour {behaviour}")


JUST_IN_TIME_S = 1.5  # how long before a deadline a just-in-time member's contribution and receipt land
_began: dict[int, float] = {}  # round -> when a just-in-time member began sending its contribution


def pushing_late(push: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    """Hold each contribution until JUST_IN_TIME_S before the round's deadline (--sync-timeout
    after the member sent it: everyone starts a round together, waiting for the last round)."""

    async def lying(self: Any, peer_id: str, *args: Any) -> None:  # (address,) out, box
        out = args[-2]
        if out.phase == 0:
            began = _began.setdefault(out.round_id, time.monotonic())
            await asyncio.sleep(max(0.0, began + self.ctx.cfg.sync_timeout_s - JUST_IN_TIME_S - time.monotonic()))
        await push(self, peer_id, *args)

    return lying


def agreeing_late(agree: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Publish our receipt of a round only JUST_IN_TIME_S before the others stop waiting for
    it: they begin waiting once our contribution landed, and wait RECEIPT_WAIT_TIMEOUTS x
    --sync-timeout."""
    from neuronode.averaging.protocol import RECEIPT_WAIT_TIMEOUTS

    async def lying(self: Any, round_id: int, phase: Any, *args: Any, publish: bool, **kwargs: Any) -> Any:
        if publish and phase == 0 and round_id in _began:
            landed = _began[round_id] + self.cfg.sync_timeout_s - JUST_IN_TIME_S
            at = landed + RECEIPT_WAIT_TIMEOUTS * self.cfg.sync_timeout_s - JUST_IN_TIME_S
            await asyncio.sleep(max(0.0, at - time.monotonic()))
        return await agree(self, round_id, phase, *args, publish=publish, **kwargs)

    return lying


HEAVY = 1e14  # the weight a heavy-flip liar claims (the old bound was 1e15)
FLIP = -10.0  # what a flipping liar multiplies its pseudo-gradient by


def flipping(pseudo_gradient: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def lying(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        return pseudo_gradient(self, *args, **kwargs) * FLIP

    return lying


def run_liar(argv: list[str], log_path: str, behaviour: str) -> None:
    apply(behaviour)
    run_cli(argv, log_path)


BEHAVIOURS = ("claim-rounds", "claim-closed", "doctored-state", "nan-state", "huge-momentum", "codec", "outer-lr",
              "stall-streams", "hold-state", "impersonate", "ghosts", "equivocate-contributions", "half-push",
              "equivocate-receipts", "heavy-flip", "flip", "just-in-time", "doctored-momentum", "ahead-doctored",
              "slow-state", "own-lineage", "named-ghosts")
FLAGS = {"codec": ("--codec", "int8"), "outer-lr": ("--outer-lr", "0.5")}  # settings the swarm must share


class Liar(Node):
    """A member that lies as `behaviour` says (see BEHAVIOURS); otherwise a helpers.Node."""

    def __init__(self, *args: Any, behaviour: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.behaviour = behaviour
        self.extra += list(FLAGS.get(behaviour, ()))

    def start(self, *more: str) -> Liar:
        from helpers import NODE_DEFAULTS

        args = ["start", "--data-dir", str(self.data_dir), "--listen", self.address, *NODE_DEFAULTS,
                *self.extra, *more]
        process = FORKS.Process(target=run_liar, args=(args, str(self.log_path), self.behaviour),
                                name=f"neuronode-liar-{self.name}")
        process.start()
        self.proc = Forked(process)
        return self
