"""A node's gRPC endpoints: the server (with the standard health service) and the channels it
dials its peers on, plus the byte and refusal counters every part adds to."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from neuronode.errors import ConfigError
from neuronode.swarm.guard.interceptors import NODE_SERVICE_PREFIX
from neuronode.swarm.guard.proofs import Security
from neuronode.swarm.wire import SERVER_OPTIONS
from neuronode.v1 import node_pb2 as pb
from neuronode.v1 import node_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

NODE_SERVICE = "neuronode.v1.Node"
HEALTH_PREFIX = "/grpc.health.v1.Health/"
# Calls served at once; beyond it grpc answers RESOURCE_EXHAUSTED. A member has at most a few
# open at a time (Hello, one contribution stream per phase and buffered round, a state
# transfer), so this leaves room for about a thousand members (docs/protocol.md).
MAX_CONCURRENT_RPCS = 4096


@dataclass
class Counters:
    """Bytes moved (contribution chunks and state transfers) and refusals, for status and metrics."""

    bytes_sent: int = 0
    bytes_received: int = 0
    per_peer_sent: dict[str, int] = field(default_factory=dict)
    per_peer_received: dict[str, int] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=dict)  # by reason (gRPC status code)
    control_bytes_sent: int = 0  # Hellos (heartbeats, announcements, peer exchange) and their answers
    control_bytes_received: int = 0
    control_messages_sent: int = 0

    def control(self, *, sent: int = 0, received: int = 0) -> None:
        """A Hello (or answer) of `sent` bytes went out, and/or one of `received` bytes came in."""
        self.control_bytes_sent += sent
        self.control_bytes_received += received
        self.control_messages_sent += sent > 0

    def sent(self, peer_id: str, size: int) -> None:
        self.bytes_sent += size
        self.per_peer_sent[peer_id] = self.per_peer_sent.get(peer_id, 0) + size

    def received(self, peer_id: str, size: int) -> None:
        self.bytes_received += size
        self.per_peer_received[peer_id] = self.per_peer_received.get(peer_id, 0) + size

    def refused(self, reason: str) -> None:
        self.refusals[reason] = self.refusals.get(reason, 0) + 1


CONTROL, BULK = "control", "bulk"  # the two lanes to a peer (neuronode.swarm.links)


class Channels:
    """Channels per peer address and lane, opened on first use and kept: the control lane (Hello,
    Leave, dial-backs) has a connection of its own beside the bulk one (contributions, fetches,
    state, sessions), so that control messages never queue behind bulk data."""

    def __init__(self, security: Security) -> None:
        self.security = security
        self._channels: dict[tuple[str, str, str], grpc.aio.Channel] = {}  # (address, lane, name)

    def channel(self, address: str, lane: str = BULK, *, name: str = "") -> grpc.aio.Channel:
        """The channel to `address` on `lane` (`name`: the host name an IP address was resolved
        from, for TLS: neuronode.swarm.links.resolve)."""
        channel = self._channels.get((address, lane, name))
        if channel is None:
            channel = self._channels[(address, lane, name)] = self.security.channel(
                address, own_connection=lane != BULK, name=name)
        return channel

    def addresses(self) -> set[str]:
        """Addresses we hold a channel to."""
        return {address for address, _, _ in self._channels}

    def stub(self, address: str) -> pb_grpc.NodeStub:
        """The generated stub on the control lane (raw clients in tests and tools)."""
        return pb_grpc.NodeStub(self.channel(address, CONTROL))

    def push_call(self, address: str) -> Any:
        """PushContribution taking already serialized ContributionChunk messages."""
        return self.channel(address).stream_unary(
            f"{NODE_SERVICE_PREFIX}PushContribution", request_serializer=None,
            response_deserializer=pb.PushAck.FromString)

    def session_call(self, address: str) -> Any:
        """Session: a long-lived stream of what a reachable member sends a node it cannot dial."""
        return self.channel(address).unary_stream(
            f"{NODE_SERVICE_PREFIX}Session", request_serializer=pb.SessionRequest.SerializeToString,
            response_deserializer=pb.SessionMessage.FromString)

    def pop(self, address: str) -> list[grpc.aio.Channel]:
        """Stop keeping the channels to `address`; the caller closes what comes back."""
        return [self._channels.pop(key) for key in [k for k in self._channels if k[0] == address]]

    async def close_all(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)


Admit = Callable[[grpc.aio.ServicerContext, str], Awaitable[None]]  # aborts a caller it refuses


class AdmittedHealth(health.aio.HealthServicer):
    """The standard health service under the node's admission rules (protected mode, bans,
    membership from outside the host in a closed swarm)."""

    def __init__(self, admit: Admit) -> None:
        super().__init__()
        self.admit = admit

    async def Check(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        await self.admit(context, HEALTH_PREFIX + "Check")
        return await super().Check(request, context)

    async def Watch(self, request: Any, context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        await self.admit(context, HEALTH_PREFIX + "Watch")
        await super().Watch(request, context)


class Server:
    """The grpc.aio server with its handlers and the health service (NOT_SERVING until told)."""

    def __init__(self, security: Security, *, servicer: pb_grpc.NodeServicer,
                 methods: Mapping[str, grpc.RpcMethodHandler], admit: Admit) -> None:
        self.security = security
        self.servicer = servicer
        self.methods = dict(methods)  # override the servicer's (PushContribution reads raw bytes)
        self.health = AdmittedHealth(admit)
        self.server: grpc.aio.Server | None = None

    async def start(self, listen: str) -> int:
        """Bind `listen` and serve; returns the bound port."""
        server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=self.security.interceptors(),
                                 maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS)
        pb_grpc.add_NodeServicer_to_server(self.servicer, server)
        server.add_registered_method_handlers(NODE_SERVICE, self.methods)  # registered last: they win
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        await self.set_serving(False)
        bound = self.security.add_port(server, listen)
        if bound == 0:
            raise ConfigError(f"--listen {listen}: address in use or not local; choose another port")
        await server.start()
        self.server = server
        return bound

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", NODE_SERVICE):
            await self.health.set(service, status)

    async def leaving(self) -> None:
        if self.server is not None:
            await self.health.enter_graceful_shutdown()

    async def stop(self, grace_s: float) -> None:
        if self.server is not None:
            await self.server.stop(grace_s)
