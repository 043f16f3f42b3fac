"""One state download from many donors at once (the joiner's side of FetchState, below the
choice of what to download: neuronode.swarm.statesync.statesync).

Once a header is vouched for (its chunk list is what the swarm published: statesync), its
chunks are fetched in parallel from every donor that holds that state, each asked for a share
in requests of at most MAX_BATCH chunks, the next share once it delivered the last: a fast donor
serves more, a slow one less, and every donor's upload cap (--max-upload-mbps, its own) holds.
Every chunk is checked on arrival against the vouched list. A donor is dropped at its first bad
chunk (for the rest of the download: `donor_rejected`) or its first late one (no chunk within
CHUNK_LATE_S, a chunk's time at the swarm's minimum rate and a little more; or no header within
STALL_S: for this pass, `donor_failed`), and what it was asked for goes to the others. When
nothing is left to ask for, an idle donor also asks for chunks still in flight elsewhere (at
most two donors per chunk), so the slowest one does not set the end. Chunks verified stay
across passes and donors: a download cut part way never fetches them again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import grpc

from neuronode.events import fields
from neuronode.security.auth import AuthError
from neuronode.state import GlobalState
from neuronode.swarm.guard.proofs import Security
from neuronode.swarm.links import NoRoute
from neuronode.swarm.statesync.assembly import StateReceiver, header_chunks_root
from neuronode.swarm.statesync.donor import TRANSFER_CHUNK_BYTES
from neuronode.swarm.wire import MIN_RATE_BYTES_PER_S, STALL_S, Refusal
from neuronode.v1 import node_pb2 as pb

logger = logging.getLogger(__name__)

MAX_BATCH = 8  # chunks (8 MiB) per request: a share small enough to move on from a slow donor
CHUNK_LATE_S = TRANSFER_CHUNK_BYTES / MIN_RATE_BYTES_PER_S + 2.0  # a chunk later than this drops its donor
PROGRESS_S = 5.0  # a download in progress is logged this often
ENDGAME_COPIES = 2  # donors asked for one chunk at once, at most (only once nothing else is left)

Accept = Callable[[pb.StateHeader], str | None]  # why a header is not the swarm's, or None
Open = Callable[[str, pb.StateRequest], Awaitable[Any]]  # (donor, request) -> a FetchState call


class Late(Exception):
    """A donor that sent nothing in time: dropped for this pass."""


@dataclass
class TransferProgress:
    """A state download in progress (status and the console line)."""

    donor: str = ""  # the donors streaming now, comma-separated
    verified_bytes: int = 0
    total_bytes: int = 0
    bytes_per_s: float = 0.0
    eta_s: float = 0.0
    donors: int = 0  # how many

    def fields(self) -> dict[str, float | int]:
        return {"state_download_bytes": self.verified_bytes, "state_download_total_bytes": self.total_bytes,
                "state_download_bytes_per_s": round(self.bytes_per_s, 1), "state_download_eta_s": round(self.eta_s, 1),
                "state_download_donors": self.donors}


async def read(messages: AsyncIterator[pb.StateChunk], timeout_s: float, what: str) -> pb.StateChunk | None:
    """The next message of a stream (None at its end); Late when none comes within `timeout_s`."""
    try:
        return await asyncio.wait_for(messages.__anext__(), timeout=timeout_s)
    except StopAsyncIteration:
        return None
    except TimeoutError:
        raise Late(f"no {what} within {timeout_s:.0f} s") from None


class Download:
    """One state download across passes and donors: the state it assembles (`receiver`, once a
    header was vouched for), the donors whose data was refused, and the counts status and the
    `state_downloaded` event show."""

    def __init__(self, *, n_elements: int, manifest_hash: str, executor: Executor,
                 on_progress: Callable[[TransferProgress], None], security: Security | None = None) -> None:
        self.n_elements, self.manifest_hash, self.executor = n_elements, manifest_hash, executor
        self.on_progress, self.security = on_progress, security
        self.receiver: StateReceiver | None = None
        self.rejected: set[str] = set()  # donors whose data was refused: never asked again in this download
        self.refused_roots: set[str] = set()  # vouched states our own checks refused
        self.received_bytes = 0  # payload bytes read off the wire (every request)
        self.by_donor: Counter[str] = Counter()  # chunks verified, per donor
        self.most_at_once = 0  # the most donors that delivered chunks at the same time
        self.streaming: set[str] = set()
        self.window: deque[tuple[float, int]] = deque()  # (when, verified bytes): the rate
        self.said = time.monotonic()

    @property
    def have(self) -> int:
        return len(self.receiver.held) if self.receiver is not None else 0

    def check_header(self, header: pb.StateHeader) -> None:
        """The membership proof on a header (closed swarms); raises AuthError."""
        if self.security is not None:
            self.security.check_state(header.auth_tag, round_id=header.round, param_digest=header.param_digest,
                                      momentum_digest=header.momentum_digest, n_elements=header.n_elements,
                                      inner_steps_total=header.inner_steps_total, manifest_hash=header.manifest_hash)

    def start(self, header: pb.StateHeader, accept: Accept) -> None:
        """A donor's full header: checked (membership proof, geometry, the swarm's word) before
        anything else; the state we download from now on, keeping the chunks we verified that
        it lists at the same place. Raises Refusal or AuthError."""
        self.check_header(header)
        refused = accept(header)
        if refused:
            raise Refusal("FAILED_PRECONDITION", refused)
        if header_chunks_root(header) in self.refused_roots:
            raise Refusal("FAILED_PRECONDITION", "its state is one our own checks refused already")
        if self.receiver is None:
            self.receiver = StateReceiver(header, n_elements=self.n_elements, manifest_hash=self.manifest_hash)
        elif header != self.receiver.header:
            self.receiver = self.receiver.retarget(header)

    async def probe(self, call: Any, accept: Accept) -> None:
        """Read a header-only stream: its header (start), then its end, so that the donor's
        slot is free before we ask it for chunks."""
        messages = call.__aiter__()
        header = await read(messages, STALL_S, "header")
        if header is None or not header.HasField("header"):
            raise Refusal("INVALID_ARGUMENT", "a state stream starts with its header")
        self.received_bytes += header.ByteSize()
        self.start(header.header, accept)
        await read(messages, STALL_S, "end of the stream")

    async def fetch(self, donors: list[str], open_call: Open, *, node_id: str, swarm_id: str) -> GlobalState | None:
        """One pass: every chunk we lack, from `donors` at once; the verified state once whole
        (None when the donors ran out first: what was verified stays). Raises Refusal when the
        state assembled fails its final checks (the caller refuses that state)."""
        assert self.receiver is not None
        fetching = Pass(self, donors, open_call, node_id=node_id, swarm_id=swarm_id)
        await fetching.run()
        if not self.receiver.complete:
            return None
        try:  # decoding refuses NaN and Inf: a donor's data never reaches our parameters unchecked
            return await asyncio.get_running_loop().run_in_executor(self.executor, self.receiver.finish)
        except ValueError as exc:
            raise Refusal("INVALID_ARGUMENT", f"state values: {exc}") from None

    def refuse_state(self) -> None:
        """Our own checks refused the state assembled: start over, never from that state again."""
        if self.receiver is not None:
            self.refused_roots.add(self.receiver.chunks_root)
        self.receiver = None

    def verified(self, donor: str, nbytes: int) -> None:
        """A chunk from `donor` was verified: counts, the rate, progress every PROGRESS_S."""
        self.by_donor[donor] += 1
        now = time.monotonic()
        self.window.append((now, self.receiver.verified_bytes if self.receiver else 0))
        while len(self.window) > 2 and now - self.window[1][0] >= STALL_S:
            self.window.popleft()
        if now - self.said >= PROGRESS_S:
            self.said = now
            self.report()

    def report(self) -> None:
        r = self.receiver
        if r is None:
            return
        (since, then), (now, moved) = self.window[0], self.window[-1]
        rate = (moved - then) / (now - since) if now > since else 0.0
        left = r.total_bytes - r.verified_bytes
        progress = TransferProgress(donor=", ".join(sorted(self.streaming)), verified_bytes=r.verified_bytes,
                                    total_bytes=r.total_bytes, bytes_per_s=rate, eta_s=left / rate if rate > 0 else 0.0,
                                    donors=len(self.streaming))
        logger.info("state from %s: %.1f of %.1f MB, %.2f MB/s, %.0f s left", progress.donor or "nobody now",
                    r.verified_bytes / 1e6, r.total_bytes / 1e6, rate / 1e6, progress.eta_s,
                    extra=fields("state_progress", peer_id=progress.donor, bytes=r.verified_bytes,
                                 total_bytes=r.total_bytes, bytes_per_s=round(rate), eta_s=round(progress.eta_s, 1),
                                 donors=len(self.streaming)))
        self.on_progress(progress)


class Pass:
    """Fetching what a download lacks from several donors at once (module docstring): the
    chunks nobody was asked for yet (`todo`), and who was asked for which."""

    def __init__(self, download: Download, donors: list[str], open_call: Open, *, node_id: str, swarm_id: str) -> None:
        assert download.receiver is not None
        self.download, self.receiver, self.open_call = download, download.receiver, open_call
        self.request = pb.StateRequest(node_id=node_id, swarm_id=swarm_id, chunks_root=download.receiver.chunks_root)
        self.donors = [d for d in donors if d not in download.rejected]
        self.todo: deque[int] = deque(self.receiver.missing())
        self.asked: dict[int, set[str]] = {}  # chunk -> donors asked for it now
        self.working = set(self.donors)
        self.at: dict[str, int] = {}  # donor -> the chunk we wait for from it
        self.changed = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            self.tasks = [group.create_task(self.worker(d), name=f"state-from-{d}") for d in self.donors]

    def finished(self) -> None:
        """Every chunk is here: stop asking (the streams still open are cancelled)."""
        for task in self.tasks:
            if task is not asyncio.current_task():
                task.cancel()

    def take(self, donor: str) -> list[int]:
        """The next share for `donor`: its part of what nobody was asked for yet, else chunks
        in flight at others only (the end game)."""
        size = max(1, min(MAX_BATCH, len(self.todo) // max(1, len(self.working))))
        batch = [self.todo.popleft() for _ in range(min(size, len(self.todo)))]
        if not batch:
            batch = [i for i, who in sorted(self.asked.items()) if donor not in who and len(who) < ENDGAME_COPIES
                     and i not in self.receiver.held][:MAX_BATCH]
        for i in batch:
            self.asked.setdefault(i, set()).add(donor)
        return batch

    def give_back(self, donor: str, batch: list[int]) -> None:
        """`donor` is done with `batch`: what is neither here nor asked of another goes back."""
        for i in reversed(batch):
            who = self.asked.get(i, set())
            who.discard(donor)
            if not who:
                self.asked.pop(i, None)
                if i not in self.receiver.held:
                    self.todo.appendleft(i)
        self.pulse()

    def pulse(self) -> None:
        """Wake the donors waiting for something to ask for."""
        self.changed.set()
        self.changed = asyncio.Event()

    async def worker(self, donor: str) -> None:
        try:
            while not self.receiver.complete:
                batch = self.take(donor)
                if not batch:
                    if not self.asked:
                        return  # nothing left to ask for, nobody fetching
                    await self.changed.wait()
                    continue
                try:
                    await self.batch(donor, batch)
                except Refusal as exc:
                    (self.failed if exc.code == "FAILED_PRECONDITION" else self.refused)(donor, exc)
                    return
                except (grpc.aio.AioRpcError, NoRoute, Late) as exc:
                    self.failed(donor, exc)
                    return
                except AuthError as exc:
                    self.refused(donor, exc)
                    return
                finally:
                    self.give_back(donor, batch)
                    self.download.streaming.discard(donor)
        finally:
            self.working.discard(donor)
            self.pulse()

    async def batch(self, donor: str, batch: list[int]) -> None:
        """Ask `donor` for `batch` and check each chunk as it arrives; then read the stream's
        end (the donor's slot is free again before we ask for the next)."""
        download, receiver = self.download, self.receiver
        request = pb.StateRequest()
        request.CopyFrom(self.request)
        request.chunks.extend(batch)
        call = await self.open_call(donor, request)
        try:
            messages = call.__aiter__()
            first = await read(messages, STALL_S, "header")
            if first is None or not first.HasField("header"):
                raise Refusal("INVALID_ARGUMENT", "a state stream starts with its header")
            self.at[donor] = batch[0]
            download.check_header(first.header)
            receiver.serves_us(first.header)
            for index in batch:
                self.at[donor] = index
                msg = await read(messages, CHUNK_LATE_S, f"chunk {index}")
                if msg is None:
                    raise Refusal("DATA_LOSS", f"the stream ended before chunk {index}")
                download.received_bytes += len(msg.payload)
                if msg.HasField("header") or receiver.index_of(msg) != index:
                    raise Refusal("INVALID_ARGUMENT", f"chunk {index} was asked for, not this one")
                if index in receiver.held:
                    continue  # another donor delivered it first (the end game)
                raw = await asyncio.get_running_loop().run_in_executor(download.executor, receiver.verify, index, msg)
                if index not in receiver.held:
                    receiver.store(index, raw)
                    download.streaming.add(donor)
                    download.most_at_once = max(download.most_at_once, len(download.streaming))
                    download.verified(donor, len(raw))
                if receiver.complete:
                    self.finished()
                    return
            await read(messages, STALL_S, "end of the stream")
        finally:
            call.cancel()

    def failed(self, donor: str, exc: Exception) -> None:
        """`donor` could not serve (cut, gone, no slot, another state, late): dropped for this pass."""
        if isinstance(exc, grpc.aio.AioRpcError):
            code, why = exc.code().name, exc.details() or ""
        else:
            code = exc.code if isinstance(exc, Refusal) else "LATE" if isinstance(exc, Late) else "NO_ROUTE"
            why = str(exc)
        chunk = self.at.get(donor, -1)
        logger.warning("state transfer from %s failed at chunk %d (%s: %s) with %d of %d chunks verified; "
                       "going on from the other donors", donor, chunk, code, why, len(self.receiver.held),
                       len(self.receiver.order), extra=fields("donor_failed", peer_id=donor, code=code, chunk=chunk,
                                                              chunks=len(self.receiver.held), reason=why[:200]))

    def refused(self, donor: str, exc: Exception) -> None:
        """`donor` sent what does not check out (a bad chunk, a bad header): never asked again
        in this download."""
        self.download.rejected.add(donor)
        chunk = self.at.get(donor, -1)
        logger.warning("state from %s refused at chunk %d: %s; going on from the other donors", donor, chunk, exc,
                       extra=fields("donor_rejected", peer_id=donor, chunk=chunk, reason=str(exc)[:200]))
