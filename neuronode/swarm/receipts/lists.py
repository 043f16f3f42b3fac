"""Compact receipts rebuilt into their lists (neuronode.swarm.receipts.receipts keeps the receipts).

A receipt to a live peer travels as its list's digest alone, or with an 8-byte id per statement
(neuronode.swarm.receipts.wire). The receiver rebuilds the list from lists it knows (its own
receipt's first) or from their statements by id. What it cannot rebuild waits here, its maker's
signature already checked, and once we are ready for that round's phase (our own receipt of it
is out, or we read its receipts) we ask the maker for it: the ids first, then the statements
whole (NodeInfo.wanted). So a member asks at most twice per distinct list, and every receipt
naming a list rebuilds once the list came.
"""

from __future__ import annotations

from collections.abc import Callable

from neuronode.averaging.agreement import Statement, statements_digest
from neuronode.codec.contribution import Phase
from neuronode.swarm.receipts.wire import ID_BYTES, MAX_WANTED, receipt_from_pb, short_id
from neuronode.swarm.wire import MAX_ID_CHARS, Refusal
from neuronode.v1 import node_pb2 as pb

Slot = tuple[int, Phase, str]  # (round, phase, maker)
MAX_PENDING_PER_SLOT = 4  # versions of one maker's receipt kept waiting (two already prove a lie)


