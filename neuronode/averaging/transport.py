"""What the averaging protocols need from the network, and nothing more (no gRPC here).

`neuronode.swarm.node.SwarmNode` implements it over gRPC; tests and `neuronode bench` drive
the protocols over the same objects. Arrivals go into the transport's `book`, which the
protocols collect from; the transport also calls `book.notify()` whenever membership changes,
so every rule waiting on the book re-evaluates.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from neuronode.averaging.agreement import Receipt, Statement
from neuronode.averaging.book import RoundBook
from neuronode.codec.contribution import Contribution, Phase


@dataclass(frozen=True)
class MemberView:
    """What we know of one member of a round when waiting for its receipt."""

    member: str
    present: bool  # alive, not leaving, and taking part in the round (not only listening)
    has_receipt: bool  # we hold its receipt of the round's phase
    past_round: bool  # it already moved past the round, and no receipt of it is on its way
    #                   (one that moved on without one listened or repaired: none will come)


class Sending(Protocol):
    """A contribution being delivered in the background until the round's push window closes."""

    def extend(self) -> None:
        """Keep the window open one more --sync-timeout (the round waits for --min-peers)."""


class Transport(Protocol):
    """Delivery of contributions to the members of a round, and what members say."""

    @property
    def node_id(self) -> str: ...

    @property
    def book(self) -> RoundBook: ...

    def round_peers(self, round_id: int) -> set[str]:
        """Live peers (not us) whose contribution to `round_id` we wait for."""

    def alive(self) -> set[str]:
        """Live peers (not us)."""

    def moved_past(self, round_id: int) -> bool:
        """A quorum of the other live hosts is past `round_id`: waiting for --min-peers in it is
        waiting for nobody (we catch up, or repair, at the next round's start)."""

    def reducers(self, members: Iterable[str]) -> set[str]:
        """Which of `members` (us included) peers can dial: the reducers under reduce-scatter."""

    def link_rate(self) -> float:
        """Bytes/s our sends reach together (0: not measured yet)."""

    def send(self, round_id: int, phase: Phase, outs: Contribution | Mapping[str, Contribution], *,
             members: tuple[str, ...] = ()) -> Sending:
        """Deliver our contribution of `round_id`: one for every live peer of the round, or one
        per member (reduce-scatter slices), or one for the members (and the round's listeners:
        averaged shards). Peers that appear while the window is open get it too."""

    def publish_receipt(self, receipt: Receipt) -> Receipt:
        """Sign our receipt of a round's phase and tell every member (and listener); returns
        the receipt that stands for us: the first we published of that round's phase."""

    def voice(self, member: str) -> str:
        """Who `member` counts as in a vote (neuronode.quorum: its host; per id on loopback)."""

    def own_host(self) -> str:
        """The host our peers agree they see our connections come from (an IP; "" on loopback or
        while unknown): our contributions name it, and the average weighs us under it."""

    def receipts(self, round_id: int, phase: Phase) -> list[Receipt]:
        """Every receipt of others we hold of `round_id`'s `phase` (every version of a maker's)."""

    def member_views(self, round_id: int, phase: Phase, members: Iterable[str]) -> list[MemberView]:
        """What we know of every member but us in `round_id` (receipt, presence)."""

    async def fetch(self, statement: Statement, holders: list[str], *, timeout_s: float) -> Contribution | None:
        """The contribution `statement` names, from the first of `holders` that serves it (its
        maker's signature checked), or None by the deadline."""

    def retain(self, round_id: int, phase: Phase, contributions: Iterable[Contribution], *, for_s: float) -> None:
        """Serve these contributions of `round_id`'s `phase` (instead of any retained before) to
        members that missed them, for `for_s`."""

    def keep_round(self, round_id: int, contributions: Iterable[Contribution]) -> None:
        """Keep what a member catching up needs of `round_id` for the last few rounds (our
        averaged update, signed here, or the round's agreed contributions): served to it."""

    async def fetch_update(self, round_id: int, holders: list[str], *, base_digest: str,
                           timeout_s: float) -> Contribution | None:
        """The averaged update of `round_id` the first of `holders` that keeps one applied (made
        from `base_digest`, signed by it), or None by the deadline."""

    def equivocated(self, member: str, proof: tuple[Statement, Statement]) -> None:
        """`member` signed both statements of `proof`: ban it."""
