"""Contributions kept per (phase, round), and the rule that closes a round.

Rules (docs/protocol.md repeats them):
- Round ids count completed rounds: the contribution made after k completed rounds is round k.
- Each phase (whole contributions, reduce-scatter slices, averaged shards) closes its rounds on
  its own: rounds below its `closed_below` are closed, and a contribution for them is refused
  and never mixed into a later round. Rounds at or beyond `closed_below + window` are too far
  ahead and refused; the ones in between are buffered, so a fast peer may send the next round
  before we finish this one.
- A round closes when every expected peer's contribution has arrived, or at the deadline if at
  least `min_contributors` have; with fewer the node keeps waiting (one more deadline at a time).
- A contribution still streaming when its round closes is discarded.

Memory: at most `window` rounds x (peers) complete contributions per phase, each stored in its
encoded (wire) form, i.e. P x bytes-per-parameter of its codec; partial streams add at most
one chunk each beyond what they already stored.

The book is also the node's change signal: the transport calls `notify()` when membership
changes (a peer joined, left, moved to another round, published a receipt), so every wait here
and in the averaging protocols wakes up and re-evaluates its rule.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from neuronode.clock import Clock
from neuronode.codec.contribution import Contribution, Phase
from neuronode.events import fields

logger = logging.getLogger(__name__)


class RoundRefused(Exception):
    """Base for contributions a round cannot take; `code` names the gRPC status to answer."""

    code = "FAILED_PRECONDITION"


class RoundClosed(RoundRefused):
    pass


class RoundTooFar(RoundRefused):
    pass


class DuplicateContribution(RoundRefused):
    code = "ALREADY_EXISTS"


class RoundBook:
    """Per-(phase, round) contribution store with deadline-bounded collection."""

    def __init__(self, *, first_round: int, window: int = 2, clock: Clock | None = None) -> None:
        self.window = window
        self.clock = clock or Clock()
        self._closed_below = {phase: first_round for phase in Phase}
        self._complete: dict[tuple[Phase, int], dict[str, Contribution]] = {}
        self._streaming: set[tuple[Phase, int, str]] = set()
        self._changed = asyncio.Event()

    def closed_below(self, phase: Phase = Phase.WHOLE) -> int:
        return self._closed_below[phase]

    def check_open(self, round_id: int, sender_id: str, phase: Phase = Phase.WHOLE) -> None:
        """Raise a RoundRefused if `sender_id` may not contribute to `round_id` now."""
        below = self._closed_below[phase]
        if round_id < below:
            raise RoundClosed(
                f"round {round_id} is closed here (this node is at round {below}); "
                "late contributions are never mixed into another round")
        if round_id >= below + self.window:
            raise RoundTooFar(
                f"round {round_id} is too far ahead (this node is at round {below}, "
                f"buffers {self.window} rounds); the sender must catch its peers up first")
        if sender_id in self._complete.get((phase, round_id), {}) or (phase, round_id, sender_id) in self._streaming:
            raise DuplicateContribution(f"round {round_id} already has a contribution from {sender_id}")

    def begin(self, round_id: int, sender_id: str, phase: Phase = Phase.WHOLE) -> None:
        self.check_open(round_id, sender_id, phase)
        self._streaming.add((phase, round_id, sender_id))

    def abort(self, round_id: int, sender_id: str, phase: Phase = Phase.WHOLE) -> None:
        self._streaming.discard((phase, round_id, sender_id))

    def finish(self, contribution: Contribution) -> None:
        """Store a complete contribution whose stream `begin` opened."""
        c = contribution
        self._streaming.discard((c.phase, c.round_id, c.sender_id))
        if c.round_id < self._closed_below[c.phase]:
            raise RoundClosed(f"round {c.round_id} closed while the contribution streamed")
        self._complete.setdefault((c.phase, c.round_id), {})[c.sender_id] = c
        self.notify()

    def add_own(self, contribution: Contribution) -> None:
        c = contribution
        self._complete.setdefault((c.phase, c.round_id), {})[c.sender_id] = c
        self.notify()

    def contributors(self, round_id: int, phase: Phase = Phase.WHOLE) -> set[str]:
        return set(self._complete.get((phase, round_id), {}))

    def changed(self) -> asyncio.Event:
        """Set at the next notify(): take it before evaluating a rule, then wait on it."""
        return self._changed

    def notify(self) -> None:
        """Wake collectors: a contribution arrived or membership changed."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def collect(
        self, round_id: int, *, phase: Phase = Phase.WHOLE, expected: Callable[[], set[str]], timeout_s: float,
        min_contributors: int = 1, on_extend: Callable[[], None] | None = None,
    ) -> dict[str, Contribution]:
        """Wait until every expected sender contributed, or the deadline; then close the round."""
        deadline = self.clock.now() + timeout_s
        while True:
            changed = self._changed
            have = self.contributors(round_id, phase)
            missing = expected() - have
            now = self.clock.now()
            if not missing and len(have) >= min_contributors:
                break
            if now >= deadline:
                if len(have) >= min_contributors:
                    logger.warning("round %d: deadline passed without %s; closing with %d contributors",
                                   round_id, ", ".join(sorted(missing)), len(have),
                                   extra=fields("deadline", round_id=round_id, missing=sorted(missing), contributors=len(have)))
                    break
                logger.warning("round %d: %d of --min-peers %d contributors; waiting %.0f s more",
                               round_id, len(have), min_contributors, timeout_s,
                               extra=fields("waiting_for_peers", round_id=round_id))
                deadline = now + timeout_s
                if on_extend is not None:
                    on_extend()  # keep pushing our contribution to peers that join meanwhile
            await self.clock.wait(changed, deadline - now)
        return self.close(round_id, phase)

    def close(self, round_id: int, phase: Phase = Phase.WHOLE) -> dict[str, Contribution]:
        """Close `round_id` of `phase` (and everything before it); return its contributions."""
        self._closed_below[phase] = max(self._closed_below[phase], round_id + 1)
        below = self._closed_below[phase]
        result = self._complete.pop((phase, round_id), {})
        for key in [k for k in self._complete if k[0] == phase and k[1] < below]:
            del self._complete[key]
        return result

    def reset(self, first_round: int) -> None:
        """Jump to another round (after a state transfer): drop everything buffered before it."""
        self._closed_below = dict.fromkeys(Phase, first_round)
        self._complete = {k: c for k, c in self._complete.items() if k[1] >= first_round}


