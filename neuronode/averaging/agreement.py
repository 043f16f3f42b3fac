"""Which contributions a round averages: agreed from the members' receipts. Pure: no network.

Every contribution comes with its maker's signed `Statement` (round, sender, phase, shard, the
lineage it was made in and a hash of everything else). When a member closes a phase of a round
(whole contributions under all-to-all, averaged shards under reduce-scatter) it publishes a
`Receipt`: the statements of the contributions it holds, its own included (so that members
holding the same contributions publish the same list, which the rule counts once: `Listings`).
Receipts are counted by the ids that made them, not by host (neuronode.quorum counts hosts
for every vote a node takes alone): what a round averages must come out the same at every
member, and the host a member is seen at is not the same everywhere (a member behind NAT is
seen at its router by its carriers, under its carrier's host by the members it reaches only
through a relay), so counting hosts here would let members holding the same receipts decide
differently. The rule (`decide`):

- A statement counts when receipts of at least `LISTINGS` makers other than its sender list it
  (every other maker, when fewer published one). Never on its maker's word: a member that
  pushes its contribution to one peer only is left out by everyone alike, and one that pushes
  it to several is in for everyone, since the members that missed it fetch it from a holder.
  A fixed count, not a majority: receipts say a contribution can be fetched, not that it is
  good, and many ids on one host can then neither keep an honest contribution out (by listing
  nothing) nor get more than their own in (which --max-weight and the aggregator bound).
- A maker with two different statements for one (round, phase, shard) in our lineage
  equivocated: the two signatures prove it to anyone, so every member leaves all its
  contributions of the round out alike, and bans it. A statement of another lineage is no
  evidence (a member that re-runs a round after a repair makes one), and never counts.
- Only statements of our lineage count (made from the parameters and for the members we
  averaged from).

Why this keeps replicas identical with one lying member: a receipt adds a statement only in
company (two listings), and every honest member publishes its receipt to all, so what
counts does not depend on which version of a liar's receipt a member got. A liar's receipt can
only matter for a contribution that a bare quorum of honest members received besides its maker
(SECURITY.md says what remains). A contribution that counts but that we could not fetch in time
leaves our replica apart; the repair rule then reconciles it.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from neuronode.codec.contribution import Contribution, Phase
from neuronode.quorum import by_id

LISTINGS = 2  # listings, by makers other than the sender, that make a statement count


def lineage_hash(base_digest: str, members: Iterable[str]) -> bytes:
    """What a contribution was made for: the parameters it started from and the members."""
    return _lineage_hash(base_digest, tuple(members))


@functools.lru_cache(maxsize=64)  # a round has one or two lineages, asked for once per contribution
def _lineage_hash(base_digest: str, members: tuple[str, ...]) -> bytes:
    return hashlib.sha256(json.dumps([base_digest, list(members)], separators=(",", ":")).encode()).digest()


def body_hash(*, digest: str, codec: str, weight: float, n_elements: int, contributors: Iterable[str],
              host: str = "") -> bytes:
    """Everything else a contribution's maker vouches for (the float exactly, as hex), the host
    it names included: two hosts for one slot are two statements, an equivocation."""
    return _body_hash(digest, codec, float(weight), int(n_elements), tuple(contributors), host)


@functools.lru_cache(maxsize=4096)  # a member asks for each of a round's N contributions several times
def _body_hash(digest: str, codec: str, weight: float, n_elements: int, contributors: tuple[str, ...],
               host: str) -> bytes:
    fields = [digest, codec, weight.hex(), n_elements, list(contributors), host]
    return hashlib.sha256(json.dumps(fields, separators=(",", ":")).encode()).digest()


@dataclass(frozen=True)
class Statement:
    """A contribution's maker's word on what it is (see the module docstring). Equal statements
    are the same contribution; the signature is the maker's over them (Ed25519 signs
    deterministically, so it adds nothing to equality)."""

    round_id: int
    sender: str
    phase: Phase
    shard_index: int
    lineage: bytes
    body: bytes
    signature: bytes = field(default=b"", compare=False, repr=False)
    public_key: bytes = field(default=b"", compare=False, repr=False)

    @property
    def slot(self) -> tuple[str, int]:
        """One contribution per (sender, shard) and round phase: two statements for a slot prove a lie."""
        return (self.sender, self.shard_index)


def statement_of(c: Contribution) -> Statement:
    """The statement of a contribution record (its signature, when the record carries one)."""
    return Statement(round_id=c.round_id, sender=c.sender_id, phase=c.phase, shard_index=c.shard_index,
                     lineage=lineage_hash(c.base_digest, c.members),
                     body=body_hash(digest=c.digest, codec=c.codec, weight=c.weight, n_elements=c.n_elements,
                                    contributors=c.contributors, host=c.host),
                     signature=c.signature, public_key=c.public_key)


def statements_digest(statements: Iterable[Statement]) -> bytes:
    """sha256 of a list of statements (signatures included): what a receipt's signature covers
    of them, and how receipts listing the same statements are told apart from the rest."""
    return hashlib.sha256(json.dumps(
        [[s.sender, int(s.phase), int(s.shard_index), s.lineage.hex(), s.body.hex(), s.signature.hex()]
         for s in statements], separators=(",", ":")).encode()).digest()


@dataclass(frozen=True)
class Receipt:
    """What one member (`maker`) holds of one round's phase: its contributions' statements.
    `listed_digest` is `statements_digest(statements)` when the maker's list is not at hand (a
    receipt kept as proof only) or was already computed; `digest` computes it otherwise."""

    round_id: int
    phase: Phase
    maker: str
    statements: tuple[Statement, ...]  # sorted by slot
    signature: bytes = field(default=b"", compare=False, repr=False)
    public_key: bytes = field(default=b"", compare=False, repr=False)
    listed_digest: bytes = field(default=b"", compare=False, repr=False)

    @functools.cached_property
    def digest(self) -> bytes:
        return self.listed_digest or statements_digest(self.statements)


def receipt_of(round_id: int, phase: Phase, maker: str, held: Iterable[Contribution]) -> Receipt:
    """Our receipt: the statements of what we hold, ours included (it counts nowhere, but
    members that hold the same then list the same)."""
    statements = sorted((statement_of(c) for c in held), key=lambda s: s.slot)
    return Receipt(round_id=round_id, phase=phase, maker=maker, statements=tuple(statements))


class Listings:
    """Who lists which statement, over receipts of one round's phase, counted once per distinct
    list: with N makers that mostly hold the same N statements this is O(N) work, not O(N²).
    Makers count by id (the module docstring says why): a maker's listing of its own statement
    counts nowhere, and a maker that published several lists (it equivocated) counts once per
    statement whichever list it."""

    def __init__(self, receipts: Iterable[Receipt]) -> None:
        self.voice_of = voice_of = by_id
        groups: dict[bytes, tuple[tuple[Statement, ...], set[str]]] = {}
        for r in receipts:
            groups.setdefault(r.digest, (r.statements, set()))[1].add(r.maker)
        self.makers: set[str] = set().union(*(who for _, who in groups.values()))
        self.voices: set[str] = {voice_of(m) for m in self.makers}
        self._makers = [who for _, who in groups.values()]  # by group
        voiced = [{voice_of(m) for m in who} for _, who in groups.values()]
        seen: dict[str, int] = {}
        for vs in voiced:
            for v in vs:
                seen[v] = seen.get(v, 0) + 1
        several = {v for v, n in seen.items() if n > 1}
        self._groups = [(statements, vs - several) for (statements, _), vs in zip(groups.values(), voiced, strict=True)]
        self._in: dict[Statement, list[int]] = {}  # statement -> the groups listing it
        self._count: dict[Statement, int] = {}
        for g, (statements, once) in enumerate(self._groups):
            for s in statements:
                self._in.setdefault(s, []).append(g)
                self._count[s] = self._count.get(s, 0) + len(once) - (voice_of(s.sender) in once)
        self._several: dict[str, set[Statement]] = {}
        for (statements, _), vs in zip(groups.values(), voiced, strict=True):
            for v in vs & several:
                self._several.setdefault(v, set()).update(statements)
        for v, listed in self._several.items():
            for s in listed:
                if voice_of(s.sender) != v:
                    self._count[s] += 1

    def __iter__(self) -> Iterator[Statement]:
        return iter(self._count)

    def count(self, s: Statement) -> int:
        """Voices other than its sender's that list `s`."""
        return self._count.get(s, 0)

    def need(self, s: Statement) -> int:
        """Listings `s` needs to count: LISTINGS, or every maker but its sender when fewer
        published a receipt."""
        return min(LISTINGS, len(self.voices - {self.voice_of(s.sender)}))

    def makers_of(self, s: Statement) -> set[str]:
        """The makers other than its sender that list `s` (O(N): ask for few statements)."""
        return set().union(*(self._makers[g] for g in self._in.get(s, ()))) - {s.sender}

    def lists(self, maker: str, s: Statement) -> bool:
        return any(maker in self._makers[g] for g in self._in.get(s, ()))


