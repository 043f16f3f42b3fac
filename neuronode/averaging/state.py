"""The one round state of a node: which round it is in and how it takes part.

Every part reads this object instead of keeping a copy: the round runner and catch-up change
it, the swarm announces it (round, contributes_from, recent digests), the round book reads the
round to reset itself after a state transfer, status shows the phase.

Round ids count completed rounds: the contribution made after k completed rounds belongs to
round k; after averaging it the node has completed k + 1 rounds.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

RECENT_DIGESTS = 8  # (round, param_digest) pairs a node publishes


class NodePhase(enum.Enum):
    """What the node is doing now (status `phase`; the values are the public strings)."""

    STARTING = "starting"
    JOINING = "joining"
    TRAINING = "training"
    ENCODING = "encoding"
    SYNCING = "syncing"
    OUTER_STEP = "outer step"
    CATCHING_UP = "catching up"
    STOPPING = "stopping"
    STOPPED = "stopped"


class Mode(enum.Enum):
    """How the node takes part in one round."""

    CONTRIBUTE = "contribute"  # send our pseudo-gradient and average the round
    LISTEN = "listen"  # average what the others send, send nothing (after adopting a state)


@dataclass
class RoundState:
    """Which round the node is in and how it takes part in it.

    `round` counts the outer steps applied to the global parameters. Under --overlap the
    exchange of one round runs while the next trains: `pending` is that round, and the node
    trains round `round + 1`. `contributes_from` is the first round the node contributes to
    (it listens to earlier ones: it adopted the swarm's state, or stood aside)."""

    round: int = 0
    param_digest: str = ""
    digests: dict[int, str] = field(default_factory=dict)  # round -> param_digest after it
    momenta: dict[int, str] = field(default_factory=dict)  # round -> momentum_digest after it
    contributes_from: int = 0
    pending: int | None = None
    phase: NodePhase = NodePhase.STARTING
    epoch: int = 0  # counts adoptions: what was buffered for the old lineage is gone
    # Called after the round or the way we take part changed (the swarm announces it at once).
    on_change: list[Callable[[], None]] = field(default_factory=list, repr=False)

    @property
    def training_round(self) -> int:
        """The round whose inner steps run now (or next)."""
        return self.round + (1 if self.pending is not None else 0)

    def mode(self, round_id: int) -> Mode:
        return Mode.LISTEN if round_id < self.contributes_from else Mode.CONTRIBUTE

    def recent(self) -> list[tuple[int, str, str]]:
        """(round, param_digest, momentum_digest) at the start of each recent round."""
        return [(r, d, self.momenta.get(r, "")) for r, d in sorted(self.digests.items())]

    def start(self, round_id: int, param_digest: str, momentum_digest: str = "") -> None:
        """At start-up: `round_id` rounds are done (restored from a checkpoint, or 0)."""
        self.round, self.param_digest = round_id, param_digest
        self.digests, self.momenta = {round_id: param_digest}, {round_id: momentum_digest}

    def completed(self, round_id: int, param_digest: str, momentum_digest: str = "") -> None:
        """Our outer step of `round_id` is applied."""
        self.round = round_id + 1
        self.param_digest = param_digest
        self.digests[round_id + 1], self.momenta[round_id + 1] = param_digest, momentum_digest
        for old in sorted(self.digests)[:-RECENT_DIGESTS]:
            del self.digests[old]
            self.momenta.pop(old, None)
        if self.pending == round_id:
            self.pending = None
        self._changed()

    def adopted(self, round_id: int, param_digest: str, momentum_digest: str = "", *, listen: bool) -> None:
        """We loaded the swarm's state after `round_id` rounds; our old lineage is gone. With
        `listen` we only listen to round `round_id` and contribute from the next one."""
        self.round, self.param_digest = round_id, param_digest
        self.digests, self.momenta = {round_id: param_digest}, {round_id: momentum_digest}
        self.contributes_from = round_id + 1 if listen else 0
        self.pending = None
        self.epoch += 1
        self._changed()

    def stand_aside(self, round_id: int) -> None:
        """Only listen to `round_id`: peers still in it stop waiting for us."""
        self.contributes_from = max(self.contributes_from, round_id + 1)
        self._changed()

    def _changed(self) -> None:
        for callback in self.on_change:
            callback()