def same_lineage(got: dict[str, Contribution], lineage: tuple[str, tuple[str, ...]]) -> dict[str, Contribution]:
    """Only contributions made from the same parameters, for the same members, are averaged."""
    kept = {k: c for k, c in got.items() if c.lineage == lineage}
    for sender in sorted(set(got) - set(kept)):
        c = got[sender]
        logger.warning("round %d: not averaging %s's %s: it was made from other parameters or "
                       "another membership; the repair rule will reconcile us", c.round_id, sender,
                       c.phase.label, extra=fields("other_lineage", round_id=c.round_id, peer_id=sender))
    return kept


def majority_lineage(got: dict[str, Contribution], base_digest: str | None) -> dict[str, Contribution]:
    """A round we listen to: contributions made from `base_digest` (the parameters we hold for
    its start; a member claiming another start counts nowhere), or with None from the start
    most senders share; for the membership most of them name (reduce-scatter)."""
    counts: dict[tuple[str, tuple[str, ...]], int] = {}
    for c in got.values():
        if base_digest is None or c.base_digest == base_digest:
            counts[c.lineage] = counts.get(c.lineage, 0) + 1
    best = min(counts, key=lambda k: (-counts[k], k)) if counts else (base_digest or "", ())
    return same_lineage(got, best)
