"""What the averaging protocols need from the network, and nothing more (no gRPC here).

`neuronode.swarm.node.SwarmNode` implements it over gRPC; tests and `neuronode bench` drive
the protocols over the same objects. Arrivals go into the transport's `book`, which the
protocols collect from; the transport also calls `book.notify()` whenever membership changes,
so every rule waiting on the book re-evaluates.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from neuronode.averaging.book import RoundBook
from neuronode.codec.contribution import Contribution, Phase


@dataclass(frozen=True)
class MemberView:
    """What we know of one reduce-scatter member when agreeing on a round's shards."""

    member: str
    present: bool  # alive, not leaving, and taking part in the round (not only listening)
    receipt: frozenset[int] | None  # the averaged shards it says it received, if published
    past_round: bool  # it already moved past the round (one that did so without a receipt
    #                   listened or repaired: none will come)


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

    def link_rate(self) -> float:
        """Bytes/s our sends reach together (0: not measured yet)."""

    def send(self, round_id: int, phase: Phase, outs: Contribution | Mapping[str, Contribution], *,
             members: tuple[str, ...] = ()) -> Sending:
        """Deliver our contribution of `round_id`: one for every live peer of the round, or one
        per member (reduce-scatter slices), or one for the members (and the round's listeners:
        averaged shards). Peers that appear while the window is open get it too."""

    def publish_receipt(self, round_id: int, shards: frozenset[int]) -> None:
        """Tell the members which averaged shards of `round_id` we received."""

    def member_views(self, round_id: int, members: tuple[str, ...]) -> list[MemberView]:
        """What every member but us said about `round_id` (receipts, presence)."""