class ReceiptLists:
    """The lists we know by digest, and the compact receipts waiting for theirs."""

    def __init__(self, *, want: Callable[[str], None]) -> None:
        self.want = want  # greet this maker: we want one of its lists
        self._lists: dict[bytes, tuple[int, tuple[Statement, ...]]] = {}  # digest -> (round, statements)
        self._pool: dict[tuple[int, Phase], dict[bytes, Statement]] = {}  # statements by short id
        self._pending: dict[tuple[Slot, bytes], tuple[pb.Receipt, bytes]] = {}  # -> (receipt, maker's key)
        self._wanted: dict[Slot, tuple[bytes, bool]] = {}  # -> (digest, whole: the ids did not rebuild it)
        self._asked: dict[tuple[bytes, bool], int] = {}  # what we greeted a maker for at once -> round
        self._ids_failed: dict[bytes, int] = {}  # digests whose ids did not rebuild -> round
        self._ready: set[tuple[int, Phase]] = set()  # rounds' phases we ask for at once
        self._fresh: set[tuple[int, Phase]] = set()  # rounds' phases with a list learned since `fresh()`

    def rebuild(self, m: pb.Receipt) -> tuple[bytes, tuple[Statement, ...]] | None:
        """(digest, list) of a wire receipt: its statements when it carries them (refused when
        they do not hash to the digest it names), a list we know by its digest, or one rebuilt
        from its short ids; None when we lack a statement it lists (we ask for it whole). A list
        it brings is learned (`learn`)."""
        phase = Phase(m.phase)
        known = self._lists.get(m.listed_digest)
        if known is not None:  # the signature covers the digest: its list is the one we know
            return m.listed_digest, known[1]
        if m.statements or not m.listed_digest:
            receipt = receipt_from_pb(m)
            if m.listed_digest and receipt.digest != m.listed_digest:
                raise Refusal("INVALID_ARGUMENT", f"receipt of round {m.round} from {m.maker_id[:MAX_ID_CHARS]}: its "
                              "statements do not hash to the digest it names")
            self.learn(m.round, phase, receipt.digest, receipt.statements)
            return receipt.digest, receipt.statements
        pool = self._pool.get((m.round, phase), {})
        ids = m.statement_ids
        found = [pool.get(ids[i:i + ID_BYTES]) for i in range(0, len(ids), ID_BYTES)]
        if any(s is None for s in found):
            return None
        statements = tuple(s for s in found if s is not None)
        if statements_digest(statements) != m.listed_digest:
            return None  # an id collision, or a lie: the list whole settles it
        self.learn(m.round, phase, m.listed_digest, statements)
        return m.listed_digest, statements

    def learn(self, round_id: int, phase: Phase, digest: bytes, statements: tuple[Statement, ...]) -> None:
        """A list whose digest we checked: compact receipts naming it, or its statements, rebuild
        now (`fresh`, then `rebuildable`)."""
        if digest in self._lists:
            return
        self._lists[digest] = (round_id, statements)
        self._fresh.add((round_id, phase))
        pool = self._pool.setdefault((round_id, phase), {})
        for s in statements:
            pool.setdefault(short_id(s), s)

    def fresh(self) -> list[tuple[int, Phase]]:
        """Rounds' phases with lists learned since last asked, whose waiting receipts may rebuild now."""
        out, self._fresh = sorted(self._fresh), set()
        return [key for key in out if any(slot[:2] == key for slot, _ in self._pending)]

    def rebuildable(self, round_id: int, phase: Phase) -> list[tuple[pb.Receipt, bytes]]:
        """The waiting receipts of `round_id`'s `phase` that rebuild now, with their makers' keys
        (they stay waiting until `rebuilt`)."""
        out = []
        for (slot, _), (m, key) in list(self._pending.items()):
            if slot[:2] == (round_id, phase) and (slot, m.listed_digest) in self._pending:
                try:
                    if self.rebuild(m) is not None:
                        out.append((m, key))
                except Refusal:
                    self._pending.pop((slot, m.listed_digest), None)
        return out

    def rebuilt(self, slot: Slot, digest: bytes) -> None:
        """The receipt of `slot` naming `digest` is read (or refused): it waits no more, nor do we want its list."""
        self._pending.pop((slot, digest), None)
        if self._wanted.get(slot, (b"",))[0] == digest:
            del self._wanted[slot]

    def pend(self, slot: Slot, m: pb.Receipt, key: bytes) -> None:
        """Keep a compact receipt we cannot rebuild (its maker's signature checked), and want its
        list: the ids when only its digest came, the statements whole when ids came and did not
        rebuild it. Asked for at once when we are ready for its round's phase, else once we are."""
        if len([k for k in self._pending if k[0] == slot]) >= MAX_PENDING_PER_SLOT:
            return
        digest = m.listed_digest
        if m.statement_ids:
            self._ids_failed[digest] = slot[0]
        self._pending[(slot, digest)] = (m, key)
        self._wanted[slot] = (digest, digest in self._ids_failed)
        self.ask(slot[0], slot[1])

    def waiting(self, round_id: int, phase: Phase) -> set[str]:
        """Makers with a receipt of `round_id`'s `phase` waiting for its list."""
        return {slot[2] for slot, _ in self._pending if slot[:2] == (round_id, phase)}

    def ready(self, round_id: int, phase: Phase) -> None:
        """Our own receipt of `round_id`'s `phase` is out (it may well be the same list: nothing
        to ask before), or we read the round's receipts: what we cannot rebuild we ask for now."""
        if (round_id, phase) not in self._ready:
            self._ready.add((round_id, phase))
            self.ask(round_id, phase)

    def ask(self, round_id: int, phase: Phase) -> None:
        """Greet the first maker of each list we want, once."""
        if (round_id, phase) not in self._ready:
            return
        for slot, want in sorted(self._wanted.items()):
            if slot[:2] == (round_id, phase) and want not in self._asked:
                self._asked[want] = round_id
                self.want(slot[2])

    def wanted(self, to: str | None) -> list[pb.ReceiptEcho]:
        """The lists we ask `to` for (None: of every maker), for a Hello (NodeInfo.wanted)."""
        wanted = [pb.ReceiptEcho(round=slot[0], phase=int(slot[1]), maker_id=slot[2], receipt_hash=digest,  # type: ignore[arg-type]
                                 whole=whole)
                  for slot, (digest, whole) in sorted(self._wanted.items())
                  if (to is None or slot[2] == to) and (slot[0], slot[1]) in self._ready]
        return wanted[:MAX_WANTED]

    def prune(self, recent: Callable[[int], bool]) -> None:
        """Forget rounds that are not `recent`."""
        for key in [k for k in self._pending if not recent(k[0][0])]:
            del self._pending[key]
        for slot in [k for k in self._wanted if not recent(k[0])]:
            del self._wanted[slot]
        for marks in (self._asked, self._ids_failed):
            for mark in [k for k, round_id in marks.items() if not recent(round_id)]:
                del marks[mark]  # type: ignore[arg-type]
        self._ready = {k for k in self._ready if recent(k[0])}
        self._fresh = {k for k in self._fresh if recent(k[0])}
        for pool_key in [k for k in self._pool if not recent(k[0])]:
            del self._pool[pool_key]
        for digest in [d for d, (round_id, _) in self._lists.items() if not recent(round_id)]:
            del self._lists[digest]
