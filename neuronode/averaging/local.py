"""An in-process Transport: many members in one process, contributions handed over as records.

Used by tests (the averaging rules under a ManualClock, in milliseconds) and by `neuronode bench
swarm` (hundreds of members with stand-in training). A `LocalSwarm` knows every member's round
state; delivery files the sender's record in each target's book exactly as the gRPC transport
files a verified one (refusals included), and a member that `leave`s stops being alive.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from neuronode.averaging.book import RoundBook, RoundRefused
from neuronode.averaging.state import RoundState
from neuronode.averaging.transport import MemberView
from neuronode.clock import Clock
from neuronode.codec.contribution import Contribution, Phase


@dataclass
class Member:
    node_id: str
    state: RoundState
    book: RoundBook
    receipts: dict[int, frozenset[int]] = field(default_factory=dict)
    alive: bool = True
    delivered: int = 0  # contributions filed in this member's book
    refused: int = 0  # contributions its book refused (closed round, duplicate, too far ahead)


class LocalSwarm:
    """The members of one in-process swarm, and who may reach whom."""

    def __init__(self, *, clock: Clock | None = None, round_lag: int = 1) -> None:
        self.clock = clock or Clock()
        self.round_lag = round_lag
        self.members: dict[str, Member] = {}
        self.transports: list[LocalTransport] = []
        # (sender, receiver, phase) whose pushes fail; phase None: every phase
        self.cut: set[tuple[str, str, Phase | None]] = set()

    def join(self, node_id: str, *, state: RoundState | None = None) -> LocalTransport:
        state = state or RoundState()
        member = Member(node_id=node_id, state=state, book=RoundBook(first_round=state.round, clock=self.clock))
        self.members[node_id] = member
        transport = LocalTransport(self, member)
        self.transports.append(transport)
        state.on_change.append(self.news)
        self.news()
        return transport

    def leave(self, node_id: str) -> None:
        self.members[node_id].alive = False
        self.news()

    def news(self) -> None:
        """Membership or a round changed: open sends reach members they now owe, waits wake up."""
        for transport in self.transports:
            transport.push_pending()
        self.notify_all()

    def notify_all(self) -> None:
        for member in self.members.values():
            member.book.notify()

    def deliver(self, sender: str, to: str, contribution: Contribution) -> None:
        target = self.members.get(to)
        if target is None or not target.alive or {(sender, to, None), (sender, to, contribution.phase)} & self.cut:
            return
        c = replace(contribution, frames=[])  # what a receiver holds: the record, no frames
        try:
            target.book.begin(c.round_id, c.sender_id, c.phase)
            target.book.finish(c)
        except RoundRefused:
            target.refused += 1
            target.book.abort(c.round_id, c.sender_id, c.phase)
            return
        target.delivered += 1


@dataclass
class Delivery:
    """averaging.Sending for the local transport. Its window stays open (members that appear
    meanwhile get it too) until we send for a round two rounds later, as the gRPC outbox keeps it."""

    round_id: int
    phase: Phase
    outs: Contribution | Mapping[str, Contribution]
    members: tuple[str, ...]
    delivered: set[str] = field(default_factory=set)

    def extend(self) -> None:
        pass


class LocalTransport:
    """averaging.Transport for one member of a LocalSwarm."""

    def __init__(self, swarm: LocalSwarm, member: Member) -> None:
        self.swarm = swarm
        self.member = member
        self.open: list[Delivery] = []

    @property
    def node_id(self) -> str:
        return self.member.node_id

    @property
    def book(self) -> RoundBook:
        return self.member.book

    def others(self) -> list[Member]:
        return [m for m in self.swarm.members.values() if m.alive and m.node_id != self.node_id]

    def round_peers(self, round_id: int) -> set[str]:
        lag = self.swarm.round_lag
        return {m.node_id for m in self.others()
                if round_id - lag <= m.state.round <= round_id + 1 and m.state.contributes_from <= round_id}

    def alive(self) -> set[str]:
        return {m.node_id for m in self.others()}

    def link_rate(self) -> float:
        return 0.0

    def send(self, round_id: int, phase: Phase, outs: Contribution | Mapping[str, Contribution], *,
             members: tuple[str, ...] = ()) -> Delivery:
        delivery = Delivery(round_id, phase, outs, members)
        self.open = [d for d in self.open if d.round_id >= round_id - 1] + [delivery]
        self.push_pending()
        return delivery

    def push_pending(self) -> None:
        for d in self.open:
            if isinstance(d.outs, Contribution):
                targets = set(d.members) - {self.node_id} if d.members else self.round_peers(d.round_id)
                if d.phase == Phase.AVERAGED:  # and the round's listeners
                    targets |= {m.node_id for m in self.others() if m.state.contributes_from == d.round_id + 1}
                outs = dict.fromkeys(targets, d.outs)
            else:
                outs = dict(d.outs)
            for to in sorted(set(outs) & self.alive() - d.delivered):
                d.delivered.add(to)
                self.swarm.deliver(self.node_id, to, outs[to])

    def publish_receipt(self, round_id: int, shards: frozenset[int]) -> None:
        self.member.receipts[round_id] = shards
        self.swarm.notify_all()

    def member_views(self, round_id: int, members: tuple[str, ...]) -> list[MemberView]:
        views = []
        for node_id in members:
            if node_id == self.node_id:
                continue
            m = self.swarm.members.get(node_id)
            present = m is not None and m.alive and m.state.contributes_from <= round_id
            views.append(MemberView(member=node_id, present=present,
                                    receipt=m.receipts.get(round_id) if m is not None else None,
                                    past_round=m is not None and m.state.round > round_id))
        return views
