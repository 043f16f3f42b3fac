"""Who may call a node: protected mode (loopback callers only), bans, and certificates; and how
a refusal is answered (a status code, a message a person can act on, a strike for bad input)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, NoReturn

import grpc

from neuronode.events import fields
from neuronode.quorum import host, is_loopback, peer_ip
from neuronode.security.auth import AuthError
from neuronode.security.tls import peer_common_name
from neuronode.swarm.context import Context
from neuronode.swarm.guard.bans import host_key, node_key
from neuronode.swarm.guard.interceptors import caller_id
from neuronode.swarm.membership.table import Peer
from neuronode.swarm.wire import MAX_ID_CHARS, STATUS_CODES, Refusal

logger = logging.getLogger(__name__)

STRIKE_CODES = ("INVALID_ARGUMENT", "DATA_LOSS", "PERMISSION_DENIED", "UNAUTHENTICATED")


def caller_host(context: grpc.aio.ServicerContext) -> str:
    """The caller's IP from gRPC's peer string ("ipv4:1.2.3.4:5", "ipv6:[::1]:5"): where its
    connection comes from (neuronode.quorum: its host is quorum.host of it)."""
    return peer_ip(context.peer())


def member_request(ctx: Context, method: str, request: Any, proven_id: str, what: str) -> str:
    """The id of the live member a signed request (FetchContribution, FetchState, Session,
    CheckReachable) speaks for, proven by its signature: what its slots are keyed by. Raises
    Refusal for a stranger, a request for another id than the caller proved, one not signed by
    the member's key, or not made for this node, or used already. `what` says what is served
    ("contributions are served", ...)."""
    peer = ctx.table.peers.get(request.node_id)
    if request.swarm_id != ctx.cfg.swarm_id or peer is None or not ctx.table.is_alive(peer):
        raise Refusal("FAILED_PRECONDITION", f"{what} to live members only: say Hello first")
    if ctx.security.secret and proven_id != request.node_id:
        raise Refusal("PERMISSION_DENIED", f"a node calls {method} as itself only")
    return signed_by(ctx, method, request, peer)


def signed_by(ctx: Context, method: str, request: Any, peer: Peer) -> str:
    """`peer`'s id, once its signature on `request` is checked (made for this node, recently, by
    its key) and the request spent (ctx.spent: a second use is refused); raises Refusal."""
    try:
        if not peer.public_key:
            raise AuthError("its key is unknown here")
        key = ctx.security.check_request_signature(method, request, peer.public_key)
    except AuthError as exc:
        raise Refusal("PERMISSION_DENIED", f"{exc}: a {method} request speaks for "
                      f"{request.node_id[:MAX_ID_CHARS]!r}, signed by that node's key only") from None
    ctx.spent.spend(peer.node_id, key, method)
    return peer.node_id


class Admission:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def caller_key(self, context: grpc.aio.ServicerContext) -> str:
        """Who a call's connection proves the caller is, for strikes and bans: the node its TLS
        certificate names, else the host it calls from. Never the id in its metadata: any holder
        of the secret writes any id there, and could get another member banned. On this
        machine's loopback only the owner's processes call (neuronode.quorum): there the id the
        secret proves is used, and an open node blames nobody."""
        name = self.certified_id(context)
        if name:
            return node_key(name)
        ip = caller_host(context)
        if not is_loopback(ip):
            return host_key(host(ip) or ip)  # an IPv6 caller's /64: a new address in it is no escape
        proven = caller_id(context) if self.ctx.security.secret else ""
        return node_key(proven) if proven else ""

    def certified_id(self, context: grpc.aio.ServicerContext) -> str | None:
        """With mutual TLS, the node the caller's certificate names."""
        return peer_common_name(context.auth_context()) if self.ctx.security.tls_files else None

    async def check_certificate(self, context: grpc.aio.ServicerContext, claimed_id: str) -> None:
        """With mutual TLS a caller speaks only as the node its certificate names."""
        name = self.certified_id(context)
        if name is not None and claimed_id != name:
            self.ctx.counters.refused("PERMISSION_DENIED")
            await end_call(context, grpc.StatusCode.PERMISSION_DENIED,
                                f"the caller's certificate is for node {name!r}, not "
                                f"{claimed_id[:MAX_ID_CHARS]!r}; each node speaks only as itself")

    async def admit(self, context: grpc.aio.ServicerContext, node_id: str | None = None) -> None:
        """Admit a caller: loopback only in protected mode, and never a banned one; with
        `node_id` (who the request says it is), under mutual TLS only as its certificate names."""
        if self.ctx.loopback_only and not is_loopback(caller_host(context)):
            await end_call(context, grpc.StatusCode.PERMISSION_DENIED,
                                "this node serves loopback callers only (no --secret-file, TLS or --open)")
        key = self.caller_key(context)
        banned = self.ctx.bans.refusal(key) if key else ""
        if banned:
            await end_call(context, grpc.StatusCode.PERMISSION_DENIED, banned)
        if node_id is not None:
            await self.check_certificate(context, node_id)

    async def admit_local_or_member(self, context: grpc.aio.ServicerContext, method: str) -> None:
        """Status and health: open to local callers (health checks), members only from elsewhere
        in a closed swarm, loopback only in protected mode, never a banned caller."""
        await self.admit(context)
        if self.ctx.security.secret and not is_loopback(caller_host(context)):
            try:
                self.ctx.security.verify_metadata(context.invocation_metadata(), method)
            except AuthError as exc:
                await end_call(context, grpc.StatusCode.UNAUTHENTICATED, str(exc))

    async def refuse(self, context: grpc.aio.ServicerContext, exc: Refusal, what: str) -> None:
        """Answer `exc` (always raises): count it, strike the caller for bad input, log once a minute."""
        message = str(exc)
        if len(message) > 1024:  # never echo a caller's oversized strings back
            message = message[:1000] + "... (truncated)"
        self.ctx.counters.refused(exc.code.lower())
        key = self.caller_key(context)
        if key and exc.code in STRIKE_CODES:
            self.ctx.bans.strike(key)
        host = context.peer().rsplit(":", 1)[0]  # not the ephemeral port: one key per caller host
        self.ctx.say(f"refused:{what}:{host}:{exc.code}", logging.WARNING, "refused %s from %s: %s",
                     what, context.peer(), message, every_s=60.0, extra=fields("refused", what=what, code=exc.code, detail=message))
        await end_call(context, STATUS_CODES[exc.code], message)


async def end_call(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """End a call with `code` and `message` (always raises). A call whose stream ended already
    (its caller cancelled, or went away while a write of ours waited for it to read: a stalled
    fetch we refuse) has nobody left to answer: grpc cannot send the status, and would log the
    failure with a traceback (an ExecuteBatchError, or a UsageError once the call finished). The
    handler then ends as the cancelled call it is, which grpc notes at debug level only."""
    try:
        await context.abort(code, message)
    except grpc.aio.AbortError:
        raise
    except (grpc.aio.InternalError, grpc.aio.UsageError):
        raise asyncio.CancelledError from None
    raise AssertionError("abort returned")  # unreachable: abort raises
