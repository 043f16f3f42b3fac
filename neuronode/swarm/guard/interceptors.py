"""What a node's gRPC server does before any handler runs: the membership proof of every
neuronode call is checked (`AuthInterceptor`, over the proof rules of neuronode.swarm.guard.proofs;
UNAUTHENTICATED otherwise), and a request that is not valid protobuf is answered
INVALID_ARGUMENT with a message (`DecodeGuard`) instead of grpc's UNKNOWN and a traceback.
Handlers read the id a call proved with `caller_id`.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from neuronode.security.auth import AuthError

logger = logging.getLogger(__name__)

AUTH_KEY = "neuronode-auth"
NODE_SERVICE_PREFIX = "/neuronode.v1.Node/"
OPEN_METHODS = {NODE_SERVICE_PREFIX + "Status"}  # loopback callers may skip the proof


def caller_id(context: grpc.aio.ServicerContext) -> str:
    """The node id the interceptor verified for this call ("" when the swarm is open)."""
    value = dict(context.invocation_metadata() or ()).get(AUTH_KEY, "")
    return value.rsplit(":", 2)[0] if isinstance(value, str) and value.count(":") >= 2 else ""


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks the membership proof of every neuronode call before its handler runs."""

    def __init__(self, verify: Callable[[Any, str], str]) -> None:
        self.verify = verify  # the caller's proven id from its metadata, or AuthError (Security.verify_metadata)

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: grpc.HandlerCallDetails,
    ) -> Any:
        method = details.method
        if not method.startswith(NODE_SERVICE_PREFIX) or method in OPEN_METHODS:
            return await continuation(details)
        try:
            self.verify(details.invocation_metadata, method)
        except AuthError as exc:
            return refuse(await continuation(details), str(exc))
        return await continuation(details)


def refuse(handler: Any, message: str) -> Any:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        logger.warning("refused an unauthenticated call from %s: %s", context.peer(), message)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.request_streaming and not handler.response_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **kwargs)
    if handler.response_streaming and not handler.request_streaming:
        async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            logger.warning("refused an unauthenticated call from %s: %s", context.peer(), message)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover - makes this an async generator

        return grpc.unary_stream_rpc_method_handler(deny_stream, **kwargs)
    return grpc.unary_unary_rpc_method_handler(deny, **kwargs)


@dataclass(frozen=True)
class Undecodable:
    """What a request that is not valid protobuf deserializes to (instead of raising inside grpc,
    which answers UNKNOWN and logs a traceback)."""

    error: str


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Answers INVALID_ARGUMENT, with a message, to a neuronode request that is not valid protobuf."""

    def __init__(self) -> None:
        self.logged_at = -1e9

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(NODE_SERVICE_PREFIX):
            return handler
        if handler.request_deserializer is None:
            return handler  # it reads raw bytes and refuses what it cannot parse itself (PushContribution)
        name = details.method.rsplit("/", 1)[-1]
        parse = handler.request_deserializer

        def deserialize(data: bytes) -> Any:
            try:
                return parse(data)
            except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends
                return Undecodable(f"{type(exc).__name__}: {str(exc)[:200]}")

        async def refuse_undecodable(request: Any, context: grpc.aio.ServicerContext) -> None:
            if isinstance(request, Undecodable):
                now = time.monotonic()
                if now - self.logged_at >= 60.0:  # at most once a minute: bad input must not flood the log
                    self.logged_at = now
                    logger.warning("refused an undecodable %s request from %s: %s", name, context.peer(),
                                   request.error)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"{name}: the request is not a valid {name} message ({request.error}); "
                                    "check that both sides run the same neuronode protocol")

        kwargs = {"request_deserializer": deserialize, "response_serializer": handler.response_serializer}
        if handler.response_streaming and not handler.request_streaming:
            inner_us = handler.unary_stream
            if not inspect.isasyncgenfunction(inner_us):  # it writes with context.write (FetchState)
                async def unary_stream_writes(request: Any, context: grpc.aio.ServicerContext) -> None:
                    await refuse_undecodable(request, context)
                    await inner_us(request, context)

                return grpc.unary_stream_rpc_method_handler(unary_stream_writes, **kwargs)

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                await refuse_undecodable(request, context)
                async for response in inner_us(request, context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(unary_stream, **kwargs)
        if not handler.request_streaming and not handler.response_streaming:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await refuse_undecodable(request, context)
                return await inner_uu(request, context)

            return grpc.unary_unary_rpc_method_handler(unary_unary, **kwargs)
        return handler
