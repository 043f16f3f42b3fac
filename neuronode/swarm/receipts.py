"""Receipts on the wire (neuronode.averaging.agreement says what they decide).

Ours are signed and ride in every Hello we send (NodeInfo.receipts, a few recent rounds). A
member's receipts reach us in its own Hellos: we check the maker's signature and the signature
of every statement it lists (each is its sender's word, whoever relays it), and keep every
version a maker sent us. We also tell everyone a hash of each receipt we hold (NodeInfo.echoes);
a member holding another version of that receipt publishes it (NodeInfo.disputed), so whoever
then holds two versions signed by one maker has the proof that it told members different things,
and bans it. Only versions received from their maker count in a round's decision; relayed ones
serve as proof.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import replace

from neuronode.averaging.agreement import QUORUM, Receipt, Statement
from neuronode.codec.contribution import Phase
from neuronode.events import fields
from neuronode.security.auth import AuthError
from neuronode.security.identity import derived_id, is_derived
from neuronode.swarm.context import Context
from neuronode.swarm.membership import MAX_MEMBERS
from neuronode.swarm.wire import MAX_ID_CHARS, MAX_PEERS_LISTED, Refusal
from neuronode.v1 import node_pb2 as pb

logger = logging.getLogger(__name__)

RECEIPT_ROUNDS = 3  # rounds per phase whose receipts a node announces (the slowest member decides 2x --sync-timeout late)
MAX_RECEIPTS = 2 * RECEIPT_ROUNDS  # in one NodeInfo (two phases)
KEEP_ROUNDS = 8  # rounds of other members' receipts we keep
MAX_ECHOES = 1024
MAX_DISPUTED = 8
MAX_VERSIONS_HEARD = 4  # echoed hashes we remember per receipt slot
EQUIVOCATION_BAN_S = 3600.0  # a member caught signing two versions of one thing


def statement_to_pb(s: Statement) -> pb.Statement:
    return pb.Statement(sender_id=s.sender, phase=int(s.phase), shard_index=s.shard_index,  # type: ignore[arg-type]
                        lineage=s.lineage, body=s.body, signature=s.signature, public_key=s.public_key)


def statement_from_pb(m: pb.Statement, round_id: int) -> Statement:
    return Statement(round_id=round_id, sender=m.sender_id, phase=Phase(m.phase), shard_index=m.shard_index,
                     lineage=m.lineage, body=m.body, signature=m.signature, public_key=m.public_key)


def receipt_to_pb(r: Receipt) -> pb.Receipt:
    return pb.Receipt(round=r.round_id, phase=int(r.phase), maker_id=r.maker,  # type: ignore[arg-type]
                      statements=[statement_to_pb(s) for s in r.statements], signature=r.signature,
                      public_key=r.public_key)


def receipt_from_pb(m: pb.Receipt) -> Receipt:
    return Receipt(round_id=m.round, phase=Phase(m.phase), maker=m.maker_id,
                   statements=tuple(statement_from_pb(s, m.round) for s in m.statements),
                   signature=m.signature, public_key=m.public_key)


def check_sizes(info: pb.NodeInfo) -> None:
    """Refuse a Hello whose receipts, echoes or disputes exceed what an honest node sends."""
    receipts = [*info.receipts, *info.disputed]
    if (len(info.receipts) > MAX_RECEIPTS or len(info.disputed) > MAX_DISPUTED or len(info.echoes) > MAX_ECHOES
            or any(r.phase not in (Phase.WHOLE, Phase.AVERAGED) or len(r.statements) > MAX_MEMBERS
                   or len(r.maker_id) > MAX_ID_CHARS for r in receipts)
            or any(len(s.sender_id) > MAX_ID_CHARS or s.shard_index >= MAX_PEERS_LISTED or s.phase != r.phase
                   or len(s.lineage) != 32 or len(s.body) != 32 for r in receipts for s in r.statements)
            or any(len(e.maker_id) > MAX_ID_CHARS or len(e.receipt_hash) != 32 for e in info.echoes)):
        raise Refusal("INVALID_ARGUMENT", f"hello carries at most {MAX_RECEIPTS} receipts of at most "
                      f"{MAX_MEMBERS} statements (whole or averaged phase, 32-byte hashes), "
                      f"{MAX_ECHOES} echoes and {MAX_DISPUTED} disputed receipts")


class Receipts:
    """Our receipts, and what members told us of theirs (see the module docstring)."""

    def __init__(self, ctx: Context, *, on_change: Callable[[], None]) -> None:
        self.ctx = ctx
        self.on_change = on_change  # a receipt arrived or a member was banned: waits re-evaluate
        self.own: dict[tuple[int, Phase], pb.Receipt] = {}
        # Receipts as their makers signed them, every version: from the maker itself, and relayed.
        self.held: dict[tuple[int, Phase, str], dict[bytes, pb.Receipt]] = {}
        self.relayed: dict[tuple[int, Phase, str], dict[bytes, pb.Receipt]] = {}
        self.disputes: dict[bytes, pb.Receipt] = {}  # versions we hold that an echo contradicted
        self._verified: dict[tuple[str, bytes], int] = {}  # (sender, signature) of statements checked -> round
        # What each peer already has from us (`fill(to=...)`): our receipts it echoed back in
        # its latest Hello, and how far into `_log` (every version we came to hold, in order)
        # our echoes to it went. Heartbeats then carry only news: O(1) bytes, not O(N).
        self._own_hash: dict[tuple[int, Phase], bytes] = {}
        self._acked: dict[str, set[bytes]] = {}
        self._log: list[tuple[int, tuple[int, Phase, str], bytes]] = []  # (seq, slot, hash)
        self._seq = 0
        self._echoed_to: dict[str, int] = {}
        self._heard: dict[tuple[int, Phase, str], set[bytes]] = {}  # echoes members sent us, by slot

    # ---- ours ----------------------------------------------------------------------------------

    def publish(self, receipt: Receipt) -> None:
        security = self.ctx.security
        signed = replace(receipt, public_key=security.key.public)
        signed = replace(signed, signature=security.sign_receipt(signed))
        key = (receipt.round_id, receipt.phase)
        self.own[key] = receipt_to_pb(signed)
        self._own_hash[key] = security.receipt_hash(signed)
        for phase in Phase:
            for old in sorted(k for k in self.own if k[1] == phase)[:-RECEIPT_ROUNDS]:
                del self.own[old]
                self._own_hash.pop(old, None)

    def fill(self, info: pb.NodeInfo, *, to: str | None = None) -> int:
        """Our receipts, echoes and disputes into a NodeInfo we send; to peer `to`, only what
        it lacks: our receipts it did not echo back yet, echoes we did not send it yet (and,
        always, echoes of its own receipts: its acknowledgement). Returns the mark to pass to
        `sent(to, mark)` once the message was delivered."""
        newest = self.ctx.state.round
        acked = self._acked.get(to, set()) if to is not None else set()
        info.receipts.extend(self.own[k] for k in sorted(self.own) if self._own_hash.get(k) not in acked)
        since = self._echoed_to.get(to, 0) if to is not None else 0
        start = bisect.bisect_right(self._log, since, key=lambda entry: entry[0])
        fresh = {(slot, h) for _, slot, h in self._log[start:]}
        if to is not None:  # its own receipts, whatever we sent before: that is how it knows we hold them
            fresh |= {(slot, h) for slot, versions in self.held.items() if slot[2] == to for h in versions}
        echoes = [pb.ReceiptEcho(round=round_id, phase=int(phase), maker_id=maker, receipt_hash=h)  # type: ignore[arg-type]
                  for (round_id, phase, maker), h in sorted(fresh)
                  if round_id + RECEIPT_ROUNDS > newest and (round_id, phase, maker) in self.held]
        info.echoes.extend(echoes[-MAX_ECHOES:])
        info.disputed.extend(list(self.disputes.values())[-MAX_DISPUTED:])
        return self._seq

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
        here, or for a named id we never met, the one a quorum of makers vouch for (`vouched`)."""
        versions = [m for (rd, ph, _), held in self.held.items() if rd == round_id and ph == phase
                    for m in held.values()]
        vouched = self.vouched(versions)
        return [self.view(m, vouched) for m in versions]

    def vouched(self, versions: list[pb.Receipt]) -> dict[str, bytes]:
        """For each named id we never met (it stopped greeting before we joined, or we share no
        relay with it), the one key statements of it carry in the receipts of at least QUORUM
        makers. Members list only what they received from a maker they met, so a quorum's key is
        as good as the listing rule itself; one maker's word (a liar naming its own key for an
        absent member, to fake its equivocation) is not enough. The binding itself still comes
        only from the member's own Hello."""
        keys: dict[str, dict[bytes, set[str]]] = {}
        for m in versions:
            for s in m.statements:
                if len(s.public_key) == 32 and self.unbound(s.sender_id):
                    keys.setdefault(s.sender_id, {}).setdefault(s.public_key, set()).add(m.maker_id)
        vouched = {}
        for sender, by_key in keys.items():
            strong = [key for key, makers in by_key.items() if len(makers) >= QUORUM]
            if len(strong) == 1:
                vouched[sender] = strong[0]
        return vouched

    def unbound(self, node_id: str) -> bool:
        """A named id whose key we do not know (never met; not one a key proves)."""
        if node_id == self.ctx.cfg.node_id or is_derived(node_id):
            return False
        peer = self.ctx.table.peers.get(node_id)
        return peer is None or not peer.public_key

    def makers(self, round_id: int, phase: Phase) -> set[str]:
        return {maker for (rd, ph, maker) in self.held if rd == round_id and ph == phase}

    def take(self, info: pb.NodeInfo) -> None:
        """What a member's (verified) Hello says of receipts; raises Refusal for a receipt that
        is not its maker's, or lists a statement its sender did not sign."""
        for m in info.receipts:
            if m.maker_id != info.node_id or m.public_key != info.public_key:
                raise Refusal("INVALID_ARGUMENT", "a Hello's receipts are its sender's own (others' travel as disputes)")
            if self.recent(m.round):
                self.check(m, info.public_key)
                self.keep(m, self.held)
        for m in info.disputed:
            key = self.key_of(m.maker_id, m.public_key)
            if key is not None and m.maker_id != self.ctx.cfg.node_id and self.recent(m.round):
                self.check(m, key)
                self.keep(m, self.relayed)
        me = self.ctx.cfg.node_id
        self._acked[info.node_id] = {e.receipt_hash for e in info.echoes if e.maker_id == me}
        for e in info.echoes:
            slot = (e.round, Phase(e.phase), e.maker_id)
            if e.maker_id == me or not self.recent(e.round):
                continue
            if e.maker_id in self.ctx.table.peers:  # a member's (bounded: not any id a Hello names)
                heard = self._heard.setdefault(slot, set())
                if len(heard) < MAX_VERSIONS_HEARD:  # two already prove a lie
                    heard.add(e.receipt_hash)
            for h, m in self.held.get(slot, {}).items():
                if h != e.receipt_hash:
                    self.disputes.setdefault(h, m)
        self.prune()

    def check(self, m: pb.Receipt, key: bytes) -> None:
        """Raise Refusal unless `m` carries `key`'s signature and every statement in it whose
        sender's key we know carries that sender's."""
        try:
            self.ctx.security.check_receipt(receipt_from_pb(m), key)
        except AuthError as exc:
            raise Refusal("PERMISSION_DENIED", f"receipt of round {m.round} from {m.maker_id[:MAX_ID_CHARS]}: {exc}") from None
        if len(self.view(m).statements) < sum(self.key_of(s.sender_id, s.public_key) is not None for s in m.statements):
            raise Refusal("PERMISSION_DENIED", f"receipt of round {m.round} from {m.maker_id[:MAX_ID_CHARS]} lists a "
                          "statement its sender did not sign")

    def view(self, m: pb.Receipt, vouched: dict[str, bytes] | None = None) -> Receipt:
        """`m` less the statements we cannot check, or whose signature does not verify."""
        receipt = receipt_from_pb(m)
        kept = []
        for s in receipt.statements:
            key = self.key_of(s.sender, s.public_key)
            if key is None and vouched and vouched.get(s.sender) == s.public_key and self.unbound(s.sender):
                key = s.public_key
            if key is None:
                continue
            if (s.sender, s.signature) not in self._verified:
                try:
                    self.ctx.security.check_statement(s, key)
                except AuthError:
                    continue
                self._verified[(s.sender, s.signature)] = m.round
            kept.append(s)
        return replace(receipt, statements=tuple(kept))

    def key_of(self, node_id: str, public_key: bytes) -> bytes | None:
        """The key `node_id` speaks with: the one it is bound to here, or the one its derived id
        proves; None when neither (a named id we never met, or a key that is not its own)."""
        if node_id == self.ctx.cfg.node_id:
            return self.ctx.security.key.public if public_key == self.ctx.security.key.public else None
        peer = self.ctx.table.peers.get(node_id)
        if peer is not None and peer.public_key:
            return peer.public_key if public_key == peer.public_key else None
        if is_derived(node_id) and len(public_key) == 32 and derived_id(public_key) == node_id:
            return public_key
        return None

    def keep(self, m: pb.Receipt, store: dict[tuple[int, Phase, str], dict[bytes, pb.Receipt]]) -> None:
        slot = (m.round, Phase(m.phase), m.maker_id)
        digest = self.ctx.security.receipt_hash(receipt_from_pb(m))
        versions = store.setdefault(slot, {})
        if digest in versions:
            return
        versions[digest] = m
        if store is self.held:
            self._seq += 1
            self._log.append((self._seq, slot, digest))
            if any(h != digest for h in self._heard.get(slot, ())):  # a member echoed another version
                self.disputes.setdefault(digest, m)
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
            for digest, m in store.get((round_id, phase, maker), {}).items():
                self.disputes.setdefault(digest, m)

    def recent(self, round_id: int) -> bool:
        """Receipts of rounds near ours only: a member naming a far round cannot push the rest out."""
        now = self.ctx.state.round
        return now - KEEP_ROUNDS < round_id <= now + RECEIPT_ROUNDS

    def prune(self) -> None:
        for store in (self.held, self.relayed):
            for slot in [k for k in store if not self.recent(k[0])]:
                del store[slot]
        for digest in [d for d, r in self.disputes.items() if not self.recent(r.round)]:
            del self.disputes[digest]
        for slot in [k for k in self._heard if not self.recent(k[0])]:
            del self._heard[slot]
        if self._log and not self.recent(self._log[0][1][0]):
            self._log = [entry for entry in self._log if self.recent(entry[1][0])]
        known = self.ctx.table.peers
        if len(self._acked) + len(self._echoed_to) > 2 * len(known) + 64:  # peers forgotten since
            self._acked = {p: hashes for p, hashes in self._acked.items() if p in known}
            self._echoed_to = {p: mark for p, mark in self._echoed_to.items() if p in known}
        for key in [k for k, round_id in self._verified.items() if not self.recent(round_id)]:
            del self._verified[key]
