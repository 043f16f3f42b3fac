"""Catching up with the swarm: before a round, a node behind the winning lineage (or outside it)
downloads the global state from its members and continues from there (docs/fault-tolerance.md)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from neuronode.averaging import Average, Averaging, NodePhase, RoundState
from neuronode.codec import ContributionEncoder
from neuronode.config import NodeConfig
from neuronode.events import Throttled, fields
from neuronode.node.pools import Pools
from neuronode.node.replica import Replica
from neuronode.state import GlobalState
from neuronode.swarm.membership.lineage import CatchUp as Plan
from neuronode.swarm.node import SwarmNode

logger = logging.getLogger(__name__)


PLAUSIBLE_FACTOR = 10.0  # a donated state's norms against ours, per round apart (training moves them less)


def implausible(ours: float, params: float, momentum: float | None, *, rounds_apart: int) -> str | None:
    """Why a donated state's norms cannot be the swarm's, or None: its parameters' norm within
    PLAUSIBLE_FACTOR per round between us of ours (a fresh joiner's parameters are where the
    swarm's started: early rounds grow norms several-fold), its momentum's not absurdly larger
    than its parameters'."""
    factor = PLAUSIBLE_FACTOR * max(1, abs(rounds_apart))
    if not ours / factor <= params <= ours * factor:
        return f"its parameters' norm {params:.4g} is implausible against ours ({ours:.4g}, {rounds_apart} rounds apart)"
    if momentum is not None and not momentum <= params * PLAUSIBLE_FACTOR:
        return f"its outer momentum's norm {momentum:.4g} is implausible (parameters {params:.4g})"
    return None
T = TypeVar("T")


async def until_stopped(work: Awaitable[T], stopped: asyncio.Event | None) -> T | None:
    """`work`'s result, or None at once if `stopped` is set first (the work is cancelled)."""
    task = asyncio.ensure_future(work)
    if stopped is None:
        return await task
    stop_wait = asyncio.ensure_future(stopped.wait())
    await asyncio.wait({task, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    stop_wait.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        logger.info("stop requested: state transfer abandoned")
        return None
    return task.result()


@dataclass(kw_only=True)
class CatchUp:
    """Decides, before a round, whether to move to the swarm's state, and moves there."""

    last_repair_round: int = -(10**9)  # repairs (not catch-ups) wait --repair-cooldown rounds
    say: Throttled = field(default_factory=lambda: Throttled(logger))
    cfg: NodeConfig
    trainer: Replica
    encoder: ContributionEncoder
    """Its error feedback restarts at zero once we adopt a state (on the encoder's own thread)."""
    state: RoundState
    swarm: SwarmNode
    pools: Pools
    save: Callable[[], Awaitable[None]]  # a checkpoint once we adopted the swarm's state

    def plan(self) -> Plan | None:
        """Where the swarm is, if we should move there now."""
        plan = self.swarm.catch_up_plan()
        return plan if plan is not None and self.due(plan) else None

    def due(self, plan: Plan) -> bool:
        """Catching up is never delayed; a diverged replica repairs at most once per cooldown."""
        if plan.reason == "diverged" and self.state.round - self.last_repair_round < self.cfg.repair_cooldown:
            self.say("repair-cooldown", logging.WARNING, "diverged from the swarm, but repaired at round %d; "
                     "next repair after %d rounds", self.last_repair_round, self.cfg.repair_cooldown)
            return False
        return True

    def plausible(self, state: GlobalState) -> str | None:
        """Our own check of a donated state (in a worker thread), beyond what members vouch for
        (`implausible`; finite values are checked as it is decoded). A reason, or None."""
        momentum = float(state.momentum.norm()) if state.momentum is not None else None
        return implausible(self.trainer.global_norm(), float(state.params.norm()), momentum,
                           rounds_apart=state.round - self.state.round)

    async def maybe(self, stopped: asyncio.Event | None = None) -> int | None:
        """Download and adopt the swarm's state if we are behind or diverged; the round we
        adopted, or None. A stop request interrupts the download."""
        plan = self.plan()
        if plan is None:
            return None
        self.state.phase = NodePhase.CATCHING_UP
        started = time.monotonic()
        logger.info("%s (round %d, swarm at round %d): downloading the global state from %s",
                    "behind the swarm" if plan.reason == "behind" else "diverged from the swarm",
                    self.state.round, plan.target_round, ", ".join(plan.donors[:3]),
                    extra=fields("catching_up", round_id=self.state.round, reason=plan.reason,
                                 target_round=plan.target_round, donors=plan.donors[:3]))
        got = await until_stopped(self.swarm.fetch_state(plan.donors, verify=self.plausible), stopped)
        if stopped is not None and stopped.is_set():
            return None
        if got is None:
            logger.warning("no donor delivered the state; training on and trying again next round")
            return None
        digest = await self.pools.run(self.pools.train, self.trainer.adopt, got)
        await self.pools.run(self.pools.encode, self.encoder.reset)
        # Under --overlap the swarm made its round-R contributions from the parameters before
        # the ones we adopted at round R: we listen to round R (apply its average at the end of
        # our first round, like everyone) and contribute from round R + 1 on. Under
        # reduce-scatter each member fixes round R's membership when its inner steps end, and
        # whether our announcement reached it by then is a race: members that disagree drop
        # each other's slices and all wait out the deadline. Listening to round R keeps every
        # member's view of it the same; we are a member from R + 1 on (docs/protocol.md).
        listen = self.cfg.overlap or self.cfg.averaging == "reduce-scatter"
        self.state.adopted(got.round, digest, self.trainer.momentum_digest, listen=listen)
        if plan.reason == "diverged":  # only repairs count toward the cooldown, not catch-ups
            self.last_repair_round = self.state.round
        await self.save()
        logger.info("adopted the swarm's state at round %d in %.1fs (digest %s, val_loss %.4f)",
                    got.round, time.monotonic() - started, digest[:12], self.trainer.val_loss,
                    extra=fields("adopted", round_id=got.round, param_digest=digest, val_loss=self.trainer.val_loss))
        return got.round


@dataclass(kw_only=True)
class ByRounds:
    """Catching up by rounds (docs/fault-tolerance.md): a member that holds the state at the
    start of round r while the swarm is at r + k (it installed a state that the swarm moved on
    from during the download, it was away, or trained a round too slowly) applies rounds r, ...,
    r + k - 1 itself, each from what the swarm applied in it: the averaged update a member that
    applied it keeps, or the round's agreed contributions (neuronode.swarm.streams.missed keeps
    whichever is fewer bytes, CATCHUP_ROUNDS rounds), and keeps each step only if it reaches the
    parameter and momentum digests a quorum of the other hosts published for the round's end
    (never one member's word: a holder that serves anything else costs a try, and we restore the
    state from before it). False where a round is no longer held: the caller downloads the state."""

    cfg: NodeConfig
    trainer: Replica
    state: RoundState
    swarm: SwarmNode
    averaging: Averaging
    pools: Pools
    save: Callable[[], Awaitable[None]]

    async def run(self, target: int, stopped: asyncio.Event | None = None) -> bool:
        """Apply our rounds up to `target` (a checkpoint once there); False, with the rounds
        applied so far kept, when one is not held any more or a stop came."""
        self.state.phase = NodePhase.SYNCING
        started, first = time.monotonic(), self.state.round
        received, payload = self.swarm.counters.bytes_received, 0
        while self.state.round < target:
            if stopped is not None and stopped.is_set() or not await self.one(self.state.round, stopped):
                break
            payload += self.averaging.fetched.get(self.state.round - 1, 0)
        if self.state.round > first:
            await self.save()
            logger.info("caught up by rounds %d to %d in %.1fs (%d bytes of updates and contributions fetched, no "
                        "state downloaded)", first, self.state.round, time.monotonic() - started, payload,
                        extra=fields("caught_up", round_id=first, round=self.state.round, rounds=self.state.round - first,
                                     payload_bytes=payload, bytes=self.swarm.counters.bytes_received - received,
                                     seconds=round(time.monotonic() - started, 3)))
        return self.state.round >= target

    async def one(self, round_id: int, stopped: asyncio.Event | None) -> bool:
        """Apply `round_id` (we hold its start): from a holder's averaged update, else from the
        contributions its receipts decided; True once the digests after it are the swarm's."""
        base = self.state.param_digest
        self.averaging.fetched.pop(round_id, None)
        for holder in self.swarm.holders(round_id, base):
            average = await until_stopped(self.averaging.replay_update(round_id, [holder], base_digest=base), stopped)
            if average is not None and await self.applied(round_id, average, "update", holder):
                return True
        average = await until_stopped(self.averaging.replay(round_id, base_digest=base), stopped)
        if average is None or not average.contributors:
            return False
        return await self.applied(round_id, average, "contributions", "its receipts")

    async def applied(self, round_id: int, average: Average, source: str, holder: str) -> bool:
        """Take `round_id`'s outer step with `average` (`source`: a `holder`'s averaged update,
        or the contributions the receipts decided), as a member that trained the round did (its
        inner steps counted), and keep it if the digests after it are the ones a quorum of the
        other hosts published; else restore the state from before it."""
        before = await self.pools.run(self.pools.train, self.trainer.snapshot)
        digest = await self.pools.run(self.pools.train, self.step, average)
        if not self.swarm.vouched(round_id + 1, digest, self.trainer.momentum_digest):
            logger.warning("round %d: replaying it from the %s of %s gave parameters %s, which the swarm did not "
                           "publish; not keeping them", round_id, source, holder, digest[:12],
                           extra=fields("replay_mismatch", round_id=round_id, param_digest=digest))
            await self.pools.run(self.pools.train, self.trainer.adopt, before)
            return False
        await self.averaging.keep(round_id, average, base_digest=self.state.param_digest)  # for the next one behind
        self.state.completed(round_id, digest, self.trainer.momentum_digest)
        logger.info("round %d replayed from the %s of %s: digest %s (no state downloaded)", round_id, source,
                    holder, digest[:12],
                    extra=fields("replayed", round_id=round_id, round=round_id + 1, contributors=average.contributors,
                                 param_digest=digest, source=source, payload_bytes=self.averaging.fetched.get(round_id, 0)))
        return True

    def step(self, average: Average) -> str:
        """On the training thread: the outer step of a round we did not train, counting its inner
        steps as the members that trained it did (their state's digest counts them)."""
        engine = self.trainer.engine
        with self.trainer.global_lock:
            engine.inner_steps_total += max(0, self.cfg.inner_steps - engine.steps_this_round)
        return self.trainer.apply_average(average.vector)
