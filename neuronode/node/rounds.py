"""One DiLoCo round of a node: train H steps, hand the pseudo-gradient to the averaging
protocol, apply the average it returns with the outer step, checkpoint.

How the node takes part in a round is the round state's answer (neuronode.averaging.state):
contribute, listen (it adopted the swarm's state at this round), or stand aside (its lineage
closed the round without it). With --overlap the exchange of round r runs in the background
while round r+1 trains; its outer step is applied at the end of round r+1 (one-round-delayed
outer step), and round r+2 starts from the result.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from neuronode.averaging import Average, Averaging, Mode, NodePhase, RoundState
from neuronode.config import NodeConfig
from neuronode.events import fields
from neuronode.node.catchup import ByRounds, CatchUp
from neuronode.node.pools import Pools
from neuronode.node.replica import Replica
from neuronode.swarm.node import SwarmNode
from neuronode.swarm.streams.missed import CATCHUP_ROUNDS

logger = logging.getLogger(__name__)
Drill = Callable[[torch.Tensor], torch.Tensor]


def finite(value: float) -> float | None:
    return value if math.isfinite(value) else None  # JSON has no NaN


def byzantine(scale: float, noise: float) -> Drill | None:
    """A fault drill's lie: our pseudo-gradient times `scale` plus gaussian noise (--fault-file)."""
    if (scale, noise) == (1.0, 0.0):
        return None
    return lambda delta: delta * scale + noise * torch.randn_like(delta)


