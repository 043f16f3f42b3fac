"""Receipts members tell each other (neuronode.averaging.agreement says what they decide;
neuronode.swarm.receipts.wire their wire forms).

Ours are signed and ride in every Hello we send (NodeInfo.receipts, a few recent rounds). A
member's receipts reach us in its own Hellos: we check the maker's signature and the signature
of every statement it lists (each is its sender's word, whoever relays it), and keep every
version a maker sent us. We also tell everyone a hash of each receipt we hold (NodeInfo.echoes);
a member holding another version of that receipt publishes it (NodeInfo.disputed), so whoever
then holds two versions signed by one maker has the proof that it told members different things,
and bans it. Only versions received from their maker count in a round's decision; relayed ones
serve as proof.

A receipt lists N statements of about 210 bytes: sent whole to every member every round, that is
O(N²) bytes per member. So a receipt to a live peer travels as its list's digest alone (which
the signature covers; members mostly hold the same list), or with 8 bytes per statement
(`short_id`) to a peer whose own receipt shows its list differs. The receiver rebuilds the list
(neuronode.swarm.receipts.lists: what it cannot rebuild waits there, its signature checked, and
is asked for). Lists are worked on once per distinct list, not per receipt. Whose signatures and
keys count: neuronode.swarm.receipts.checks.
"""

from __future__ import annotations

import bisect
import logging
import random
from collections.abc import Callable
from dataclasses import replace

from neuronode.averaging.agreement import Receipt, Statement, statements_digest
from neuronode.codec.contribution import Phase
from neuronode.events import fields
from neuronode.swarm.context import Context
from neuronode.swarm.membership.table import fanout
from neuronode.swarm.receipts.checks import ReceiptChecks
from neuronode.swarm.receipts.lists import ReceiptLists, Slot
from neuronode.swarm.receipts.wire import (
    MAX_DISPUTED,
    MAX_ECHOES,
    RECEIPT_ROUNDS,
    receipt_to_pb,
)
from neuronode.swarm.wire import Refusal
from neuronode.v1 import node_pb2 as pb

logger = logging.getLogger(__name__)

KEEP_ROUNDS = 8  # rounds of other members' receipts we keep
MAX_VERSIONS_HEARD = 4  # echoed hashes we remember per receipt slot
EQUIVOCATION_BAN_S = 3600.0  # a member caught signing two versions of one thing


