"""State transfer: a donor streams its global state; a joiner downloads and verifies it.

The state is two flat float32 vectors (parameters, outer momentum) plus the round and the
inner-step counter, sent as chunks of 1 MiB of elements (fp32 frames of the contribution codec,
so decompression is bounded the same way): parameters, then momentum. The header lists the
sha256 of every chunk and the state's one digest, a root over them, the round, the inner step
count and the size (neuronode.state.state_root); each chunk is checked against its digest as it
arrives, and at the end the parameters against the donor's `param_digest` (what every node
publishes, and the swarm vouches for).

Any size, over any link: the joiner keeps every chunk it verified, so a download that is cut,
or that stalls (no chunk for STALL_S, or slower than MIN_RATE_BYTES_PER_S for that long),
goes on from the next donor (or the same one, again) where it stopped: the donor starts at
`resume_from` when its first chunks hash as the joiner's do. There is no deadline for a
transfer that moves; progress (bytes, rate, time left) is logged every PROGRESS_S and shown in
status. Donors serve at most `MAX_CONCURRENT` transfers, one per caller, each ended when its
reader stops reading for STALL_S or it outlasts max(MIN_TRANSFER_S, bytes at
MIN_RATE_BYTES_PER_S), and keep training.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass

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
from neuronode.state import (
    STATE_CHUNK_ELEMENTS,
    GlobalState,
    chunk_digests,
    momentum_root,
    state_root,
)
from neuronode.swarm.context import Context
from neuronode.swarm.links import Links, NoRoute
from neuronode.swarm.security import Security
from neuronode.swarm.trust import witnesses
from neuronode.swarm.wire import MIN_RATE_BYTES_PER_S, STALL_S, Refusal
from neuronode.v1 import node_pb2 as pb

logger = logging.getLogger(__name__)

MAX_CONCURRENT = 2
# A donor a round ahead of what the other members announced so far (they finished it a moment
# later) has too few hosts to vouch for it yet: we wait until more of them publish that round,
# at most this many heartbeats (2 s at least), and ask again, up to WITNESS_RETRIES times.
WITNESS_WAIT_HEARTBEATS = 4
WITNESS_RETRIES = 2
MIN_TRANSFER_S = 120.0  # a donor lets every transfer take this long, and longer at MIN_RATE_BYTES_PER_S
PROGRESS_S = 5.0  # a download in progress is logged this often
TRANSFER_CHUNK_BYTES = STATE_CHUNK_ELEMENTS * 4
FP32 = get_codec("fp32")
PARTS = (pb.STATE_PART_PARAMS, pb.STATE_PART_MOMENTUM)


StateProvider = Callable[[], GlobalState]
Verify = Callable[[GlobalState], str | None]  # the node's own checks on a state: a reason to refuse it


def part_frames(vector: torch.Tensor, *, zstd_level: int) -> tuple[list[Frame], str]:
    digest = ContributionDigest(sha256=True)
    frames = list(encode_frames(vector, codec="fp32", chunk_bytes=TRANSFER_CHUNK_BYTES,
                                zstd_level=zstd_level, digest=digest))
    return frames, digest.hexdigest()


def state_frames(state: GlobalState, *, manifest_hash: str, zstd_level: int,
                 security: Security | None = None) -> list[pb.StateChunk]:
    """Encode a state into the messages of one FetchState stream, its header first (runs in a
    worker thread; holds the encoded state, about 2 x P x 4 bytes, while it streams)."""
    params, _ = part_frames(state.params, zstd_level=zstd_level)
    momentum: list[Frame] = []
    momentum_digest = ""
    if state.momentum is not None:
        momentum, momentum_digest = part_frames(state.momentum, zstd_level=zstd_level)
    param_digests = chunk_digests(state.params)
    momentum_digests = chunk_digests(state.momentum) if state.momentum is not None else None
    header = pb.StateHeader(
        round=state.round, param_digest=state.param_digest, n_elements=state.params.numel(),
        has_momentum=state.momentum is not None, momentum_digest=momentum_digest,
        inner_steps_total=state.inner_steps_total, chunk_elements=STATE_CHUNK_ELEMENTS, manifest_hash=manifest_hash,
        chunk_digests=[*param_digests, *(momentum_digests or [])],
        state_digest=state_root(round_id=state.round, inner_steps_total=state.inner_steps_total,
                                n_elements=state.params.numel(), params=param_digests, momentum=momentum_digests))
    if security is not None:
        header.auth_tag = security.state_tag(
            round_id=header.round, param_digest=header.param_digest, momentum_digest=momentum_digest,
            n_elements=header.n_elements, inner_steps_total=header.inner_steps_total,
            manifest_hash=manifest_hash)
    out = [pb.StateChunk(header=header)]
    for part, frames in zip(PARTS, (params, momentum), strict=True):
        out.extend(pb.StateChunk(part=part, chunk_index=f.index, chunk_count=f.count,
                                 compressed=f.compressed, payload=f.data) for f in frames)
    return out


def header_momentum(header: pb.StateHeader) -> str:
    """The momentum_digest a donor's header vouches for (its momentum chunks' digests, which
    the header's state_digest binds and each chunk is checked against): what its witnesses must
    have published for the round beside the param_digest."""
    params = -(-header.n_elements // STATE_CHUNK_ELEMENTS)
    return momentum_root(list(header.chunk_digests[params:]) if header.has_momentum else None)


def prefix_digest(digests: list[bytes]) -> bytes:
    """What StateRequest.resume_digest says of the chunks a joiner holds."""
    return hashlib.sha256(b"".join(digests)).digest()


class StateReceiver:
    """Checks and assembles a state stream, chunk by chunk in stream order (each against its
    digest in the header); keeps what it verified across streams (`resume`)."""

    def __init__(self, header: pb.StateHeader, *, n_elements: int, manifest_hash: str) -> None:
        self.n_elements, self.manifest_hash = n_elements, manifest_hash
        self.parts = {pb.STATE_PART_PARAMS: Assembler(n_elems=n_elements, codec="fp32", chunk_bytes=TRANSFER_CHUNK_BYTES)}
        if header.has_momentum:
            self.parts[pb.STATE_PART_MOMENTUM] = Assembler(n_elems=n_elements, codec="fp32",
                                                           chunk_bytes=TRANSFER_CHUNK_BYTES)
        self.order = [(part, i) for part, a in self.parts.items() for i in range(a.count)]
        self.have = 0  # chunks verified, in stream order
        self.verified_bytes = 0
        self.header = self.check(header)

    @property
    def total_bytes(self) -> int:
        return sum(a.size_bytes for a in self.parts.values())

    def check(self, header: pb.StateHeader) -> pb.StateHeader:
        if header.n_elements != self.n_elements or header.manifest_hash != self.manifest_hash:
            raise Refusal("FAILED_PRECONDITION", "donor holds another model (manifest differs)")
        if header.chunk_elements != STATE_CHUNK_ELEMENTS:
            raise Refusal("INVALID_ARGUMENT", f"unexpected chunk_elements {header.chunk_elements}")
        if header.has_momentum != (pb.STATE_PART_MOMENTUM in self.parts) or len(header.chunk_digests) != len(self.order):
            raise Refusal("INVALID_ARGUMENT", f"the header lists {len(header.chunk_digests)} chunk digests; "
                          f"this state has {len(self.order)} chunks")
        count = self.parts[pb.STATE_PART_PARAMS].count
        digests = list(header.chunk_digests)
        root = state_root(round_id=header.round, inner_steps_total=header.inner_steps_total,
                          n_elements=header.n_elements, params=digests[:count],
                          momentum=digests[count:] if header.has_momentum else None)
        if root != header.state_digest:
            raise Refusal("DATA_LOSS", "the state's chunk digests do not hash to its state_digest")
        return header

    def resume(self, header: pb.StateHeader) -> None:
        """Go on with a new stream (another donor, or the same again) from the chunks we hold:
        it must start where we stopped and agree with every chunk we verified."""
        header = self.check(header)
        if header.first_chunk != self.have or list(header.chunk_digests[:self.have]) != list(self.header.chunk_digests[:self.have]):
            raise Refusal("INVALID_ARGUMENT", f"state stream resumes at chunk {header.first_chunk}, "
                          f"but we hold {self.have} other ones")
        self.header = header

    def add(self, msg: pb.StateChunk) -> int:
        """Decompress (bounded), check order and digest, store one chunk; its bytes (a worker thread)."""
        if self.have >= len(self.order) or (msg.part, msg.chunk_index) != self.order[self.have] \
                or msg.chunk_count != self.parts[msg.part].count:
            raise Refusal("INVALID_ARGUMENT", f"unexpected state chunk {msg.part}/{msg.chunk_index}")
        assembler = self.parts[msg.part]
        raw = decode_frame(msg.payload, msg.compressed, expected_raw_len=assembler.expected_raw_len(msg.chunk_index))
        if hashlib.sha256(raw).digest() != self.header.chunk_digests[self.have]:
            raise Refusal("DATA_LOSS", f"state chunk {self.have} does not match its digest")
        assembler.add(msg.chunk_index, raw)
        self.have += 1
        self.verified_bytes += len(raw)
        return len(raw)

    def finish(self) -> GlobalState:
        if self.have < len(self.order):
            raise Refusal("DATA_LOSS", "state stream ended early")
        if self.part_digest(pb.STATE_PART_PARAMS) != self.header.param_digest:
            raise Refusal("DATA_LOSS", "state parameters do not match the donor's param_digest")
        momentum = None
        if self.header.has_momentum:
            if self.part_digest(pb.STATE_PART_MOMENTUM) != self.header.momentum_digest:
                raise Refusal("DATA_LOSS", "state momentum does not match its digest")
            momentum = self.parts[pb.STATE_PART_MOMENTUM].decode()
        return GlobalState(round=self.header.round, param_digest=self.header.param_digest,
                           params=self.parts[pb.STATE_PART_PARAMS].decode(), momentum=momentum,
                           inner_steps_total=self.header.inner_steps_total)

    def part_digest(self, part: pb.StatePart) -> str:
        assembler, h = self.parts[part], hashlib.sha256()
        for i in range(assembler.count):
            h.update(assembler.raw(i))
        return h.hexdigest()


class Stalled(Exception):
    """A state stream that stopped moving (or crawls); the download moves to the next donor."""


@dataclass
class TransferProgress:
    """A state download in progress (status and the console line)."""

    donor: str = ""
    verified_bytes: int = 0
    total_bytes: int = 0
    bytes_per_s: float = 0.0
    eta_s: float = 0.0

    def fields(self) -> dict[str, float | int]:
        return {"state_download_bytes": self.verified_bytes, "state_download_total_bytes": self.total_bytes,
                "state_download_bytes_per_s": round(self.bytes_per_s, 1), "state_download_eta_s": round(self.eta_s, 1)}


class Download:
    """One state download across donors and attempts: the chunks verified so far, and the
    rate they came at (the stall rule and progress)."""

    def __init__(self, *, n_elements: int, manifest_hash: str, executor: Executor,
                 on_progress: Callable[[TransferProgress], None]) -> None:
        self.n_elements, self.manifest_hash, self.executor = n_elements, manifest_hash, executor
        self.on_progress = on_progress
        self.receiver: StateReceiver | None = None
        self.received_bytes = 0  # payload bytes read off the wire (every attempt)

    @property
    def have(self) -> int:
        return self.receiver.have if self.receiver is not None else 0

    def request(self, node_id: str, swarm_id: str) -> pb.StateRequest:
        held = list(self.receiver.header.chunk_digests[:self.have]) if self.receiver is not None else []
        return pb.StateRequest(node_id=node_id, swarm_id=swarm_id, resume_from=len(held),
                               resume_digest=prefix_digest(held) if held else b"")

    async def read(self, stream: AsyncIterator[pb.StateChunk], donor: str, *, security: Security | None,
                   accept: Callable[[pb.StateHeader], str | None]) -> GlobalState:
        """Read one FetchState stream into our chunks; the verified state once complete. Raises
        Refusal, AuthError, Stalled or grpc.aio.AioRpcError; what was verified stays."""
        loop, messages = asyncio.get_running_loop(), stream.__aiter__()
        window: list[tuple[float, int]] = [(time.monotonic(), 0)]  # (when, bytes verified this stream)
        said, moved = time.monotonic(), 0
        while True:
            try:
                msg = await asyncio.wait_for(messages.__anext__(), timeout=STALL_S)
            except StopAsyncIteration:
                break
            except TimeoutError:
                raise Stalled(f"no state chunk for {STALL_S:.0f} s") from None
            self.received_bytes += len(msg.payload)
            if msg.HasField("header"):
                self.start(msg.header, security=security, accept=accept)
                continue
            if self.receiver is None:
                raise Refusal("INVALID_ARGUMENT", "state stream must start with its header")
            try:
                moved += await loop.run_in_executor(self.executor, self.receiver.add, msg)
            except ValueError as exc:
                raise Refusal("INVALID_ARGUMENT", str(exc)) from None
            now = time.monotonic()
            window.append((now, moved))
            while len(window) > 2 and now - window[1][0] >= STALL_S:
                window.pop(0)
            rate = (moved - window[0][1]) / max(now - window[0][0], 1e-6)
            if now - window[0][0] >= STALL_S and rate < MIN_RATE_BYTES_PER_S:
                raise Stalled(f"{rate / 1024:.0f} KiB/s over {STALL_S:.0f} s, below {MIN_RATE_BYTES_PER_S >> 10} KiB/s")
            if now - said >= PROGRESS_S:
                said = now
                self.report(donor, rate)
        if self.receiver is None:
            raise Refusal("DATA_LOSS", "empty state stream")
        try:  # decoding refuses NaN and Inf: a donor's data never reaches our parameters unchecked
            return await loop.run_in_executor(self.executor, self.receiver.finish)
        except ValueError as exc:
            raise Refusal("INVALID_ARGUMENT", f"state values: {exc}") from None

    def start(self, header: pb.StateHeader, *, security: Security | None,
              accept: Callable[[pb.StateHeader], str | None]) -> None:
        """A stream's header: checked (membership proof, the swarm's word, geometry) before
        anything else is read; we go on from the chunks we hold, or start over."""
        if security is not None:
            security.check_state(header.auth_tag, round_id=header.round, param_digest=header.param_digest,
                                 momentum_digest=header.momentum_digest, n_elements=header.n_elements,
                                 inner_steps_total=header.inner_steps_total, manifest_hash=header.manifest_hash)
        refused = accept(header)
        if refused:
            raise Refusal("FAILED_PRECONDITION", refused)
        if header.first_chunk == 0:  # from the start (a donor whose state differs from the chunks we hold)
            self.receiver = StateReceiver(header, n_elements=self.n_elements, manifest_hash=self.manifest_hash)
        elif self.receiver is not None:
            self.receiver.resume(header)
        else:
            raise Refusal("INVALID_ARGUMENT", f"state stream starts at chunk {header.first_chunk}; we hold none")

    def report(self, donor: str, rate: float) -> None:
        r = self.receiver
        assert r is not None
        left = r.total_bytes - r.verified_bytes
        progress = TransferProgress(donor=donor, verified_bytes=r.verified_bytes, total_bytes=r.total_bytes,
                            bytes_per_s=rate, eta_s=left / rate if rate > 0 else 0.0)
        logger.info("state from %s: %.1f of %.1f MB, %.2f MB/s, %.0f s left", donor, r.verified_bytes / 1e6,
                    r.total_bytes / 1e6, rate / 1e6, progress.eta_s,
                    extra=fields("state_progress", peer_id=donor, bytes=r.verified_bytes, total_bytes=r.total_bytes,
                                 bytes_per_s=round(rate), eta_s=round(progress.eta_s, 1)))
        self.on_progress(progress)


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

    async def serve(self, caller: str, write: Callable[[pb.StateChunk], Awaitable[None]], *,
                    resume_from: int = 0, resume_digest: bytes = b"") -> None:
        """Stream our state to `caller` (who the admission rules say it is) through `write`,
        from chunk `resume_from` when its first chunks hash to `resume_digest` (else from 0)."""
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
            header, *body = await loop.run_in_executor(
                self.executor,
                lambda: state_frames(provider(), manifest_hash=self.manifest_hash, zstd_level=self.zstd_level,
                                     security=self.security))
            digests = list(header.header.chunk_digests)
            if 0 < resume_from <= len(digests) and prefix_digest(digests[:resume_from]) == resume_digest:
                header.header.first_chunk, body = resume_from, body[resume_from:]
            await self.stream([header, *body], write)
            self.served += 1
        finally:
            self.active.pop(caller, None)

    async def stream(self, messages: list[pb.StateChunk], write: Callable[[pb.StateChunk], Awaitable[None]]) -> None:
        loop = asyncio.get_running_loop()
        limit_s = max(MIN_TRANSFER_S, sum(len(m.payload) for m in messages) / MIN_RATE_BYTES_PER_S)
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


class StateFetch:
    """The joiner's side: download the global state from the first donors that deliver a copy
    the swarm vouches for (neuronode.swarm.trust.witnesses) and that passes our own checks,
    going on from one donor to the next with the chunks verified so far."""

    def __init__(self, ctx: Context, *, links: Links, on_progress: Callable[[TransferProgress], None] = lambda p: None) -> None:
        self.ctx = ctx
        self.links = links
        self.on_progress = on_progress
        self.progress = TransferProgress()
        self.transfers = 0
        self.unwitnessed: dict[int, str] = {}  # round -> a donor refused because nobody had published it yet

    def show(self, progress: TransferProgress) -> None:
        self.progress = progress
        self.on_progress(progress)

    async def fetch(self, donors: list[str], *, verify: Verify = lambda _: None) -> GlobalState | None:
        ctx = self.ctx
        download = Download(n_elements=ctx.cfg.n_elements, manifest_hash=ctx.cfg.manifest_hash,
                            executor=ctx.executor, on_progress=self.show)
        retries, started = 0, time.monotonic()
        try:
            while True:
                self.unwitnessed, held = {}, download.have
                state = await self.one_pass(donors, verify, download)
                if state is not None:
                    took = time.monotonic() - started
                    logger.info("downloaded the state (%.1f MB) in %.1f s", download.received_bytes / 1e6, took,
                                extra=fields("state_downloaded", bytes=download.received_bytes, seconds=round(took, 1)))
                    return state
                if download.have > held:
                    continue  # cut or stalled part way: on from what we verified
                if not self.unwitnessed or retries == WITNESS_RETRIES:
                    return None
                retries += 1
                await self.witnessed(dict(self.unwitnessed))
        finally:
            self.show(TransferProgress())

    async def witnessed(self, wanted: dict[int, str]) -> None:
        """Wait until more live hosts than now, the donor's aside, published a digest for a
        round in `wanted` (round -> donor), at most WITNESS_WAIT_HEARTBEATS heartbeats."""
        ctx = self.ctx
        deadline = ctx.clock.now() + max(2.0, WITNESS_WAIT_HEARTBEATS * ctx.cfg.heartbeat_s)
        logger.info("too few other hosts have published round %s yet; asking the donors again once more did",
                    ", ".join(map(str, sorted(wanted))), extra=fields("state_unwitnessed", rounds=sorted(wanted)))

        def published() -> int:
            return sum(witnesses(round_id, "", donor, ctx.table.alive()).published for round_id, donor in wanted.items())

        before = published()
        while (left := deadline - ctx.clock.now()) > 0:
            changed = ctx.book.changed()
            if published() > before:
                return
            await ctx.clock.wait(changed, left)

    async def one_pass(self, donors: list[str], verify: Verify, download: Download) -> GlobalState | None:
        ctx = self.ctx
        for donor_id in donors:
            peer = ctx.table.peers.get(donor_id)
            if peer is None or not ctx.table.is_alive(peer):
                continue
            try:
                state = await self.fetch_from(donor_id, donors, download)
                refused = await asyncio.get_running_loop().run_in_executor(ctx.executor, verify, state)
                if refused:
                    raise Refusal("FAILED_PRECONDITION", refused)
            except (grpc.aio.AioRpcError, Stalled) as exc:
                code = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else "STALLED"
                why = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                logger.warning("state transfer from %s failed (%s: %s) with %d chunks verified; going on from "
                               "another donor", donor_id, code, why, download.have,
                               extra=fields("donor_failed", peer_id=donor_id, code=code, chunks=download.have))
                continue
            except NoRoute as exc:
                logger.info("not asking %s for the state: %s", donor_id, exc)
                continue
            except (Refusal, AuthError) as exc:
                download.receiver = None  # what it sent counts for nothing
                logger.warning("state from %s refused: %s; trying another donor", donor_id, exc,
                               extra=fields("donor_rejected", peer_id=donor_id, reason=str(exc)[:200]))
                continue
            except Exception as exc:  # noqa: BLE001 - whatever a donor's data does, it never kills the node
                download.receiver = None
                logger.error("state from %s could not be used (%r); trying another donor", donor_id, exc,
                             extra=fields("donor_rejected", peer_id=donor_id, reason=repr(exc)[:200]))
                continue
            self.transfers += 1
            return state
        return None

    async def fetch_from(self, donor_id: str, lineage: list[str], download: Download) -> GlobalState:
        ctx = self.ctx
        request = ctx.security.sign_request("FetchState", download.request(ctx.cfg.node_id, ctx.cfg.swarm_id),
                                           donor_id)
        call = await self.links.fetch(donor_id, "FetchState", request)
        try:
            received = download.received_bytes
            try:
                return await download.read(call, donor_id, security=ctx.security, accept=lambda header: self.vouched(
                    header.round, header.param_digest, donor_id, lineage, header_momentum(header)))
            finally:
                ctx.counters.bytes_received += download.received_bytes - received
        finally:
            call.cancel()

    def vouched(self, round_id: int, param_digest: str, donor_id: str, lineage: list[str],
                momentum_digest: str = "") -> str | None:
        """Why a donor's (round, param_digest, momentum_digest) is not the swarm's, or None when
        it is: other live hosts published it, whatever lineage they are in (a host still at
        round 0 vouches for nothing), a quorum of those that published the round and more than
        published another in `lineage` (the donor's, the one the vote chose: the other side of a
        healed partition objects to nothing) (neuronode.swarm.trust.witnesses); or no other host
        is alive (a swarm of two). A donor's own word is never enough when anyone else can
        speak: with nobody to vouch, we keep our own lineage."""
        seen = witnesses(round_id, param_digest, donor_id, self.ctx.table.alive(), momentum_digest, lineage=lineage)
        if seen.accepted and seen.others == 0:
            logger.warning("only %s can vouch for its state of round %d (no other host is alive): adopting it on its "
                           "word; a swarm of two has no second witness", donor_id, round_id,
                           extra=fields("unvouched_state", peer_id=donor_id, round_id=round_id))
        if seen.accepted:
            return None
        if seen.pending:
            self.unwitnessed[round_id] = donor_id  # the others may not have announced it yet
        return (f"its round-{round_id} state (parameters {param_digest[:12]}, momentum {momentum_digest[:12] or 'none'}) "
                f"is what {seen.agreeing} of the {seen.others} other live hosts published ({seen.disagreeing} "
                f"published another, {seen.others - seen.published} none yet)")