def listed(receipts: Iterable[Receipt], lineage: bytes | None = None, *, at_least: int | None = None) -> set[str]:
    """Senders whose contributions the receipts (made for `lineage`, when given) list: by
    `Listings.need` makers (`at_least` None: they count, and a member that
    lacks one fetches it), or by `at_least` makers."""
    listings = Listings(receipts)
    return {s.sender for s in listings if lineage in (None, s.lineage)
            and listings.count(s) >= (listings.need(s) if at_least is None else at_least)}


class Holders(Mapping[tuple[str, int], list[str]]):
    """Who holds each agreed contribution (the makers listing it, then its sender), worked out
    for the slots asked for only: a member fetches a few, and there are N of them."""

    def __init__(self, agreed: dict[tuple[str, int], Statement], listings: Listings) -> None:
        self._agreed = agreed
        self._listings = listings

    def __getitem__(self, slot: tuple[str, int]) -> list[str]:
        s = self._agreed[slot]
        return sorted(self._listings.makers_of(s)) + [s.sender]

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return iter(self._agreed)

    def __len__(self) -> int:
        return len(self._agreed)


@dataclass(frozen=True)
class Decision:
    """What a round's phase averages, by slot, and who listed each (they hold it: we may fetch
    from them); the makers proven to have equivocated, with the two statements that prove it."""

    agreed: dict[tuple[str, int], Statement]
    holders: Mapping[tuple[str, int], list[str]]
    equivocators: dict[str, tuple[Statement, Statement]]


