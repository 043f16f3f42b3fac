"""State transfer: the joiner's choice of what to download, and from whom (the parts: the
donor `neuronode.swarm.statesync.donor`, the state assembled and its checks
`neuronode.swarm.statesync.assembly`, fetching from many donors at once
`neuronode.swarm.statesync.download`; docs/protocol.md, "State transfer").

A download first reads a donor's header, in the donors' order, until one's state is what the
swarm vouches for: its round, param_digest and chunk list (the chunks_root the members publish
per round) are what a quorum of the other hosts published (neuronode.swarm.guard.trust.witnesses).
That header's chunk list is then what every chunk is checked against as it arrives, from
whichever donor: every donor that holds that state serves a share at once. A download that is
cut, or whose donors fail or lie, goes on from the chunks it verified (another pass, the same
donors or others); there is no deadline for one that moves. Progress (bytes, rate, time left,
donors) is logged every PROGRESS_S and shown in status.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from neuronode.events import fields
from neuronode.security.auth import AuthError
from neuronode.state import GlobalState
from neuronode.swarm.context import Context
from neuronode.swarm.guard.trust import witnesses
from neuronode.swarm.links import Links, NoRoute
from neuronode.swarm.statesync.assembly import StateReceiver, header_chunks_root
from neuronode.swarm.statesync.donor import Donor, StateProvider, encode_chunk
from neuronode.swarm.statesync.download import PROGRESS_S, Download, Late, TransferProgress
from neuronode.swarm.wire import Refusal
from neuronode.v1 import node_pb2 as pb

logger = logging.getLogger(__name__)

__all__ = ["PROGRESS_S", "Donor", "StateFetch", "StateProvider", "StateReceiver", "TransferProgress", "Verify",
           "encode_chunk", "header_chunks_root"]

# A donor a round ahead of what the other members announced so far (they finished it a moment
# later) has too few hosts to vouch for it yet: we wait until more of them publish that round,
# at most this many heartbeats (2 s at least), and ask again, up to WITNESS_RETRIES times.
WITNESS_WAIT_HEARTBEATS = 4
WITNESS_RETRIES = 2

Verify = Callable[[GlobalState], str | None]  # the node's own checks on a state: a reason to refuse it


class StateFetch:
    """The joiner's side: download the global state the swarm vouches for (neuronode.swarm.guard.trust.witnesses)
    from every donor that holds it at once, one that passes our own checks, going on with the
    chunks verified so far whichever donors fail."""

    def __init__(self, ctx: Context, *, links: Links, on_progress: Callable[[TransferProgress], None] = lambda p: None) -> None:
        self.ctx = ctx
        self.links = links
        self.on_progress = on_progress
        self.progress = TransferProgress()
        self.transfers = 0
        self.unwitnessed: dict[int, str] = {}  # round -> a donor refused because nobody had published it yet
        self.downloaded: dict[str, Any] = {}  # the last download's figures (its state_downloaded event)

    def show(self, progress: TransferProgress) -> None:
        self.progress = progress
        self.on_progress(progress)

    async def fetch(self, donors: list[str], *, verify: Verify = lambda _: None) -> GlobalState | None:
        """The swarm's state from `donors` (in the order their headers are read), or None when
        they could not deliver one that the swarm vouches for and that passes `verify`."""
        ctx = self.ctx
        download = Download(n_elements=ctx.cfg.n_elements, manifest_hash=ctx.cfg.manifest_hash,
                            executor=ctx.executor, on_progress=self.show, security=ctx.security)
        retries, started = 0, time.monotonic()
        try:
            while True:
                self.unwitnessed, held = {}, download.have
                state = await self.one_pass(donors, verify, download)
                if state is not None:
                    took = time.monotonic() - started
                    self.downloaded = {"bytes": download.received_bytes, "seconds": round(took, 3),
                                       "chunks_by_donor": dict(download.by_donor),
                                       "donors_at_once": download.most_at_once}
                    logger.info("downloaded the state (%.1f MB) in %.1f s from %s", download.received_bytes / 1e6, took,
                                ", ".join(f"{d} ({n} chunks)" for d, n in sorted(download.by_donor.items())),
                                extra=fields("state_downloaded", **{**self.downloaded, "seconds": round(took, 1)}))
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
        """What to download (the first header the swarm vouches for), fetched from every live
        donor at once and checked; the next vouched state when our own checks refuse one."""
        ctx = self.ctx
        received = download.received_bytes
        try:
            while True:
                live = [d for d in donors if (p := ctx.table.peers.get(d)) is not None and ctx.table.is_alive(p)
                        and self.links.dialable(p)]  # as it is now: a donor may come or go between passes
                chosen = await self.choose(live, download)
                if chosen is None:
                    return None
                try:
                    state = await download.fetch(live, self.open, node_id=ctx.cfg.node_id, swarm_id=ctx.cfg.swarm_id)
                    if state is None:
                        return None  # every donor failed part way: what was verified stays
                    refused = await asyncio.get_running_loop().run_in_executor(ctx.executor, verify, state)
                    if refused:
                        raise Refusal("FAILED_PRECONDITION", refused)
                except Exception as exc:  # noqa: BLE001 - whatever a donor's data does, it never kills the node
                    why = str(exc) if isinstance(exc, Refusal) else repr(exc)
                    served = sorted({chosen, *download.by_donor})
                    download.rejected.update(served)
                    download.refuse_state()
                    logger.warning("the state %s served was refused: %s; trying another donor", ", ".join(served), why,
                                   extra=fields("donor_rejected", peer_id=chosen, reason=why[:200]))
                    continue
                self.transfers += 1
                return state
        finally:
            ctx.counters.bytes_received += download.received_bytes - received

    async def choose(self, donors: list[str], download: Download) -> str | None:
        """Read donors' headers, in order, until one's state is what the swarm vouches for (and
        none our own checks refused): the download goes on with it. The donor, or None."""
        for donor_id in donors:
            if donor_id in download.rejected:
                continue
            try:
                call = await self.open(donor_id, pb.StateRequest(node_id=self.ctx.cfg.node_id,
                                                                 swarm_id=self.ctx.cfg.swarm_id, header_only=True))
                try:
                    await download.probe(call, accept=functools.partial(self.vouch, donor_id, donors))
                finally:
                    call.cancel()
            except (grpc.aio.AioRpcError, Late) as exc:
                code = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else "LATE"
                why = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                logger.warning("no state header from %s (%s: %s); asking another donor", donor_id, code, why,
                               extra=fields("donor_failed", peer_id=donor_id, code=code, chunks=download.have,
                                            reason=(why or "")[:200]))
                continue
            except NoRoute as exc:
                logger.info("not asking %s for the state: %s", donor_id, exc)
                continue
            except (Refusal, AuthError) as exc:
                logger.warning("state from %s refused: %s; trying another donor", donor_id, exc,
                               extra=fields("donor_rejected", peer_id=donor_id, reason=str(exc)[:200]))
                continue
            return donor_id
        return None

    def vouch(self, donor_id: str, lineage: list[str], header: pb.StateHeader) -> str | None:
        """Why `donor_id`'s header is not the swarm's state, or None (`vouched`, on its round,
        param_digest and the chunks_root of the chunk list it lists)."""
        return self.vouched(header.round, header.param_digest, donor_id, lineage, header_chunks_root(header))

    async def open(self, donor_id: str, request: pb.StateRequest) -> Any:
        """A FetchState call to `donor_id` with `request`, signed for it."""
        ctx = self.ctx
        return await self.links.fetch(donor_id, "FetchState", ctx.security.sign_request("FetchState", request, donor_id))

    def vouched(self, round_id: int, param_digest: str, donor_id: str, lineage: list[str],
                momentum_digest: str = "") -> str | None:
        """Why a donor's (round, param_digest, momentum_digest) is not the swarm's, or None when
        it is: other live hosts published it, whatever lineage they are in (a host still at
        round 0 vouches for nothing), a quorum of those that published the round and more than
        published another in `lineage` (the donor's, the one the vote chose: the other side of a
        healed partition objects to nothing) (neuronode.swarm.guard.trust.witnesses); or no other host
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
