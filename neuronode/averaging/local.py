"""An in-process Transport: many members in one process, contributions handed over as records.

Used by tests (the averaging rules under a ManualClock, in milliseconds) and by `neuronode bench
swarm` (hundreds of members with stand-in training). A `LocalSwarm` knows every member's round
state; delivery files the sender's record in each target's book exactly as the gRPC transport
files a verified one (refusals included), and a member that `leave`s stops being alive. Under
gather (`gather_makers`), a member forwards every whole contribution it files to its children in
the maker's tree (neuronode.averaging.sortition), as the gRPC transport does.

Bytes are counted per member as they would cross the wire (`Member.bytes_up`, `bytes_down`): a
contribution's payload plus CHUNK_HEADER_BYTES per chunk, each time it is delivered, forwarded or
fetched; a receipt RECEIPT_BYTES plus STATEMENT_BYTES per statement it lists, once per other
live member that may read it (its list whole: the gRPC transport often sends only its digest).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from neuronode.averaging.agreement import Receipt, Statement, statement_of
from neuronode.averaging.book import RoundBook, RoundRefused
from neuronode.averaging.sortition import Draws
from neuronode.averaging.state import RoundState
from neuronode.averaging.transport import MemberView
from neuronode.clock import Clock
from neuronode.codec.contribution import Contribution, Phase
from neuronode.quorum import reached, voice

CHUNK_HEADER_BYTES = 240  # a chunk's header: ids, digests, the maker's signature, framing
RECEIPT_BYTES = 200  # a receipt's own fields and signature
STATEMENT_BYTES = 210  # one statement a receipt lists


def wire_bytes(c: Contribution) -> int:
    return c.data.held_bytes + CHUNK_HEADER_BYTES * c.data.count


def receipt_bytes(r: Receipt) -> int:
    return RECEIPT_BYTES + STATEMENT_BYTES * len(r.statements)


@dataclass
class Member:
    node_id: str
    state: RoundState
    book: RoundBook
    receipts: dict[tuple[int, Phase], Receipt] = field(default_factory=dict)  # what it published
    retained: dict[Statement, tuple[Contribution, float]] = field(default_factory=dict)  # served until
    kept: dict[int, list[Contribution]] = field(default_factory=dict)  # round -> kept for catching up
    banned: set[str] = field(default_factory=set)  # members it caught equivocating
    alive: bool = True
    delivered: int = 0  # contributions filed in this member's book
    refused: int = 0  # contributions its book refused (closed round, duplicate, too far ahead)
    bytes_up: int = 0  # what it sent (module docstring)
    bytes_down: int = 0  # what it received
    messages: int = 0  # control messages it received: receipts, fetch requests answered


class LocalSwarm:
    """The members of one in-process swarm, and who may reach whom."""

    def __init__(self, *, clock: Clock | None = None, round_lag: int = 1, gather_makers: int = 0) -> None:
        self.clock = clock or Clock()
        self.round_lag = round_lag
        self.gather_makers = gather_makers  # gather's K: members forward whole contributions (0: they do not)
        self.members: dict[str, Member] = {}
        self.transports: list[LocalTransport] = []
        self.by_id: dict[str, LocalTransport] = {}
        self.published: dict[tuple[int, Phase], set[str]] = {}  # who published a receipt (Member.receipts)
        # (sender, receiver, phase) whose pushes fail; phase None: every phase
        self.cut: set[tuple[str, str, Phase | None]] = set()
        # (maker, receiver) -> the receipt that receiver sees instead of what maker published (a liar)
        self.told: dict[tuple[str, str], Receipt] = {}
        self.fetches = 0  # contributions members fetched from one another
        self.receipts_published = 0  # receipts members published
        self.receipts_delivered = 0  # each published receipt once per other live member (who may read it)
        # (sender, receiver) -> the contribution that receiver gets instead of what sender sent (a liar)
        self.forged: dict[tuple[str, str], Contribution] = {}
        self.undialable: set[str] = set()  # members behind NAT: never reducers (they still reach everyone)
        self.hosts: dict[str, str] = {}  # member -> the host it calls from (neuronode.quorum); none: its own

    def join(self, node_id: str, *, state: RoundState | None = None) -> LocalTransport:
        state = state or RoundState()
        member = Member(node_id=node_id, state=state, book=RoundBook(first_round=state.round, clock=self.clock))
        self.members[node_id] = member
        transport = LocalTransport(self, member)
        self.transports.append(transport)
        self.by_id[node_id] = transport
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

    def reaches(self, sender: str, to: str, phase: Phase) -> bool:
        """Whether `sender` can reach `to` (alive, and no fault cuts the pair)."""
        target = self.members.get(to)
        return target is not None and target.alive and not {(sender, to, None), (sender, to, phase)} & self.cut

    def deliver(self, sender: str, to: str, contribution: Contribution) -> None:
        """`sender` streams `contribution` to `to` (its own, or one it forwards)."""
        if not self.reaches(sender, to, contribution.phase):
            return
        target = self.members[to]
        if sender in target.banned or contribution.sender_id in target.banned:
            target.refused += 1
            return
        forged = self.forged.get((sender, to))
        if forged is not None and (forged.round_id, forged.phase) == (contribution.round_id, contribution.phase):
            contribution = forged
        c = replace(contribution, frames=[])  # what a receiver holds: the record, no frames
        try:
            target.book.begin(c.round_id, c.sender_id, c.phase, via="" if sender == c.sender_id else sender)
            size = wire_bytes(c)
            self.members[sender].bytes_up += size
            target.bytes_down += size
            target.book.finish(c)
        except RoundRefused:
            target.refused += 1
            target.book.abort(c.round_id, c.sender_id, c.phase)
            return
        target.delivered += 1
        if self.gather_makers and c.phase == Phase.WHOLE:
            for child in self.by_id[to].children(c):
                self.deliver(to, child, c)


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
        self.draws = Draws(swarm.gather_makers)  # gather: the trees we forward down

    def children(self, c: Contribution) -> list[str]:
        """Where we forward a maker's whole contribution under gather (our children in its tree)."""
        draw = self.draws.current(c.round_id, c.base_digest, self.round_peers(c.round_id) | {self.node_id})
        return draw.children(c.sender_id, self.node_id, self.swarm.gather_makers)

    @property
    def node_id(self) -> str:
        return self.member.node_id

    @property
    def book(self) -> RoundBook:
        return self.member.book

    def others(self) -> list[Member]:
        return [m for m in self.swarm.members.values()
                if m.alive and m.node_id != self.node_id and m.node_id not in self.member.banned]

    def round_peers(self, round_id: int) -> set[str]:
        lag = self.swarm.round_lag
        return {m.node_id for m in self.others()
                if round_id - lag <= m.state.round <= round_id + 1 and m.state.contributes_from <= round_id}

    def alive(self) -> set[str]:
        return {m.node_id for m in self.others()}

    def moved_past(self, round_id: int) -> bool:
        at = reached((self.voice(m.node_id), m.state.round) for m in self.others())
        return at is not None and at > round_id + self.swarm.round_lag - 1

    def reducers(self, members: Iterable[str]) -> set[str]:
        return set(members) - self.swarm.undialable

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
                # Whole contributions go to every live peer not behind (listeners too), as the
                # gRPC transport pushes them; reduce-scatter parts to the members.
                lag = self.swarm.round_lag
                targets = set(d.members) - {self.node_id} if d.members else {
                    m.node_id for m in self.others() if m.state.round + lag >= d.round_id}
                if d.phase == Phase.AVERAGED:  # and the round's listeners
                    targets |= {m.node_id for m in self.others() if m.state.contributes_from == d.round_id + 1}
                outs = dict.fromkeys(targets, d.outs)
            else:
                outs = dict(d.outs)
            for to in sorted(set(outs) - d.delivered - {self.node_id}):
                m = self.swarm.members.get(to)
                if m is None or not m.alive or to in self.member.banned:
                    continue
                d.delivered.add(to)
                self.swarm.deliver(self.node_id, to, outs[to])

    def publish_receipt(self, receipt: Receipt) -> Receipt:
        standing = self.member.receipts.setdefault((receipt.round_id, receipt.phase), receipt)
        if standing is receipt:
            swarm = self.swarm
            swarm.published.setdefault((receipt.round_id, receipt.phase), set()).add(self.node_id)
            readers = [m for m in swarm.members.values() if m.alive and m is not self.member]
            size = receipt_bytes(receipt)
            self.member.bytes_up += size * len(readers)
            for m in readers:
                m.bytes_down += size
                m.messages += 1
            swarm.receipts_published += 1
            swarm.receipts_delivered += len(readers)
            swarm.notify_all()
        return standing

    def voice(self, member: str) -> str:
        return voice(member, self.swarm.hosts.get(member, ""))

    def own_host(self) -> str:
        return self.swarm.hosts.get(self.node_id, "")

    def receipts(self, round_id: int, phase: Phase) -> list[Receipt]:
        published = self.swarm.published.get((round_id, phase), set())
        lied = {maker for maker, to in self.swarm.told if to == self.node_id}
        out = []
        for maker in sorted(published | lied):
            if maker == self.node_id:
                continue
            told = self.swarm.told.get((maker, self.node_id))
            receipt = told if told is not None and told.round_id == round_id else \
                self.swarm.members[maker].receipts.get((round_id, phase))
            if receipt is not None and receipt.phase == phase:
                out.append(receipt)
        return out

    def member_views(self, round_id: int, phase: Phase, members: Iterable[str]) -> list[MemberView]:
        makers = {r.maker for r in self.receipts(round_id, phase)}
        views = []
        for node_id in sorted(set(members)):
            if node_id == self.node_id:
                continue
            m = self.swarm.members.get(node_id)
            present = m is not None and m.alive and m.state.contributes_from <= round_id
            views.append(MemberView(member=node_id, present=present, has_receipt=node_id in makers,
                                    past_round=m is not None and m.state.round > round_id))
        return views

    async def fetch(self, statement: Statement, holders: list[str], *, timeout_s: float) -> Contribution | None:
        now = self.swarm.clock.now()
        for holder in holders:
            m = self.swarm.members.get(holder)
            if m is None or not m.alive or {(holder, self.node_id, None), (holder, self.node_id, statement.phase)} & self.swarm.cut:
                continue
            kept = m.retained.get(statement)
            if kept is not None and kept[1] > now:
                self.swarm.fetches += 1
                size = wire_bytes(kept[0])
                m.bytes_up += size
                self.member.bytes_down += size
                m.messages += 1  # the request it answered
                return replace(kept[0], frames=[])
        return None

    def retain(self, round_id: int, phase: Phase, contributions: Iterable[Contribution], *, for_s: float) -> None:
        """As neuronode.swarm.streams.missed keeps them: the phase's latest round only."""
        until = self.swarm.clock.now() + for_s
        kept = self.member.retained
        for s in [s for s in kept if s.phase == phase and s.round_id <= round_id]:
            del kept[s]
        for c in contributions:
            kept[statement_of(c)] = (c, until)

    def keep_round(self, round_id: int, contributions: Iterable[Contribution]) -> None:
        self.member.kept[round_id] = list(contributions)

    async def fetch_update(self, round_id: int, holders: list[str], *, base_digest: str,
                           timeout_s: float) -> Contribution | None:
        for holder in holders:
            m = self.swarm.members.get(holder)
            if m is None or not m.alive:
                continue
            for c in m.kept.get(round_id, []):
                if c.phase == Phase.UPDATE and c.sender_id == holder and c.base_digest == base_digest:
                    self.swarm.fetches += 1
                    return replace(c, frames=[])
        return None

    def equivocated(self, member: str, proof: tuple[Statement, Statement]) -> None:
        self.member.banned.add(member)
