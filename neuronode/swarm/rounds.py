"""Contributions kept per round id, and the rule that closes a round.

Rules (docs/protocol.md repeats them):
- Round ids count completed rounds: the contribution made after k completed rounds is round k.
- Rounds below `closed_below` are closed: a contribution for them is refused and never mixed into
  a later round. Rounds at or beyond `closed_below + window` are too far ahead and refused; the
  ones in between are buffered, so a fast peer may send the next round before we finish this one.
- A round closes when every expected peer's contribution has arrived, or at the deadline if at
  least `min_contributors` have; with fewer the node keeps waiting (one more deadline at a time).
- A contribution still streaming when its round closes is discarded.

Memory: at most `window` rounds x (peers) complete contributions, each stored in its encoded
(wire) form, i.e. P x bytes-per-parameter of its codec; partial streams add at most one chunk
each beyond what they already stored.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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


@dataclass
class Contribution:
    """One complete, verified contribution. `data` is codec-specific (an Assembler)."""

    sender_id: str
    round_id: int
    codec: str
    weight: float
    data: Any
    base_digest: str = ""  # param_digest of the parameters the sender's round started from
    members: tuple[str, ...] = ()  # reduce-scatter: the round's members (sorted)
    contributors: tuple[str, ...] = ()  # reduce-scatter: whom an averaged shard averaged
    shard_index: int = 0


class RoundBook:
    """Per-round contribution store with deadline-bounded collection."""

    def __init__(self, *, closed_below: int, window: int = 2) -> None:
        self.closed_below = closed_below
        self.window = window
        self._complete: dict[int, dict[str, Contribution]] = {}
        self._streaming: set[tuple[int, str]] = set()
        self._changed = asyncio.Event()

    def check_open(self, round_id: int, sender_id: str) -> None:
        """Raise a RoundRefused if `sender_id` may not contribute to `round_id` now."""
        if round_id < self.closed_below:
            raise RoundClosed(
                f"round {round_id} is closed here (this node is at round {self.closed_below}); "
                "late contributions are never mixed into another round"
            )
        if round_id >= self.closed_below + self.window:
            raise RoundTooFar(
                f"round {round_id} is too far ahead (this node is at round {self.closed_below}, "
                f"buffers {self.window} rounds); the sender must catch its peers up first"
            )
        if sender_id in self._complete.get(round_id, {}) or (round_id, sender_id) in self._streaming:
            raise DuplicateContribution(f"round {round_id} already has a contribution from {sender_id}")

    def begin(self, round_id: int, sender_id: str) -> None:
        self.check_open(round_id, sender_id)
        self._streaming.add((round_id, sender_id))

    def abort(self, round_id: int, sender_id: str) -> None:
        self._streaming.discard((round_id, sender_id))

    def finish(self, contribution: Contribution) -> None:
        """Store a complete contribution whose stream `begin` opened."""
        key = (contribution.round_id, contribution.sender_id)
        self._streaming.discard(key)
        if contribution.round_id < self.closed_below:
            raise RoundClosed(f"round {contribution.round_id} closed while the contribution streamed")
        self._complete.setdefault(contribution.round_id, {})[contribution.sender_id] = contribution
        self.notify()

    def add_own(self, contribution: Contribution) -> None:
        self._complete.setdefault(contribution.round_id, {})[contribution.sender_id] = contribution
        self.notify()

    def contributors(self, round_id: int) -> set[str]:
        return set(self._complete.get(round_id, {}))

    def notify(self) -> None:
        """Wake collectors: a contribution arrived or membership changed."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def collect(
        self,
        round_id: int,
        *,
        expected: Callable[[], set[str]],
        timeout_s: float,
        min_contributors: int = 1,
        on_extend: Callable[[], None] | None = None,
    ) -> dict[str, Contribution]:
        """Wait until every expected sender contributed, or the deadline; then close the round."""
        deadline = time.monotonic() + timeout_s
        while True:
            changed = self._changed
            have = self.contributors(round_id)
            missing = expected() - have
            now = time.monotonic()
            if not missing and len(have) >= min_contributors:
                break
            if now >= deadline:
                if len(have) >= min_contributors:
                    logger.warning(
                        "round %d: deadline passed without %s; closing with %d contributors",
                        round_id, ", ".join(sorted(missing)), len(have),
                    )
                    break
                logger.warning(
                    "round %d: %d of --min-peers %d contributors; waiting %.0f s more",
                    round_id, len(have), min_contributors, timeout_s,
                )
                deadline = now + timeout_s
                if on_extend is not None:
                    on_extend()  # keep pushing our contribution to peers that join meanwhile
            try:
                await asyncio.wait_for(changed.wait(), timeout=max(0.0, deadline - now))
            except TimeoutError:
                pass
        return self.close(round_id)

    def close(self, round_id: int) -> dict[str, Contribution]:
        """Close `round_id` (and everything before it); return its contributions."""
        self.closed_below = max(self.closed_below, round_id + 1)
        result = self._complete.pop(round_id, {})
        for old in [r for r in self._complete if r < self.closed_below]:
            del self._complete[old]
        return result

    def reset(self, closed_below: int) -> None:
        """Jump to another round (after a state transfer): drop everything buffered."""
        self.closed_below = closed_below
        self._complete = {r: c for r, c in self._complete.items() if r >= closed_below}
