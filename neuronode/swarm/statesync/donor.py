"""The donor's side of state transfer: FetchState serves our global state, or the share of its
chunks a joiner asks us for (docs/protocol.md, "State transfer").

The state is two flat float32 vectors (parameters, outer momentum) cut into chunks of
STATE_CHUNK_ELEMENTS elements, numbered in stream order (parameters, then momentum); each is
sent as an fp32 frame of the contribution codec (so decompression is bounded the same way). A
stream starts with a header listing every chunk's sha256, the state's root over them
(neuronode.state.state_root) and its `chunks_root` (what the members publish per round, so the
joiner checks each chunk against a list the swarm vouched for); a request naming the
`chunks_root` it downloads gets a header without the list (it holds it) and the chunks it asks
for, in its order.

A snapshot of the state (its copy, its chunk digests, its header) serves every transfer of that
state: a joiner asks for its chunks in several requests, several joiners at once, and each
chunk is encoded when it is sent. A snapshot is kept while a transfer of it runs and LINGER_S
after, at most MAX_SNAPSHOTS idle ones; a request for a state we no longer hold is answered
NOT_FOUND. Transfers take a slot per caller host (neuronode.swarm.statesync.serving: one per host,
MAX_TRANSFERS in all) and keep it only while their reader keeps the pace; we keep training.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

import torch

from neuronode.codec import Frame, encode_frames
from neuronode.events import fields
from neuronode.state import (
    STATE_CHUNK_ELEMENTS,
    GlobalState,
    chunk_digests,
    chunks_root,
    state_root,
)
from neuronode.swarm.guard.proofs import Security
from neuronode.swarm.statesync.serving import Pace, Slots
from neuronode.swarm.wire import STALL_S, Refusal
from neuronode.v1 import node_pb2 as pb

logger = logging.getLogger(__name__)

MAX_TRANSFERS = 4  # state transfers served at once, all callers together
TRANSFERS_PER_HOST = 1  # ... and per caller host (a joiner reads one stream from each donor at a time)
MAX_SNAPSHOTS = 2  # idle snapshots kept (one that transfers still read is never dropped)
LINGER_S = 60.0  # an idle snapshot is kept this long for the joiner's next request
TRANSFER_CHUNK_BYTES = STATE_CHUNK_ELEMENTS * 4
PARTS = (pb.STATE_PART_PARAMS, pb.STATE_PART_MOMENTUM)

StateProvider = Callable[[], GlobalState]


def encode_chunk(vector: torch.Tensor, index: int, *, zstd_level: int) -> Frame:
    """Chunk `index` of one part of the state as an fp32 frame (refuses NaN and Inf)."""
    start = index * STATE_CHUNK_ELEMENTS
    piece = vector[start:start + STATE_CHUNK_ELEMENTS]
    (frame,) = encode_frames(piece, codec="fp32", chunk_bytes=TRANSFER_CHUNK_BYTES, zstd_level=zstd_level)
    return frame


def part_chunks(n_elements: int) -> int:
    return -(-n_elements // STATE_CHUNK_ELEMENTS)


@dataclass
class Snapshot:
    """One state as we serve it: its copy, its full header (every chunk digest) and its roots."""

    state: GlobalState
    header: pb.StateHeader
    users: int = 0  # transfers reading it now
    idle_since: float = 0.0
    callers: set[str] = field(default_factory=set)  # who downloaded chunks of it (states_served counts each once)

    @property
    def chunks_root(self) -> str:
        return self.header.chunks_root

    def same_state(self, other: GlobalState) -> bool:
        """Whether `other` is this snapshot's state (momentum moves only with an outer step,
        which moves the parameters)."""
        s = self.state
        return (s.round, s.param_digest, s.inner_steps_total) == (other.round, other.param_digest, other.inner_steps_total)

    def chunk(self, index: int, *, zstd_level: int) -> pb.StateChunk:
        """Chunk `index` (stream order) as a message (a worker thread: encodes and compresses)."""
        params = part_chunks(self.state.params.numel())
        part, vector, at = ((pb.STATE_PART_PARAMS, self.state.params, index) if index < params
                            else (pb.STATE_PART_MOMENTUM, self.state.momentum, index - params))
        assert vector is not None
        frame = encode_chunk(vector, at, zstd_level=zstd_level)
        return pb.StateChunk(part=part, chunk_index=at, chunk_count=part_chunks(vector.numel()),
                             compressed=frame.compressed, payload=frame.data)


def make_header(state: GlobalState, *, manifest_hash: str, security: Security | None) -> pb.StateHeader:
    """The header of `state` (a worker thread: hashes all of it)."""
    params = chunk_digests(state.params)
    momentum = chunk_digests(state.momentum) if state.momentum is not None else None
    momentum_digest = ""
    if state.momentum is not None:
        momentum_digest = hashlib.sha256(state.momentum.detach().to(torch.float32).contiguous().numpy().data.cast("B")).hexdigest()
    n = state.params.numel()
    header = pb.StateHeader(
        round=state.round, param_digest=state.param_digest, n_elements=n, has_momentum=momentum is not None,
        momentum_digest=momentum_digest, inner_steps_total=state.inner_steps_total,
        chunk_elements=STATE_CHUNK_ELEMENTS, manifest_hash=manifest_hash, chunk_digests=[*params, *(momentum or [])],
        state_digest=state_root(round_id=state.round, inner_steps_total=state.inner_steps_total, n_elements=n,
                                params=params, momentum=momentum),
        chunks_root=chunks_root(params, momentum))
    if security is not None:
        header.auth_tag = security.state_tag(
            round_id=header.round, param_digest=header.param_digest, momentum_digest=momentum_digest,
            n_elements=n, inner_steps_total=header.inner_steps_total, manifest_hash=manifest_hash)
    return header


class Donor:
    """Serves FetchState (module docstring)."""

    def __init__(self, *, provider: StateProvider | None, manifest_hash: str, zstd_level: int,
                 executor: Executor, security: Security | None = None,
                 upload: Callable[[int], Awaitable[None]] | None = None) -> None:
        self.security = security
        self.upload = upload  # our upload cap (--max-upload-mbps): waits for the bytes' turn
        self.provider = provider
        self.manifest_hash = manifest_hash
        self.zstd_level = zstd_level if zstd_level >= 0 else 1  # auto: 1 (state moves rarely)
        self.executor = executor
        self.stall_s = STALL_S
        self.slots = Slots(per_host=TRANSFERS_PER_HOST, total=MAX_TRANSFERS, what="state transfers")
        self.snapshots: list[Snapshot] = []
        self.served = 0

    @property
    def active(self) -> dict[str, int]:
        """Transfers in flight per caller host (voice)."""
        return self.slots.held

    async def serve(self, caller: str, write: Callable[[pb.StateChunk], Awaitable[None]], *,
                    voice: str = "", request: pb.StateRequest | None = None) -> None:
        """Stream what `request` asks of our state to `caller` (who the admission rules say it
        is, calling from `voice`'s host: its slot's key) through `write`; raises Refusal."""
        if self.provider is None:
            raise Refusal("UNAVAILABLE", "this node has no state to give yet")
        request = request or pb.StateRequest()
        with self.slots.take(voice or f"id:{caller}"):
            snapshot = await self.snapshot(request.chunks_root)
            snapshot.users += 1
            try:
                header, wanted = self.plan(snapshot, request)
                await self.stream(snapshot, header, wanted, write)
            finally:
                snapshot.users -= 1
                snapshot.idle_since = asyncio.get_running_loop().time()
            if wanted and caller not in snapshot.callers:  # a download of many requests counts once
                snapshot.callers.add(caller)
                self.served += 1
                logger.info("served the global state of round %d to %s", snapshot.state.round, caller,
                            extra=fields("state_served", peer_id=caller, round_id=snapshot.state.round))

    def plan(self, snapshot: Snapshot, request: pb.StateRequest) -> tuple[pb.StateHeader, list[int]]:
        """The header to send and the chunks (stream order) a request asks for: the ones it
        names; none for `header_only`; else every chunk from `resume_from` when its first
        chunks hash to `resume_digest` (from 0 otherwise)."""
        header = pb.StateHeader()
        header.CopyFrom(snapshot.header)
        count = len(header.chunk_digests)
        if request.chunks_root:
            del header.chunk_digests[:]  # the caller holds the list it vouched for
        if request.header_only:
            return header, []
        if request.chunks:
            if not request.chunks_root:
                raise Refusal("INVALID_ARGUMENT", "a request for chunks names the state they are of (chunks_root)")
            bad = next((i for i in request.chunks if i >= count), None)
            if bad is not None:
                raise Refusal("INVALID_ARGUMENT", f"chunk {bad} asked for: this state has {count} chunks")
            return header, list(request.chunks)
        first = request.resume_from
        if not (0 < first <= count and prefix_digest(list(snapshot.header.chunk_digests[:first])) == request.resume_digest):
            first = 0
        header.first_chunk = first
        return header, list(range(first, count))

    async def snapshot(self, wanted_root: str) -> Snapshot:
        """A snapshot of the state whose chunks_root is `wanted_root` (of what we hold now when
        it is ""): a kept one, or a fresh one; NOT_FOUND when we no longer hold that state."""
        loop = asyncio.get_running_loop()
        self.expire(loop.time())
        for kept in self.snapshots:
            if wanted_root and kept.chunks_root == wanted_root:
                return kept
        provider = self.provider
        assert provider is not None
        state = await loop.run_in_executor(self.executor, provider)
        fresh = next((kept for kept in self.snapshots if kept.same_state(state)), None)
        if fresh is None:
            header = await loop.run_in_executor(self.executor, lambda: make_header(
                state, manifest_hash=self.manifest_hash, security=self.security))
            fresh = Snapshot(state=state, header=header, idle_since=loop.time())
            self.snapshots.append(fresh)
            self.expire(loop.time())
        if wanted_root and fresh.chunks_root != wanted_root:
            raise Refusal("NOT_FOUND", f"this node no longer holds that state (it holds round {state.round} now); "
                          "ask another donor, or start the download again")
        return fresh

    def expire(self, now: float) -> None:
        """Drop idle snapshots older than LINGER_S, and all but the newest MAX_SNAPSHOTS idle ones."""
        idle = [s for s in self.snapshots if not s.users]
        old = [s for s in idle if now - s.idle_since >= LINGER_S] + idle[:max(0, len(idle) - MAX_SNAPSHOTS)]
        self.snapshots = [s for s in self.snapshots if not any(s is o for o in old)]

    async def stream(self, snapshot: Snapshot, header: pb.StateHeader, wanted: list[int],
                     write: Callable[[pb.StateChunk], Awaitable[None]]) -> None:
        """The header, then each chunk of `wanted`, under the pace (neuronode.swarm.statesync.serving)."""
        loop = asyncio.get_running_loop()
        pace = Pace(loop.time, what="state transfer", stall_s=self.stall_s)
        message = pb.StateChunk(header=header)
        for index in [-1, *wanted]:
            if index >= 0:
                message = await loop.run_in_executor(self.executor, functools.partial(
                    snapshot.chunk, index, zstd_level=self.zstd_level))
            size = message.ByteSize()  # state chunks are rare; contributions avoid this
            if self.upload is not None:
                await pace.limited(self.upload(size))
            await pace.write(write(message), size)


def prefix_digest(digests: list[bytes]) -> bytes:
    """What StateRequest.resume_digest says of the chunks a joiner holds."""
    return hashlib.sha256(b"".join(digests)).digest()
