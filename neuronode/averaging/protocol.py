"""What every averaging protocol offers a node: prepare a round, exchange it, or listen to it.

`prepare` runs when the node's inner steps end (the model may move on once it returns): it
fixes what the round needs (reduce-scatter: its members) and encodes our contribution on the
encoder's thread. `exchange` sends it, collects the others', averages and returns the average.
`listen` averages a round we do not contribute to (we adopted the swarm's state at its start,
or stood aside). All three return the one averaged pseudo-gradient the outer step applies.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

import torch

from neuronode.averaging.book import majority_lineage
from neuronode.averaging.transport import Transport
from neuronode.clock import Clock
from neuronode.codec import Contribution, ContributionEncoder, Phase
from neuronode.codec.contribution import Aggregate
from neuronode.events import fields

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AveragingConfig:
    """What a protocol needs besides its transport: who we are, the swarm's codec and size,
    the deadline of one phase and --min-peers."""

    node_id: str
    codec: str
    n_elements: int
    sync_timeout_s: float = 60.0
    min_contributors: int = 1  # --min-peers


@dataclass
class Prepared:
    """Our encoded contribution of one round, ready to exchange."""

    round_id: int
    parts: list[Contribution]  # one, or one shard per member (reduce-scatter)
    compensated: torch.Tensor  # the pseudo-gradient they encode, error feedback included
    members: tuple[str, ...] = ()
    ranges: list[tuple[int, int]] = field(default_factory=list)
    encode_s: float = 0.0


@dataclass
class Average:
    """A round's averaged pseudo-gradient and who is in it."""

    vector: torch.Tensor
    contributors: list[str]  # sorted
    fewest: int  # the fewest contributions any part of `vector` averages (0: a part got none)
    encode_s: float = 0.0
    exchange_s: float = 0.0  # waiting for the network (both phases under reduce-scatter)
    average_s: float = 0.0  # aggregating and decoding (reducing and assembling too)
    sent: list[Contribution] = field(default_factory=list)  # every encode of the round that we sent


class Averaging:
    """Base of AllToAll and ReduceScatter: what they share."""

    def __init__(self, cfg: AveragingConfig, *, transport: Transport, encoder: ContributionEncoder,
                 encoder_pool: Executor, aggregate: Aggregate, executor: Executor, clock: Clock | None = None) -> None:
        self.cfg = cfg
        self.transport = transport
        self.encoder = encoder  # used on encoder_pool's one thread only
        self.encoder_pool = encoder_pool
        self.aggregate = aggregate
        self.executor = executor  # decoding and averaging
        self.clock = clock or Clock()

    async def prepare(self, round_id: int, delta: torch.Tensor, *, base_digest: str, weight: float,
                      give_up: Callable[[], bool] = lambda: False) -> Prepared:
        raise NotImplementedError

    async def exchange(self, prepared: Prepared) -> Average:
        raise NotImplementedError

    async def listen(self, round_id: int, *, base_digest: str | None) -> Average:
        """The average of a round we only listen to. With `base_digest` (the parameters at its
        start, which we hold ourselves) only contributions made from those count, whatever
        anyone claims; None (--overlap: the round started before the state we adopted) follows
        the start most senders share."""
        raise NotImplementedError

    async def listened(self, round_id: int, phase: Phase, base_digest: str | None) -> dict[str, Contribution]:
        """What the others sent of a round we only listen to, made from `base_digest` (the
        parameters we know the round started from), for the members most of them name."""
        logger.info("round %d: listening to the swarm's %s (we contribute from round %d on)",
                    round_id, phase.label, round_id + 1, extra=fields("listening", round_id=round_id, phase=phase.name.lower()))
        got = await self.transport.book.collect(round_id, phase=phase, timeout_s=self.cfg.sync_timeout_s,
                                                expected=lambda: self.transport.round_peers(round_id),
                                                min_contributors=0)
        return majority_lineage(got, base_digest)

    def nothing_heard(self, round_id: int) -> Average:
        logger.warning("round %d: heard no contribution; our outer step uses a zero average", round_id,
                       extra=fields("zero_average", round_id=round_id))
        return Average(vector=torch.zeros(self.cfg.n_elements), contributors=[], fewest=0)


def elapsed(since: float) -> float:
    return time.perf_counter() - since