@dataclass(kw_only=True)
class Rounds:
    cfg: NodeConfig
    trainer: Replica
    state: RoundState
    swarm: SwarmNode
    averaging: Averaging
    catch_up: CatchUp
    pools: Pools
    stop: threading.Event  # a stop was requested (our contribution's encoding gives up)
    train: Callable[[], Awaitable[None]]  # the training loop trains until the round's steps are done
    save: Callable[[], Awaitable[None]]  # a checkpoint after every outer step
    on_sync: Callable[[float], None] = lambda _: None
    on_round: Callable[[], Awaitable[None]] | None = None  # after a round's outer step and checkpoint
    pending: asyncio.Task[Average] | None = None  # --overlap: the exchange of state.pending
    last_contributors: list[str] = field(default_factory=list)
    last_sync_s: float = 0.0
    utilization: float = 0.0

    def finished(self) -> bool:
        """--rounds counts rounds trained; with --overlap the last one's sync is flushed after."""
        return bool(self.cfg.rounds) and self.state.training_round >= self.cfg.rounds

    async def one(self, stopped: asyncio.Event) -> bool:
        """One round; False when a stop interrupted it (nothing half-applied)."""
        if self.pending is not None and self.catch_up.plan() is not None:
            await self.cancel_pending()  # --overlap: our sync in flight belongs to a lineage we leave
        if self.pending is None:
            await self.maybe_catch_up(stopped)
            if stopped.is_set():
                return False
            if self.finished():  # catching up took us to --rounds: nothing left to train
                return True
        round_id = self.state.training_round
        started = time.monotonic()
        self.state.phase = NodePhase.TRAINING
        if not self.trainer.round_complete():  # (a checkpoint may hold a round already trained)
            await self.train()
        train_s = time.monotonic() - started
        if not self.trainer.round_complete():
            return False
        self.state.phase = NodePhase.ENCODING
        if not self.cfg.overlap:
            if not await self.finish(round_id, self.start(round_id, await self.sync(round_id)), stopped):
                return False
        else:
            prepared = await self.prepare(round_id)
            previous, previous_round, self.pending = self.pending, self.state.pending, None
            if previous is not None and previous_round is not None \
                    and not await self.finish(previous_round, previous, stopped):
                return False
            if previous is None:  # nothing to apply yet: round r+1 starts from the global params
                await self.pools.run(self.pools.train, self.trainer.restart_from_global)
            # ... shifted to where they will be if round r+1's average equals our contribution.
            await self.pools.run(self.pools.train, self.trainer.look_ahead, prepared.compensated)
            self.begin_pending(round_id, self.averaging.exchange(prepared))
        self.utilization = train_s / max(time.monotonic() - started, 1e-9)
        return True

    async def maybe_catch_up(self, stopped: asyncio.Event | None = None) -> None:
        """Reach the swarm's round if we are behind or apart: by applying the rounds we missed
        (`by_rounds`, catchup.py) when we hold the start of the first and the swarm still keeps
        what they need, else by adopting its state (and then by rounds, if the swarm moved on
        during the download); under --overlap we then listen to the round we adopted
        (catchup.py says why). Never past --rounds."""
        await self.until_caught_up(stopped)
        adopted = await self.catch_up.maybe(stopped)  # nothing, when we are where the swarm is
        if adopted is not None and self.cfg.overlap and not self.finished():  # at --rounds: no round R to listen to
            # The swarm's round-R contributions started before the state we adopted (catchup.py).
            self.begin_pending(adopted, self.averaging.listen(adopted, base_digest=None))
        elif adopted is not None:
            await self.until_caught_up(stopped)

    async def until_caught_up(self, stopped: asyncio.Event | None) -> None:
        """Catch up by rounds, again while the swarm moved on as we did (until a stop)."""
        while not (stopped is not None and stopped.is_set()) and await self.by_rounds(stopped):
            pass

    async def by_rounds(self, stopped: asyncio.Event | None = None) -> bool:
        """Verify instead of adopting (SECURITY.md): behind the swarm by at most CATCHUP_ROUNDS
        rounds (which its members keep), apply them (catchup.ByRounds: each step checked
        against the digests a quorum of the other hosts published). False when we are not
        behind that way, or a round is no longer held: the caller downloads the state."""
        plan = self.catch_up.plan()
        if plan is None or plan.reason != "behind" or not self.by_rounds_here():
            return False
        target = min(plan.target_round, self.cfg.rounds) if self.cfg.rounds else plan.target_round
        if not 0 < target - self.state.round <= CATCHUP_ROUNDS:
            return False
        return await ByRounds(cfg=self.cfg, trainer=self.trainer, state=self.state, swarm=self.swarm,
                              averaging=self.averaging, pools=self.pools, save=self.save).run(target, stopped)

    def by_rounds_here(self) -> bool:
        """Members catch up by rounds under all-to-all and gather without --overlap (swarm-wide
        settings). Under --overlap a round's contributions start before the state a member
        reaches, and under reduce-scatter a member must listen to the round it reaches
        (catchup.py says why for both): there a member behind downloads the state, and nobody
        keeps rounds for it."""
        return not self.cfg.overlap and self.cfg.averaging in ("all-to-all", "gather")

    async def sync(self, round_id: int) -> Awaitable[Average]:
        """What averages `round_id` for us, by how we take part in it."""
        if self.state.mode(round_id) == Mode.LISTEN:  # we adopted this round (catch-up)
            return self.averaging.listen(round_id, base_digest=self.state.param_digest)
        if closed := self.swarm.closed_without_us(round_id):
            # Contributing now would leave us, or the members still in the round, outside the
            # average those peers applied. Listening gives us exactly theirs (docs/fault-tolerance.md).
            logger.warning("round %d: %s closed it before we could contribute (we joined or trained late); "
                           "listening to it instead", round_id, ", ".join(closed),
                           extra=fields("stand_aside", round_id=round_id, closed_by=closed))
            self.state.stand_aside(round_id)
            return self.averaging.listen(round_id, base_digest=self.state.param_digest)
        return self.averaging.exchange(await self.prepare(round_id))

    async def prepare(self, round_id: int) -> Any:
        """Our contribution, encoded before the model moves on."""
        delta = await self.pools.run(self.pools.train, self.trainer.pseudo_gradient, self.drill())
        return await self.averaging.prepare(round_id, delta, base_digest=self.state.param_digest,
                                            weight=self.trainer.weight(), give_up=self.stop.is_set)

    def drill(self) -> Drill | None:
        plan = self.swarm.fault_plan()
        return byzantine(plan.byzantine_scale, plan.byzantine_noise) if plan is not None else None

    def start(self, round_id: int, sync: Awaitable[Average]) -> asyncio.Task[Average]:
        started = time.monotonic()
        task = asyncio.ensure_future(sync)
        # How long the exchange itself took (with --overlap it ends long before we read it).
        task.add_done_callback(lambda _: setattr(self, "last_sync_s", time.monotonic() - started))
        return task

    def begin_pending(self, round_id: int, sync: Awaitable[Average]) -> None:
        self.state.pending = round_id
        self.pending = self.start(round_id, sync)

    async def cancel_pending(self) -> None:
        if self.pending is not None:
            self.pending.cancel()
            await asyncio.gather(self.pending, return_exceptions=True)
            self.pending, self.state.pending = None, None

    async def flush(self, stopped: asyncio.Event) -> None:
        """--overlap: apply the last round's sync before leaving."""
        if self.pending is not None and self.state.pending is not None and not stopped.is_set():
            task, self.pending = self.pending, None
            await self.finish(self.state.pending, task, stopped)

    async def finish(self, round_id: int, exchange: asyncio.Task[Average], stopped: asyncio.Event) -> bool:
        """Wait for a round's exchange (or a stop), then take the outer step with its average."""
        self.state.phase = NodePhase.SYNCING
        waited = time.monotonic()
        stop_wait = asyncio.ensure_future(stopped.wait())
        await asyncio.wait({exchange, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
        if not exchange.done():
            exchange.cancel()
            await asyncio.gather(exchange, return_exceptions=True)
            return False
        average = exchange.result()
        self.on_sync(self.last_sync_s)
        self.state.phase = NodePhase.OUTER_STEP
        digest = await self.pools.run(self.pools.train, self.trainer.apply_average, average.vector)
        self.last_contributors = average.contributors
        if self.by_rounds_here():  # what a member catching up applies, kept before we announce the round's end
            await self.averaging.keep(round_id, average, base_digest=self.state.param_digest)
        self.state.completed(round_id, digest, self.trainer.momentum_digest)
        await self.save()
        if self.on_round is not None:
            await self.on_round()
        logger.info("round %d done: loss %.4f val_loss %.4f contributors %d sync %.1fs waited %.1fs digest %s from %s",
                    self.state.round, self.trainer.loss, self.trainer.val_loss, len(average.contributors),
                    self.last_sync_s, time.monotonic() - waited, digest[:12], ",".join(average.contributors),
                    extra=fields("round_done", round_id=round_id, round=self.state.round, contributors=average.contributors,
                                 param_digest=digest, loss=finite(self.trainer.loss), val_loss=finite(self.trainer.val_loss),
                                 sync_s=round(self.last_sync_s, 3), weights=average.weights))
        return True
