"""State transfer: a donor streams its global state; a joiner downloads and verifies it.

The state is two flat float32 vectors (parameters, outer momentum) plus the round and the
inner-step counter. Vectors go as fp32 frames of the contribution codec, so decompression is
bounded the same way; the parameters are checked at the end against the donor's
`param_digest` (sha256 of their float32 bytes, exactly what every node publishes), the momentum
against its own digest. Donors serve at most `MAX_CONCURRENT` transfers, one per caller, each
under a deadline, and keep training.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor

import grpc
import torch

from neuronode.codec import (
    Assembler,
    ContributionDigest,
    Frame,
    decode_frame,
    encode_frames,
    get_codec,
)
from neuronode.events import fields
from neuronode.security.auth import AuthError
from neuronode.state import GlobalState
from neuronode.swarm.context import Context
from neuronode.swarm.links import Links, NoRoute
from neuronode.swarm.security import Security
from neuronode.swarm.trust import witnesses
from neuronode.swarm.wire import Refusal
from neuronode.v1 import node_pb2 as pb

logger = logging.getLogger(__name__)

MAX_CONCURRENT = 2
# A donor a round ahead of what the other members announced so far (they finished it a moment
# later) has nobody to vouch for it yet: we wait until one of them publishes that round, at
# most this many heartbeats (2 s at least), and ask again, up to WITNESS_RETRIES times.
WITNESS_WAIT_HEARTBEATS = 4
WITNESS_RETRIES = 2
STALL_S = 30.0  # a FetchState reader that reads nothing this long loses its slot
MIN_TRANSFER_S = 120.0  # every transfer may take this long, and longer at MIN_TRANSFER_BYTES_PER_S
MIN_TRANSFER_BYTES_PER_S = 128 * 1024
TRANSFER_CHUNK_BYTES = 1 << 20
FP32 = get_codec("fp32")


StateProvider = Callable[[], GlobalState]


def part_frames(vector: torch.Tensor, *, zstd_level: int) -> tuple[list[Frame], str]:
    digest = ContributionDigest(sha256=True)
    frames = list(encode_frames(vector, codec="fp32", chunk_bytes=TRANSFER_CHUNK_BYTES,
                                zstd_level=zstd_level, digest=digest))
    return frames, digest.hexdigest()


def state_frames(state: GlobalState, *, manifest_hash: str, zstd_level: int,
                 security: Security | None = None) -> list[pb.StateChunk]:
    """Encode a state into the messages of one FetchState stream (runs in a worker thread).

    Holds the encoded state (about 2 x P x 4 bytes) while it streams; a later version may
    encode lazily chunk by chunk."""
    params, _ = part_frames(state.params, zstd_level=zstd_level)
    momentum: list[Frame] = []
    momentum_digest = ""
    if state.momentum is not None:
        momentum, momentum_digest = part_frames(state.momentum, zstd_level=zstd_level)
    header = pb.StateHeader(
        round=state.round, param_digest=state.param_digest, n_elements=state.params.numel(),
        has_momentum=state.momentum is not None, momentum_digest=momentum_digest,
        inner_steps_total=state.inner_steps_total,
        chunk_elements=TRANSFER_CHUNK_BYTES // FP32.payload_bytes(1), manifest_hash=manifest_hash,
    )
    if security is not None:
        header.auth_tag = security.state_tag(
            round_id=header.round, param_digest=header.param_digest, momentum_digest=momentum_digest,
            n_elements=header.n_elements, inner_steps_total=header.inner_steps_total,
            manifest_hash=manifest_hash)
    out = [pb.StateChunk(header=header)]
    for part, frames in ((pb.STATE_PART_PARAMS, params), (pb.STATE_PART_MOMENTUM, momentum)):
        out.extend(pb.StateChunk(part=part, chunk_index=f.index, chunk_count=f.count,
                                 compressed=f.compressed, payload=f.data) for f in frames)
    return out


class StateReceiver:
    """Checks and assembles one FetchState stream; `finish()` returns the verified state."""

    def __init__(self, header: pb.StateHeader, *, n_elements: int, manifest_hash: str) -> None:
        if header.n_elements != n_elements or header.manifest_hash != manifest_hash:
            raise Refusal("FAILED_PRECONDITION", "donor holds another model (manifest differs)")
        if header.chunk_elements != TRANSFER_CHUNK_BYTES // FP32.payload_bytes(1):
            raise Refusal("INVALID_ARGUMENT", f"unexpected chunk_elements {header.chunk_elements}")
        self.header = header
        self.parts = {pb.STATE_PART_PARAMS: Assembler(n_elems=n_elements, codec="fp32",
                                                      chunk_bytes=TRANSFER_CHUNK_BYTES)}
        if header.has_momentum:
            self.parts[pb.STATE_PART_MOMENTUM] = Assembler(n_elems=n_elements, codec="fp32",
                                                           chunk_bytes=TRANSFER_CHUNK_BYTES)
        self.digests = {part: ContributionDigest(sha256=True) for part in self.parts}
        self.next_index = {part: 0 for part in self.parts}

    def add(self, msg: pb.StateChunk) -> None:
        """Decompress (bounded), check order and store one chunk; runs in a worker thread."""
        assembler = self.parts.get(msg.part)
        if assembler is None or msg.chunk_count != assembler.count or msg.chunk_index != self.next_index[msg.part]:
            raise Refusal("INVALID_ARGUMENT", f"unexpected state chunk {msg.part}/{msg.chunk_index}")
        raw = decode_frame(msg.payload, msg.compressed, expected_raw_len=assembler.expected_raw_len(msg.chunk_index))
        self.digests[msg.part].update(raw)
        assembler.add(msg.chunk_index, raw)
        self.next_index[msg.part] += 1

    def finish(self) -> GlobalState:
        if not all(a.complete for a in self.parts.values()):
            raise Refusal("DATA_LOSS", "state stream ended early")
        if self.digests[pb.STATE_PART_PARAMS].hexdigest() != self.header.param_digest:
            raise Refusal("DATA_LOSS", "state parameters do not match the donor's param_digest")
        momentum = None
        if self.header.has_momentum:
            if self.digests[pb.STATE_PART_MOMENTUM].hexdigest() != self.header.momentum_digest:
                raise Refusal("DATA_LOSS", "state momentum does not match its digest")
            momentum = self.parts[pb.STATE_PART_MOMENTUM].decode()
        return GlobalState(round=self.header.round, param_digest=self.header.param_digest,
                           params=self.parts[pb.STATE_PART_PARAMS].decode(), momentum=momentum,
                           inner_steps_total=self.header.inner_steps_total)


async def download(
    stream: AsyncIterator[pb.StateChunk], *, n_elements: int, manifest_hash: str, executor: Executor,
    security: Security | None = None, accept: Callable[[pb.StateHeader], str | None] = lambda _: None,
) -> GlobalState:
    """Read a FetchState stream into a verified GlobalState (raises Refusal or AioRpcError).
    `accept` judges the header before anything else is read: a reason to refuse it, or None."""
    loop = asyncio.get_running_loop()
    receiver: StateReceiver | None = None
    async for msg in stream:
        if receiver is None:
            if not msg.HasField("header"):
                raise Refusal("INVALID_ARGUMENT", "state stream must start with its header")
            if security is not None:
                h = msg.header
                security.check_state(h.auth_tag, round_id=h.round, param_digest=h.param_digest,
                                     momentum_digest=h.momentum_digest, n_elements=h.n_elements,
                                     inner_steps_total=h.inner_steps_total, manifest_hash=h.manifest_hash)
            refused = accept(msg.header)
            if refused:
                raise Refusal("FAILED_PRECONDITION", refused)
            receiver = StateReceiver(msg.header, n_elements=n_elements, manifest_hash=manifest_hash)
            continue
        try:
            await loop.run_in_executor(executor, receiver.add, msg)
        except ValueError as exc:
            raise Refusal("INVALID_ARGUMENT", str(exc)) from None
    if receiver is None:
        raise Refusal("DATA_LOSS", "empty state stream")
    try:  # decoding refuses NaN and Inf: a donor's data never reaches our parameters unchecked
        return await loop.run_in_executor(executor, receiver.finish)
    except ValueError as exc:
        raise Refusal("INVALID_ARGUMENT", f"state values: {exc}") from None


class Donor:
    """Serves FetchState: at most MAX_CONCURRENT transfers, one per caller, each ended when its
    reader stops reading for `stall_s` or it outlasts its deadline (a slot is never held by a
    caller that does not read)."""

    def __init__(self, *, provider: StateProvider | None, manifest_hash: str, zstd_level: int,
                 executor: Executor, security: Security | None = None) -> None:
        self.security = security
        self.provider = provider
        self.manifest_hash = manifest_hash
        self.zstd_level = zstd_level if zstd_level >= 0 else 1  # auto: 1 (state moves rarely)
        self.executor = executor
        self.stall_s = STALL_S
        self.active: dict[str, int] = {}  # caller -> transfers in flight
        self.served = 0

    async def serve(self, caller: str, write: Callable[[pb.StateChunk], Awaitable[None]]) -> None:
        """Stream our state to `caller` (who the admission rules say it is) through `write`."""
        if self.provider is None:
            raise Refusal("UNAVAILABLE", "this node has no state to give yet")
        if self.active.get(caller):
            raise Refusal("RESOURCE_EXHAUSTED", "a state transfer to you is already in flight here; "
                          "finish or cancel it first")
        if sum(self.active.values()) >= MAX_CONCURRENT:
            raise Refusal("RESOURCE_EXHAUSTED",
                          f"already serving {sum(self.active.values())} state transfers; try another peer")
        self.active[caller] = 1
        try:
            loop = asyncio.get_running_loop()
            provider = self.provider
            messages = await loop.run_in_executor(
                self.executor,
                lambda: state_frames(provider(), manifest_hash=self.manifest_hash, zstd_level=self.zstd_level,
                                     security=self.security))
            total = sum(len(m.payload) for m in messages)
            limit_s = max(MIN_TRANSFER_S, total / MIN_TRANSFER_BYTES_PER_S)
            deadline = loop.time() + limit_s
            for msg in messages:
                remaining = deadline - loop.time()
                try:
                    await asyncio.wait_for(write(msg), timeout=max(0.0, min(self.stall_s, remaining)))
                except TimeoutError:
                    why = (f"nothing was read for {self.stall_s:.0f} s" if remaining > self.stall_s
                           else f"it took longer than {limit_s:.0f} s")
                    raise Refusal("DEADLINE_EXCEEDED", f"state transfer ended: {why}; the slot is freed, "
                                  "ask again when you can read it") from None
            self.served += 1
        finally:
            self.active.pop(caller, None)


Verify = Callable[[GlobalState], str | None]  # the node's own checks on a state: a reason to refuse it


class StateFetch:
    """The joiner's side: download the global state from the first donor that delivers a copy
    the swarm vouches for (neuronode.swarm.trust.witnesses) and that passes our own checks."""

    def __init__(self, ctx: Context, *, links: Links) -> None:
        self.ctx = ctx
        self.links = links
        self.transfers = 0
        self.unwitnessed: dict[int, str] = {}  # round -> a donor refused because nobody had published it yet

    async def fetch(self, donors: list[str], *, verify: Verify = lambda _: None) -> GlobalState | None:
        for attempt in range(1 + WITNESS_RETRIES):
            self.unwitnessed = {}
            state = await self.one_pass(donors, verify)
            if state is not None or not self.unwitnessed or attempt == WITNESS_RETRIES:
                return state
            await self.witnessed(dict(self.unwitnessed), donors)
        return None

    async def witnessed(self, wanted: dict[int, str], lineage: list[str]) -> None:
        """Wait until a member of `lineage` other than the donor published a digest for a round
        in `wanted` (round -> donor), at most WITNESS_WAIT_HEARTBEATS heartbeats."""
        ctx = self.ctx
        deadline = ctx.clock.now() + max(2.0, WITNESS_WAIT_HEARTBEATS * ctx.cfg.heartbeat_s)
        logger.info("no other member has published round %s yet; asking the donors again once one did",
                    ", ".join(map(str, sorted(wanted))), extra=fields("state_unwitnessed", rounds=sorted(wanted)))
        while (left := deadline - ctx.clock.now()) > 0:
            changed = ctx.book.changed()
            if any(round_id in p.digests for p in ctx.table.alive() if p.node_id in lineage
                   for round_id, donor in wanted.items() if p.node_id != donor):
                return
            await ctx.clock.wait(changed, left)

    async def one_pass(self, donors: list[str], verify: Verify) -> GlobalState | None:
        ctx = self.ctx
        for donor_id in donors:
            peer = ctx.table.peers.get(donor_id)
            if peer is None or not ctx.table.is_alive(peer):
                continue
            try:
                state = await self.fetch_from(donor_id, donors)
                refused = await asyncio.get_running_loop().run_in_executor(ctx.executor, verify, state)
                if refused:
                    raise Refusal("FAILED_PRECONDITION", refused)
            except grpc.aio.AioRpcError as exc:
                logger.warning("state transfer from %s failed (%s: %s); trying another donor",
                               donor_id, exc.code().name, exc.details(),
                               extra=fields("donor_failed", peer_id=donor_id, code=exc.code().name))
                continue
            except NoRoute as exc:
                logger.info("not asking %s for the state: %s", donor_id, exc)
                continue
            except (Refusal, AuthError) as exc:
                logger.warning("state from %s refused: %s; trying another donor", donor_id, exc,
                               extra=fields("donor_rejected", peer_id=donor_id, reason=str(exc)[:200]))
                continue
            except Exception as exc:  # noqa: BLE001 - whatever a donor's data does, it never kills the node
                logger.error("state from %s could not be used (%r); trying another donor", donor_id, exc,
                             extra=fields("donor_rejected", peer_id=donor_id, reason=repr(exc)[:200]))
                continue
            self.transfers += 1
            return state
        return None

    async def fetch_from(self, donor_id: str, lineage: list[str]) -> GlobalState:
        ctx = self.ctx
        call = await self.links.fetch(donor_id, "FetchState", ctx.security.sign_request(
            "FetchState", pb.StateRequest(node_id=ctx.cfg.node_id, swarm_id=ctx.cfg.swarm_id)),
            timeout_s=max(60.0, ctx.cfg.sync_timeout_s))
        state = await download(call, n_elements=ctx.cfg.n_elements, manifest_hash=ctx.cfg.manifest_hash,
                               executor=ctx.executor, security=ctx.security,
                               accept=lambda header: self.vouched(header.round, header.param_digest, donor_id,
                                                                   lineage))
        ctx.counters.bytes_received += state.params.numel() * 4 * (2 if state.momentum is not None else 1)
        return state

    def vouched(self, round_id: int, param_digest: str, donor_id: str, lineage: list[str]) -> str | None:
        """Why a donor's (round, param_digest) is not the swarm's, or None when it is: the other
        members of its lineage (`lineage`, the donors) published it (a quorum, more than
        published another), or none but the donor is alive. A donor's own word is never enough
        when anyone else can speak."""
        members = [p for p in self.ctx.table.alive() if p.node_id in lineage]
        seen = witnesses(round_id, param_digest, donor_id, members)
        if seen.accepted:
            return None
        if not seen.agree and not seen.disagree and seen.others:
            self.unwitnessed[round_id] = donor_id  # the others may not have announced it yet
        if seen.others == 0:
            logger.warning("only %s can vouch for its state of round %d (no other member of its lineage is alive): "
                           "adopting it on its word; a lineage of one has no second witness", donor_id, round_id,
                           extra=fields("unvouched_state", peer_id=donor_id, round_id=round_id))
            return None
        return (f"its round-{round_id} parameters hash to {param_digest[:12]}, which {len(seen.agree)} of "
                f"{seen.others} other members of its lineage published ({len(seen.disagree)} published another digest)")
