"""The agreement rule's counting (neuronode.averaging.agreement), pure: receipts listing the same
statements are counted once per list, and the result is what counting each receipt gives."""

from __future__ import annotations

import random

from neuronode.averaging.agreement import (
    Listings,
    Receipt,
    Statement,
    decide,
    statements_digest,
)
from neuronode.codec.contribution import Phase

LINEAGE = b"l" * 32


def statement(sender: str, body: bytes = b"b" * 32) -> Statement:
    return Statement(round_id=1, sender=sender, phase=Phase.WHOLE, shard_index=0, lineage=LINEAGE, body=body,
                     signature=sender.encode().ljust(64, b"s"))


def receipt(maker: str, statements: list[Statement]) -> Receipt:
    return Receipt(1, Phase.WHOLE, maker, tuple(sorted(statements, key=lambda s: s.slot)))


def naive_listers(receipts: list[Receipt]) -> dict[Statement, set[str]]:
    """The rule read literally: for every receipt, every statement not its maker's own."""
    listed: dict[Statement, set[str]] = {}
    for r in receipts:
        for s in r.statements:
            if s.sender != r.maker:
                listed.setdefault(s, set()).add(r.maker)
    return listed


def test_listings_count_each_maker_once_whatever_the_grouping() -> None:
    rng = random.Random(7)
    names = [f"m{i}" for i in range(12)]
    honest = {n: statement(n) for n in names}
    forged = {n: statement(n, body=b"x" * 32) for n in names[:3]}  # second versions: equivocators' statements
    for trial in range(200):
        receipts = []
        for maker in names:
            for _ in range(rng.choice([1, 1, 1, 2, 3])):  # some makers sent several versions
                pool = list(honest.values()) + list(forged.values())
                chosen = rng.sample(pool, rng.randrange(len(pool) + 1)) if rng.random() < 0.4 else list(honest.values())
                receipts.append(receipt(maker, chosen))
        listings = Listings(receipts)
        naive = naive_listers(receipts)
        assert listings.makers == {r.maker for r in receipts}
        for s in {*naive, *listings}:
            assert listings.count(s) == len(naive.get(s, set())), (trial, s.sender)
            assert listings.makers_of(s) == naive.get(s, set()), (trial, s.sender)
            for maker in names:
                assert listings.lists(maker, s) == any(r.maker == maker and s in r.statements for r in receipts)


def test_one_maker_with_two_versions_listing_a_statement_is_one_listing() -> None:
    """A liar that sends two versions of its receipt (to different members) cannot make a
    statement count on its own: both versions list it, but that is one maker's word."""
    x = statement("x")
    receipts = [receipt("liar", [x]), receipt("liar", [x, statement("liar")]), receipt("h", [statement("h")])]
    decision = decide(receipts, [], lineage=LINEAGE)
    assert ("x", 0) not in decision.agreed  # liar and h published: x needs both
    decision = decide([*receipts, receipt("g", [x])], [], lineage=LINEAGE)
    assert ("x", 0) in decision.agreed and decision.holders[("x", 0)] == ["g", "liar", "x"]


def test_receipts_of_members_holding_everything_form_one_list() -> None:
    """Every member's receipt lists its own statement too, so N members holding the same N
    contributions publish one list: Listings walks N statements once, not N times."""
    everyone = [statement(f"m{i}") for i in range(50)]
    receipts = [receipt(f"m{i}", everyone) for i in range(50)]
    assert len({r.digest for r in receipts}) == 1
    assert receipts[0].digest == statements_digest(receipts[0].statements)
    listings = Listings(receipts)
    assert len(listings._groups) == 1
    decision = decide(receipts, everyone[:1], lineage=LINEAGE)
    assert len(decision.agreed) == 50 and not decision.equivocators
    assert decision.holders[("m7", 0)] == sorted(f"m{i}" for i in range(50) if i != 7) + ["m7"]


def test_a_statement_of_another_lineage_is_no_evidence_of_equivocation() -> None:
    """x made round 1 in the lineage it repaired away from, then again in ours (it re-ran the
    round after a repair): two statements for one slot, but not in one lineage, so no lie. Only
    ours counts. Before, the two proved equivocation and x was left out and banned."""
    ours = statement("x")
    old = Statement(round_id=1, sender="x", phase=Phase.WHOLE, shard_index=0, lineage=b"m" * 32, body=b"o" * 32,
                    signature=b"x".ljust(64, b"o"))
    receipts = [receipt("a", [old]), receipt("b", [ours]), receipt("c", [ours])]
    decision = decide(receipts, [ours], lineage=LINEAGE)
    assert not decision.equivocators
    assert decision.agreed == {("x", 0): ours}
    forged = Statement(round_id=1, sender="x", phase=Phase.WHOLE, shard_index=0, lineage=LINEAGE, body=b"f" * 32,
                       signature=b"x".ljust(64, b"f"))
    assert "x" in decide([*receipts, receipt("d", [forged])], [ours], lineage=LINEAGE).equivocators  # in ours: a lie
