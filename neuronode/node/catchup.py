"""Catching up with the swarm: before a round, a node behind the winning lineage (or outside it)
downloads the global state from its members and continues from there (docs/fault-tolerance.md)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from neuronode.averaging import NodePhase, RoundState
from neuronode.codec import ContributionEncoder
from neuronode.config import NodeConfig
from neuronode.events import Throttled, fields
from neuronode.node.pools import Pools
from neuronode.node.replica import Replica
from neuronode.state import GlobalState
from neuronode.swarm.lineage import CatchUp as Plan
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