def decide(receipts: Iterable[Receipt], held: Iterable[Statement], *, lineage: bytes) -> Decision:
    """The rule of the module docstring over every receipt we hold of one round's phase
    (several versions of one maker's included, ours too) and `held`: the statements of what we
    hold (ours included), which count like any listed one; one that no maker but its sender
    published a receipt for (it is alone in the round, or we only listen to its maker) needs
    no listing."""
    listings = Listings(receipts)
    by_slot: dict[tuple[str, int], list[Statement]] = {}
    for s in {*held, *listings}:
        if s.lineage == lineage:  # another lineage's statement is no evidence, and counts nowhere
            by_slot.setdefault(s.slot, []).append(s)
    equivocators: dict[str, tuple[Statement, Statement]] = {}
    for slot, versions in sorted(by_slot.items()):
        if len(versions) > 1 and slot[0] not in equivocators:
            a, b = sorted(versions, key=lambda s: s.body)[:2]
            equivocators[slot[0]] = (a, b)
    agreed: dict[tuple[str, int], Statement] = {}
    for slot, (s, *_) in sorted(by_slot.items()):
        if s.sender not in equivocators and listings.count(s) >= listings.need(s):
            agreed[slot] = s
    return Decision(agreed=agreed, holders=Holders(agreed, listings), equivocators=equivocators)
