"""Every contribution stream that comes in, pushed, fetched or carried over a session, is read
and checked here (`Inbound.receive`): its header (who sent it, by membership proof, certificate
or signature; whether its round, geometry and reduce-scatter role are ones this node takes),
each chunk as it is decoded off the event loop (neuronode.codec.Assembler.take: order, sizes,
bounded decompression, finite values), and the whole (digest). Chunks are parsed without
protobuf copying their payload (neuronode.swarm.streams.chunks); what a header says by itself
(the fields a stream repeats, the statement it makes, the payload it announces) is read in
neuronode.swarm.streams.headers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

from neuronode.averaging.agreement import Statement, lineage_hash
from neuronode.averaging.book import Abort, RoundRefused
from neuronode.codec import Assembler, Contribution, ContributionDigest, Phase, receiving
from neuronode.quorum import host, is_loopback, voice
from neuronode.security.auth import AuthError
from neuronode.swarm.context import Context
from neuronode.swarm.guard.admission import Admission
from neuronode.swarm.guard.bans import node_key
from neuronode.swarm.guard.interceptors import caller_id
from neuronode.swarm.links.relay import Relay
from neuronode.swarm.membership.hosts import host_claim_refusal, is_canonical_ip
from neuronode.swarm.streams.chunks import ChunkView, parse_chunk
from neuronode.swarm.streams.forward import Forward
from neuronode.swarm.streams.headers import (
    bound_digest,
    check_same_stream,
    check_update,
    header_statement,
    payload_elements,
    stream_key,
)
from neuronode.swarm.wire import MAX_ADDRESS_CHARS, MAX_ID_CHARS, PB_TO_CODEC, Refusal
from neuronode.v1 import node_pb2 as pb


def take(assembler: Assembler, chunk: Any, digest: ContributionDigest) -> None:
    """Decode and store one received chunk (in a worker thread: decompression, checks, hashing)."""
    assembler.take(chunk.chunk_index, chunk.payload, compressed=chunk.compressed, digest=digest)


class Inbound:
    """The inbound path (see the module docstring); a whole contribution pushed to us goes on
    to `relay`, which forwards it to the members nobody can dial that it relays to, and under
    gather to `forward`, which sends it down its maker's tree."""

    def __init__(self, ctx: Context, *, relay: Relay, forward: Forward) -> None:
        self.ctx = ctx
        self.relay = relay
        self.forward = forward

    def method(self, admission: Admission) -> grpc.RpcMethodHandler:
        """PushContribution, reading raw chunk bytes (parsed here, without payload copies)."""

        async def push(request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> pb.PushAck:
            if self.ctx.leaving:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "node is shutting down")
            await admission.admit(context)
            try:
                got = await self.receive(request_iterator, proven_id=caller_id(context),
                                         certified_id=admission.certified_id(context) or "")
            except Refusal as exc:
                await admission.refuse(context, exc, "contribution")
            return pb.PushAck(chunks_received=got.data.count)

        return grpc.stream_unary_rpc_method_handler(push, request_deserializer=None,
                                                    response_serializer=pb.PushAck.SerializeToString)

    async def receive(self, chunks: AsyncIterator[Any], *, proven_id: str = "", certified_id: str = "",
                      fetched: Statement | None = None, carrier: str = "",
                      update: tuple[int, str, str] | None = None) -> Contribution:
        """The one path every contribution stream takes in: pushed to us (`proven_id`,
        `certified_id`: who the caller proved to be), carried over a session we hold
        (`carrier`: the member whose session delivered it, its own or one it relays), or
        fetched from a holder (`fetched`: the statement we asked for; `update`: (round, holder,
        base digest) of the averaged update we asked a holder for). Checks the header, then
        each chunk as it is decoded off the loop, then the whole (digest); files a pushed or
        carried one in the round book, hands a fetched one back unfiled. Raises Refusal."""
        if update is not None:
            fetched = Statement(round_id=update[0], sender=update[1], phase=Phase.UPDATE, shard_index=0,
                                lineage=lineage_hash(update[2], ()), body=b"")
        first: Any = None
        first_key: tuple[Any, ...] = ()
        assembler: Assembler | None = None
        digest = ContributionDigest()
        loop, book = asyncio.get_running_loop(), self.ctx.book
        next_index = 0
        chunk: Any = None
        data: Any = None
        task, aborted = asyncio.current_task(), []

        def abort(reason: str) -> None:  # the book ends a stream whose round closed, or that idles
            aborted.append(reason)
            if task is not None:
                task.cancel()

        stream = chunks.__aiter__()
        try:
            while True:
                try:  # a stream that never sends its first chunk is not yet in the book: bound it here
                    data = await (stream.__anext__() if first is not None
                                  else asyncio.wait_for(stream.__anext__(), timeout=book.idle_s))
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    raise Refusal("DEADLINE_EXCEEDED", f"PushContribution: no chunk for {book.idle_s:.0f} s; "
                                  "send a stream's chunks without pausing") from None
                chunk = parse_chunk(data, next_index)
                header = chunk.header if isinstance(chunk, ChunkView) else chunk
                if first is None:
                    if fetched is None:
                        via = self.forwarder(header, proven_id, carrier)
                        if via:
                            self.check_forwarded(header, via)
                        elif carrier and header.sender_id != carrier:
                            self.check_relayed(header, carrier)
                            via = carrier
                        else:
                            self.check_sender(header, proven_id, certified_id)
                        assembler = self.open_stream(header, abort, via=via)
                    elif update is not None:
                        assembler = self.open_update(header, fetched)
                    else:
                        assembler = self.open_fetched(header, fetched)
                    first, first_key = header, stream_key(header)
                else:
                    check_same_stream(first_key, header)
                assert assembler is not None
                if chunk.chunk_index != next_index:
                    raise Refusal("INVALID_ARGUMENT", f"round {first.round_id}: {first.sender_id} sent chunk "
                                  f"{chunk.chunk_index} where chunk {next_index} was due; chunks go in order, once each")
                next_index += 1
                await loop.run_in_executor(self.ctx.executor, take, assembler, chunk, digest)
                book.touch(first.round_id, first.sender_id, Phase(first.phase))
                if fetched is None and carrier in ("", first.sender_id):
                    self.ctx.table.seen(first.sender_id)  # its own bytes: it is live (a Hello may queue behind them)
                self.ctx.counters.received(chunk.sender_id, chunk.ByteSize())
            if first is None or assembler is None:
                raise Refusal("INVALID_ARGUMENT", "empty contribution stream")
            if not assembler.complete:
                raise Refusal("DATA_LOSS", f"round {first.round_id}: stream from {first.sender_id} ended "
                              f"with {len(assembler.missing())} of {assembler.count} chunks missing; discarded")
            if digest.hexdigest() != first.contribution_digest:
                raise Refusal("DATA_LOSS", f"round {first.round_id}: contribution from {first.sender_id} "
                              "does not match its digest; discarded")
            peer = self.ctx.table.peers.get(first.sender_id)
            got = Contribution(
                round_id=first.round_id, sender_id=first.sender_id, codec=PB_TO_CODEC[first.codec],
                weight=first.weight, data=assembler, n_elements=first.total_elements,
                digest=first.contribution_digest, chunk_elements=first.chunk_elements, shuffled=first.shuffled,
                base_digest=first.base_digest, phase=Phase(first.phase), shard_index=first.shard_index,
                members=tuple(first.members), contributors=tuple(first.contributors), signature=first.signature,
                host=first.sender_host,
                public_key=fetched.public_key if fetched is not None and fetched.public_key
                else peer.public_key if peer else b"")
            if fetched is None:
                book.finish(got)
                if not carrier and got.phase == Phase.WHOLE:
                    self.relay.contribution(got)  # if its maker cannot reach the other members nobody dials
                if self.ctx.cfg.settings.averaging == "gather":
                    self.forward.contribution(got)  # down its maker's tree
            return got
        except RoundRefused as exc:
            raise Refusal(exc.code, str(exc)) from None
        except ValueError as exc:  # CodecError and friends: malformed payloads
            raise Refusal("INVALID_ARGUMENT", str(exc)) from None
        except asyncio.CancelledError:
            if not aborted or task is None:
                raise
            task.uncancel()  # our own abort, not the server's: answer it
            raise Refusal("ABORTED", f"{aborted[0]}; its buffer is freed") from None
        finally:
            if first is not None and fetched is None:
                book.abort(first.round_id, first.sender_id, Phase(first.phase))
            # A refusal's traceback keeps this frame alive until the garbage collector finds the
            # cycle: do not let it keep a partial contribution (megabytes) alive with it.
            assembler = chunk = data = None  # noqa: F841


    def check_sender(self, chunk: Any, proven_id: str, certified_id: str) -> None:
        """The sender is who the caller proved to be, and (in a closed swarm) the tag binds it to
        its round and digest: no forgery, no replay into another round."""
        if certified_id and chunk.sender_id != certified_id:
            raise Refusal("PERMISSION_DENIED", f"the caller's certificate is for node {certified_id!r}, "
                          f"not {chunk.sender_id[:MAX_ID_CHARS]!r}; each node speaks only as itself")
        if banned := self.ctx.bans.refusal(node_key(chunk.sender_id)):
            raise Refusal("PERMISSION_DENIED", banned[:1024])
        security = self.ctx.security
        if not security.secret:
            return
        if chunk.sender_id != proven_id:
            raise Refusal("PERMISSION_DENIED", f"caller {proven_id!r} may not send as {chunk.sender_id[:MAX_ID_CHARS]!r}")
        try:
            security.check_contribution(
                chunk.auth_tag, round_id=chunk.round_id, sender_id=chunk.sender_id,
                contribution_digest=bound_digest(chunk.contribution_digest, chunk.base_digest, chunk.phase,
                                                 chunk.shard_index, chunk.members, chunk.contributors),
                codec=PB_TO_CODEC.get(chunk.codec, "?"), weight=chunk.weight, total_elements=chunk.total_elements)
        except AuthError as exc:
            raise Refusal("PERMISSION_DENIED", f"{exc}: forged or replayed contribution") from None

    def forwarder(self, chunk: Any, proven_id: str, carrier: str) -> str:
        """Under gather, the member forwarding a whole contribution that is not its own (the
        session carrier or the caller), else "". A caller's id proves itself in a closed swarm;
        in an open one it only says whom a stall is charged to."""
        if self.ctx.cfg.settings.averaging != "gather" or chunk.phase != Phase.WHOLE:
            return ""
        deliverer = carrier or proven_id
        return deliverer if deliverer and chunk.sender_id != deliverer else ""

    def check_forwarded(self, chunk: Any, forwarder: str) -> None:
        """A whole contribution `forwarder` passes on down its maker's tree (--averaging gather,
        neuronode.swarm.streams.forward): its maker's signature (open_stream) proves what it says, and
        neither may be banned."""
        for who in (forwarder, chunk.sender_id):
            if banned := self.ctx.bans.refusal(node_key(who)):
                raise Refusal("PERMISSION_DENIED", banned[:1024])

    def check_relayed(self, chunk: Any, carrier: str) -> None:
        """A contribution `carrier` relays over its session (neuronode.swarm.links.relay): its maker
        is a member nobody can dial, and its signature (open_stream) proves what it says."""
        table = self.ctx.table
        for who in (carrier, chunk.sender_id):
            if banned := self.ctx.bans.refusal(node_key(who)):
                raise Refusal("PERMISSION_DENIED", banned[:1024])
        maker = table.peers.get(chunk.sender_id)
        if maker is not None and maker.reachable:
            raise Refusal("INVALID_ARGUMENT", f"{carrier[:MAX_ID_CHARS]} relayed a contribution of "
                          f"{chunk.sender_id[:MAX_ID_CHARS]}, which peers dial themselves; relays carry the "
                          "contributions of members nobody can dial only")

    def open_stream(self, chunk: Any, abort: Abort | None = None, via: str = "") -> Assembler:
        """Check the header of a new stream and open its slot in the round book (reserving its
        whole payload; `abort` stops the stream if its round closes first or it idles; `via`: the
        member relaying it, charged if it stalls)."""
        self.check_swarm(chunk)
        peer = self.ctx.table.peers.get(chunk.sender_id)
        if peer is None or peer.left:  # it may have learned us by peer exchange before its Hello came: it retries
            raise Refusal("UNAVAILABLE", f"unknown sender '{chunk.sender_id[:MAX_ID_CHARS]}': say Hello first "
                          "(its contribution is taken once its Hello arrived)")
        if not self.ctx.table.is_alive(peer):  # transient: its next Hello makes it one (the sender retries)
            raise Refusal("UNAVAILABLE", f"sender '{chunk.sender_id[:MAX_ID_CHARS]}' is not a live member here yet "
                          "(contributions are taken from live members only); its Hello makes it one")
        if self.ctx.faults.path and self.ctx.faults.cut_off(peer.address):
            raise Refusal("UNAVAILABLE", "fault injected: sender is cut off")
        assembler = self.check_header(chunk)
        self.check_signature(header_statement(chunk), peer.public_key)  # what the header says is the sender's word
        self.ctx.book.begin(chunk.round_id, chunk.sender_id, Phase(chunk.phase),
                            reserved_bytes=assembler.size_bytes, abort=abort,
                            lineage=(chunk.base_digest, tuple(chunk.members)), via=via)
        peer.last_seen = self.ctx.clock.now()
        return assembler

    def open_fetched(self, chunk: Any, wanted: Statement) -> Assembler:
        """Check the header of a contribution we fetched: it must be the one `wanted` names
        (whose signature we checked when a receipt listed it), whoever serves it."""
        assembler = self.check_header(chunk)
        got = header_statement(chunk)
        if got != wanted:
            raise Refusal("DATA_LOSS", f"round {wanted.round_id}: the holder served another contribution of "
                          f"{wanted.sender[:MAX_ID_CHARS]} than the one asked for")
        self.check_signature(got, wanted.public_key)
        return assembler

    def open_update(self, chunk: Any, wanted: Statement) -> Assembler:
        """Check the header of an averaged update we asked a holder for (`wanted`: its round, the
        holder, the lineage of the parameters we apply it to): fp32, the whole model, signed by
        the holder. Whether it is the swarm's is for the caller to check (the digests after it)."""
        self.check_swarm(chunk)
        got = header_statement(chunk)
        if (got.round_id, got.sender, got.phase, got.shard_index, got.lineage) != (
                wanted.round_id, wanted.sender, Phase.UPDATE, 0, wanted.lineage):
            raise Refusal("DATA_LOSS", f"round {wanted.round_id}: {wanted.sender[:MAX_ID_CHARS]} served another "
                          "contribution than its averaged update of the round, from the parameters we hold")
        check_update(chunk, self.ctx.cfg.n_elements)
        peer = self.ctx.table.peers.get(wanted.sender)
        self.check_signature(got, peer.public_key if peer is not None else b"")
        return receiving(codec="fp32", n_elems=self.ctx.cfg.n_elements, chunk_elements=chunk.chunk_elements,
                         chunk_count=chunk.chunk_count, shuffled=chunk.shuffled)

    def check_header(self, chunk: Any) -> Assembler:
        """Swarm, codec, size, weight and reduce-scatter role of a stream's header; its Assembler."""
        cfg = self.ctx.cfg
        self.check_swarm(chunk)
        if chunk.codec not in PB_TO_CODEC:
            raise Refusal("INVALID_ARGUMENT", f"unknown codec {chunk.codec}")
        codec = cfg.settings.codec  # the swarm's: it fixes shard geometry, never a chunk's own codec
        if PB_TO_CODEC[chunk.codec] != codec:
            raise Refusal("INVALID_ARGUMENT", f"contribution encoded as {PB_TO_CODEC[chunk.codec]}, but this swarm's "
                          f"--codec is {codec}; every member needs the same --codec")
        if chunk.total_elements != cfg.n_elements:
            raise Refusal("INVALID_ARGUMENT", f"contribution has {chunk.total_elements} elements, the model has "
                          f"{cfg.n_elements}")
        self.check_host(chunk)
        bound = cfg.settings.max_weight * max(1, len(chunk.contributors))  # an averaged shard: its pieces' sum
        if not 0 < chunk.weight <= bound:
            raise Refusal("INVALID_ARGUMENT", f"weight {chunk.weight} must be a positive sample count of at most "
                          f"{bound:g} (this swarm's --max-weight {cfg.settings.max_weight:g} per contributor)")
        spec = cfg.settings.codec_spec  # with the swarm's --sparse-* settings, agreed at Hello
        n_elems = payload_elements(chunk, spec, averaging=cfg.settings.averaging, n_elements=cfg.n_elements,
                                   node_id=cfg.node_id)
        return receiving(codec=spec, n_elems=n_elems,
                         chunk_elements=chunk.chunk_elements, chunk_count=chunk.chunk_count,
                         shuffled=chunk.shuffled)

    def check_host(self, chunk: Any) -> None:
        """The host a contribution names for its maker (`sender_host`: the average weighs a host's
        ids as one member by it, neuronode.averaging.protocol) is an IP as written canonically, and
        is taken by this rule (`host_claim_refusal`) where we saw the maker ourselves at an IP. A
        maker on our loopback runs on this machine; one we know only through a relay, or not at
        all (a fetched contribution), we cannot see: the member that delivered it saw it and
        checked it as we do."""
        claimed = chunk.sender_host
        if claimed and (len(claimed) > MAX_ADDRESS_CHARS or not is_canonical_ip(claimed)):
            raise Refusal("INVALID_ARGUMENT", f"sender_host {claimed[:64]!r} is not an IP address written "
                          "canonically (empty on loopback)")
        table = self.ctx.table
        peer = table.peers.get(chunk.sender_id)
        if peer is None or not peer.seen_directly or not host(peer.host) or is_loopback(peer.host):
            return
        # Every member we saw ourselves, live or not: ids of one host taking turns to be the only
        # live one there would otherwise each name a host of its own.
        others = [p.voice for p in table.peers.values() if p.seen_directly and p.node_id != peer.node_id]
        why = host_claim_refusal(seen=peer.voice, claimed=voice(peer.node_id, claimed), others=others)
        if why:
            raise Refusal("PERMISSION_DENIED", f"round {chunk.round_id}: {peer.node_id} names host "
                          f"{claimed or '(none)'} for its contribution, but this node sees it at {peer.host}, {why}; "
                          "a contribution names the host its maker's peers see it at (observed_address in "
                          "`neuronode status`), and the average weighs the ids of one host as one member")

    def check_swarm(self, chunk: Any) -> None:
        if chunk.swarm_id != self.ctx.cfg.swarm_id:
            raise Refusal("PERMISSION_DENIED", f"contribution for swarm '{chunk.swarm_id[:MAX_ID_CHARS]}', this is "
                          f"'{self.ctx.cfg.swarm_id}'")

    def check_signature(self, statement: Statement, public_key: bytes) -> None:
        """The contribution is signed by the key its sender's id is bound to, whoever delivered it."""
        try:
            self.ctx.security.check_statement(statement, public_key)
        except (AuthError, ValueError, TypeError) as exc:
            raise Refusal("PERMISSION_DENIED", f"{exc}: not signed by {statement.sender[:MAX_ID_CHARS]!r}'s key") from None