class Receipts:
    """Our receipts, and what members told us of theirs (see the module docstring)."""

    def __init__(self, ctx: Context, *, on_change: Callable[[], None],
                 on_want: Callable[[str], None] = lambda maker: None) -> None:
        self.ctx = ctx
        self.on_change = on_change  # a receipt arrived or a member was banned: waits re-evaluate
        self.on_want = on_want  # greet `maker`: we want its list
        self.own: dict[tuple[int, Phase], Receipt] = {}
        # Receipts as their makers signed them, every version: from the maker itself, and relayed
        # (a relayed one may come without its list: it is proof only).
        self.held: dict[Slot, dict[bytes, Receipt]] = {}
        self.relayed: dict[Slot, dict[bytes, Receipt]] = {}
        self.disputes: dict[bytes, Receipt] = {}  # versions we hold that an echo contradicted
        self.checks = ReceiptChecks(ctx)  # whose signatures and keys count
        # Lists we know (our own receipts', every one we rebuilt or got whole), and compact
        # receipts waiting for theirs.
        self.lists = ReceiptLists(want=lambda maker: self.on_want(maker))
        self._wants: dict[str, dict[tuple[int, Phase], bool]] = {}  # peer -> our receipts it asked for (whole?)
        # What each peer already has from us (`fill(to=...)`): our receipts it echoed back in
        # its latest Hello, and how far into `_log` (every version we came to hold, in order)
        # our echoes to it went. Heartbeats then carry only news: O(1) bytes, not O(N).
        self._own_hash: dict[tuple[int, Phase], bytes] = {}
        self._acked: dict[str, set[bytes]] = {}
        self._log: list[tuple[int, Slot, bytes]] = []  # (seq, slot, hash)
        self._seq = 0
        self._echoed_to: dict[str, int] = {}
        self._heard: dict[Slot, set[bytes]] = {}  # echoes members sent us, by slot
        self._targets: dict[bytes, frozenset[str] | None] = {}  # receipt hash -> whom our echo goes to (None: all)
        self._draw = random.SystemRandom()  # unpredictable to others (echo_targets)
        self._ids: tuple[int, list[str]] = (0, [])  # the peer table's ids, as of its size then

    # ---- ours ----------------------------------------------------------------------------------

    def publish(self, receipt: Receipt) -> Receipt:
        """Sign and announce our receipt; returns the one that stands for us (the first of its
        round's phase), on which we decide too."""
        key = (receipt.round_id, receipt.phase)
        if key in self.own and self.own[key].digest != receipt.digest:
            # A round run again after a repair: a second, different receipt of it (it lists our
            # new contribution) would be two signed versions, which members ban as equivocation.
            # Our word on that round stays the first.
            logger.info("round %d: keeping the receipt we published before for its %ss", receipt.round_id,
                        receipt.phase.label, extra=fields("receipt_kept", round_id=receipt.round_id))
            return self.own[key]
        security = self.ctx.security
        signed = replace(receipt, public_key=security.key.public, listed_digest=receipt.digest)
        signed = replace(signed, signature=security.sign_receipt(signed))
        self.own[key] = signed
        self._own_hash[key] = security.receipt_hash(signed)
        self.lists.learn(receipt.round_id, receipt.phase, signed.digest, signed.statements)
        self.retry()
        self.lists.ready(receipt.round_id, receipt.phase)  # what our list did not rebuild, we ask for now
        for phase in Phase:
            for old in sorted(k for k in self.own if k[1] == phase)[:-RECEIPT_ROUNDS]:
                del self.own[old]
                self._own_hash.pop(old, None)
        return signed

    def fill(self, info: pb.NodeInfo, *, to: str | None = None) -> int:
        """Our receipts, echoes, disputes and wants into a NodeInfo we send; to peer `to`, only
        what it lacks: our receipts it did not echo back yet, compact (module docstring), and
        echoes we did not send it yet (and, always, echoes of its own receipts: its
        acknowledgement). To anyone else (`to` None): everything, whole. Returns the mark to
        pass to `sent(to, mark)` once the message was delivered."""
        newest = self.ctx.state.round
        acked = self._acked.get(to, set()) if to is not None else set()
        for key in sorted(self.own):
            if self._own_hash.get(key) not in acked:
                info.receipts.append(receipt_to_pb(self.own[key], self.form(key, to)))
        since = self._echoed_to.get(to, 0) if to is not None else 0
        start = bisect.bisect_right(self._log, since, key=lambda entry: entry[0])
        fresh = {(slot, h) for _, slot, h in self._log[start:]
                 if to is None or (targets := self._targets.get(h)) is None or to in targets}
        if to is not None:  # its own receipts, whatever we sent before: that is how it knows we hold them
            fresh |= {((round_id, phase, to), h) for round_id in range(newest - RECEIPT_ROUNDS, newest + RECEIPT_ROUNDS + 1)
                      for phase in (Phase.WHOLE, Phase.AVERAGED) for h in self.held.get((round_id, phase, to), {})}
        echoes = [pb.ReceiptEcho(round=round_id, phase=int(phase), maker_id=maker, receipt_hash=h)  # type: ignore[arg-type]
                  for (round_id, phase, maker), h in sorted(fresh)
                  if round_id + RECEIPT_ROUNDS > newest and (round_id, phase, maker) in self.held]
        info.echoes.extend(echoes[-MAX_ECHOES:])
        info.disputed.extend(receipt_to_pb(r, "digest") for r in list(self.disputes.values())[-MAX_DISPUTED:])
        info.wanted.extend(self.lists.wanted(to))
        return self._seq

    def echo_targets(self, receipt_hash: bytes) -> frozenset[str] | None:
        """Whom our echo of a receipt we came to hold goes to: fanout(N) of the N peers we know,
        drawn once, unpredictably to others (a liar cannot pick whom a version it sent reaches);
        None, everyone, up to fanout(N) peers. A maker that told members A one version and members
        B another is then still caught unless no echo crosses between them: probability at most
        about exp(−2·fanout·|A|·|B| / N) (docs/protocol.md, "Equivocating receipts")."""
        table = self.ctx.table
        n = len(table.peers)
        k = fanout(n, table.min_fanout)
        if k >= n:
            return None
        if self._ids[0] != n:  # sampling needs a sequence: rebuilt when the table grows or shrinks
            self._ids = (n, list(table.peers))
        return frozenset(self._draw.sample(self._ids[1], k))

    def form(self, key: tuple[int, Phase], to: str | None) -> str:
        """How our receipt of `key` travels to `to` (receipt_to_pb): whole to anyone but a live
        peer; to a live peer what it asked for (ids, or whole), else the digest alone (members
        mostly hold the same list), or ids when its own receipt tells us its list differs."""
        if to is None:
            return "full"
        asked = self._wants.get(to, {}).get(key)
        if asked is not None:
            return "full" if asked else "ids"
        theirs = self.held.get((key[0], key[1], to), {})
        return "ids" if theirs and all(r.digest != self.own[key].digest for r in theirs.values()) else "digest"

    def sent(self, to: str, mark: int) -> None:
        """`to` received what `fill(to=to)` returned `mark` for."""
        self._echoed_to[to] = max(self._echoed_to.get(to, 0), mark)

    def forget(self, peer_id: str) -> None:
        """A peer that is new or back (it restarted, or we had lost it) holds nothing of ours."""
        self._acked.pop(peer_id, None)
        self._echoed_to.pop(peer_id, None)

    # ---- theirs --------------------------------------------------------------------------------

    def receipts(self, round_id: int, phase: Phase) -> list[Receipt]:
        """Every version of every maker's receipt of `round_id`'s `phase` that reached us from
        its maker, as statements we checked against their sender's key: the one it is bound to
        here, or for a named id we never met, the one a quorum of makers vouch for (`vouched`).
        Receipts listing one list share one checked tuple (work once per distinct list)."""
        self.lists.ready(round_id, phase)  # a member still collecting reads them too (what others hold counts)
        versions = [r for (rd, ph, _), held in self.held.items() if rd == round_id and ph == phase
                    for r in held.values()]
        vouched = self.checks.vouched(versions)
        views: dict[bytes, tuple[tuple[Statement, ...], bytes]] = {}
        out = []
        for r in versions:
            if r.digest not in views:
                kept = self.checks.checked(r.statements, vouched)
                views[r.digest] = (kept, r.digest if len(kept) == len(r.statements) else statements_digest(kept))
            kept, digest = views[r.digest]
            out.append(replace(r, statements=kept, listed_digest=digest))
        return out

    def makers(self, round_id: int, phase: Phase) -> set[str]:
        return {maker for (rd, ph, maker) in self.held if rd == round_id and ph == phase}

    def coming(self, round_id: int, phase: Phase) -> set[str]:
        """Makers whose receipt of `round_id`'s `phase` we keep but cannot read yet: its list is
        asked for. A member that moved past the round sent it all the same, and a round deciding
        without it may miss a second version of a contribution (a late member did, in CI)."""
        return self.lists.waiting(round_id, phase) - self.makers(round_id, phase)

    def take(self, info: pb.NodeInfo) -> None:
        """What a member's (verified) Hello says of receipts; raises Refusal for a receipt that
        is not its maker's, or lists a statement its sender did not sign."""
        for m in info.receipts:
            if m.maker_id != info.node_id or m.public_key != info.public_key:
                raise Refusal("INVALID_ARGUMENT", "a Hello's receipts are its sender's own (others' travel as disputes)")
            if self.recent(m.round):
                self.take_own(m, info.public_key)
        for m in info.disputed:
            key = self.checks.key_of(m.maker_id, m.public_key)
            if key is not None and m.maker_id != self.ctx.cfg.node_id and self.recent(m.round):
                self.keep(self.checks.proof(m, key), self.relayed)
        me = self.ctx.cfg.node_id
        self._acked[info.node_id] = {e.receipt_hash for e in info.echoes if e.maker_id == me}
        self._wants[info.node_id] = {(w.round, Phase(w.phase)): w.whole for w in info.wanted
                                     if w.maker_id == me and w.phase in (Phase.WHOLE, Phase.AVERAGED)}
        for e in info.echoes:
            slot = (e.round, Phase(e.phase), e.maker_id)
            if e.maker_id == me or not self.recent(e.round):
                continue
            if e.maker_id in self.ctx.table.peers:  # a member's (bounded: not any id a Hello names)
                heard = self._heard.setdefault(slot, set())
                if len(heard) < MAX_VERSIONS_HEARD:  # two already prove a lie
                    heard.add(e.receipt_hash)
            for h, r in self.held.get(slot, {}).items():
                if h != e.receipt_hash:
                    self.disputes.setdefault(h, r)
        self.prune()

    def take_own(self, m: pb.Receipt, key: bytes) -> None:
        """A maker's receipt from the maker: kept once its list is at hand (module docstring)."""
        slot = (m.round, Phase(m.phase), m.maker_id)
        rebuilt = self.lists.rebuild(m)
        if rebuilt is None:
            self.checks.proof(m, key)  # its maker's signature over the digest: a forgery is refused now
            self.lists.pend(slot, m, key)
            return
        receipt = Receipt(round_id=m.round, phase=Phase(m.phase), maker=m.maker_id, statements=rebuilt[1],
                          signature=m.signature, public_key=m.public_key, listed_digest=rebuilt[0])
        self.checks.check(receipt, key)
        self.lists.rebuilt(slot, rebuilt[0])
        self.keep(receipt, self.held)
        self.retry()

    def retry(self) -> None:
        """Take the waiting receipts that lists learned since the last call now rebuild."""
        for round_id, phase in self.lists.fresh():
            for m, key in self.lists.rebuildable(round_id, phase):
                slot = (m.round, Phase(m.phase), m.maker_id)
                try:
                    self.take_own(m, key)
                except Refusal as exc:
                    self.lists.rebuilt(slot, m.listed_digest)
                    logger.warning("round %d: not taking the receipt of %s: %s", slot[0], slot[2], exc,
                                   extra=fields("refused", what="receipt", peer_id=slot[2], detail=str(exc)))

    def keep(self, r: Receipt, store: dict[Slot, dict[bytes, Receipt]]) -> None:
        slot = (r.round_id, r.phase, r.maker)
        digest = self.ctx.security.receipt_hash(r)
        versions = store.setdefault(slot, {})
        if digest in versions:
            return
        versions[digest] = r
        if store is self.held:
            self._seq += 1
            self._log.append((self._seq, slot, digest))
            self._targets[digest] = self.echo_targets(digest)
            if any(h != digest for h in self._heard.get(slot, ())):  # a member echoed another version
                self.disputes.setdefault(digest, r)
        if len({**self.held.get(slot, {}), **self.relayed.get(slot, {})}) > 1:
            self.equivocated(*slot)
        self.on_change()

    def equivocated(self, round_id: int, phase: Phase, maker: str) -> None:
        """Two versions of one receipt, both signed by `maker`: ban it (everyone holding the
        proof does, and our disputes carry it to the rest)."""
        if self.ctx.table.ban(maker, EQUIVOCATION_BAN_S):
            logger.warning("round %d: %s signed two different receipts of its %ss; banning it for %.0f s",
                           round_id, maker, phase.label, EQUIVOCATION_BAN_S,
                           extra=fields("equivocation", round_id=round_id, peer_id=maker, what="receipt"))
        for store in (self.held, self.relayed):
            for digest, r in store.get((round_id, phase, maker), {}).items():
                self.disputes.setdefault(digest, r)

    def recent(self, round_id: int) -> bool:
        """Receipts of rounds near ours only: a member naming a far round cannot push the rest out."""
        now = self.ctx.state.round
        return now - KEEP_ROUNDS < round_id <= now + RECEIPT_ROUNDS

    def prune(self) -> None:
        for store in (self.held, self.relayed):
            for slot in [k for k in store if not self.recent(k[0])]:
                del store[slot]
        for digest in [d for d, r in self.disputes.items() if not self.recent(r.round_id)]:
            del self.disputes[digest]
        for slot in [k for k in self._heard if not self.recent(k[0])]:
            del self._heard[slot]
        self.lists.prune(self.recent)
        if self._log and not self.recent(self._log[0][1][0]):
            self._log = [entry for entry in self._log if self.recent(entry[1][0])]
            self._targets = {h: self._targets.get(h) for _, _, h in self._log}
        known = self.ctx.table.peers
        if len(self._acked) + len(self._echoed_to) + len(self._wants) > 3 * len(known) + 64:  # peers forgotten since
            self._acked = {p: hashes for p, hashes in self._acked.items() if p in known}
            self._echoed_to = {p: mark for p, mark in self._echoed_to.items() if p in known}
            self._wants = {p: keys for p, keys in self._wants.items() if p in known}
        self.checks.prune(self.recent)
