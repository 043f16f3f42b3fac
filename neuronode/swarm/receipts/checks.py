"""Which receipts and statements we believe (neuronode.swarm.receipts.receipts keeps the receipts).

A receipt counts only with its maker's signature, and a statement it lists only with its
sender's: the key an id speaks with is the one it is bound to here (its own Hello), or the one
its derived id proves. For a named id we never met, the one key a quorum of hosts vouch for
(neuronode.quorum), never one member's word. Signatures are checked once per distinct
statement and once per distinct list, and the marks are kept for the rounds receipts are.
"""

from __future__ import annotations

from collections.abc import Callable

from neuronode.averaging.agreement import Receipt, Statement
from neuronode.codec.contribution import Phase
from neuronode.quorum import quorum
from neuronode.security.auth import AuthError
from neuronode.security.identity import derived_id, is_derived
from neuronode.swarm.context import Context
from neuronode.swarm.receipts.wire import receipt_from_pb
from neuronode.swarm.wire import MAX_ID_CHARS, Refusal
from neuronode.v1 import node_pb2 as pb

__all__ = ["ReceiptChecks"]


class ReceiptChecks:
    """Signature checks of receipts and the statements they list, and whose key counts."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._verified: dict[tuple[str, bytes], int] = {}  # (sender, signature) of statements checked -> round
        self._checked: dict[bytes, int] = {}  # digests of lists whose statements passed `check` -> round

    def vouched(self, versions: list[Receipt]) -> dict[str, bytes]:
        """For each named id we never met (it stopped greeting before we joined, or we share no
        relay with it), the one key statements of it carry in the receipts of a quorum of the
        voices that published one (neuronode.quorum: hosts, not ids). Members list only what they
        received from a maker they met, so a quorum's key is as good as the listing rule itself;
        one host's word (a liar naming its own key for an absent member, to fake its equivocation,
        under as many ids as it likes) is not enough. The binding itself still comes only from
        the member's own Hello."""
        voice_of = self.ctx.table.voice
        lists: dict[bytes, tuple[tuple[Statement, ...], set[str]]] = {}
        for r in versions:
            lists.setdefault(r.digest, (r.statements, set()))[1].add(voice_of(r.maker))
        spoke = set().union(*(who for _, who in lists.values()))
        keys: dict[str, dict[bytes, set[str]]] = {}
        for statements, who in lists.values():
            for s in statements:
                if len(s.public_key) == 32 and self.unbound(s.sender):
                    keys.setdefault(s.sender, {}).setdefault(s.public_key, set()).update(who - {voice_of(s.sender)})
        vouched = {}
        for sender, by_key in keys.items():
            need = max(2, quorum(len(spoke - {voice_of(sender)})))  # one host's word never vouches
            strong = [key for key, who in by_key.items() if len(who) >= need]
            if len(strong) == 1:
                vouched[sender] = strong[0]
        return vouched

    def unbound(self, node_id: str) -> bool:
        """A named id whose key we do not know (never met; not one a key proves)."""
        if node_id == self.ctx.cfg.node_id or is_derived(node_id):
            return False
        peer = self.ctx.table.peers.get(node_id)
        return peer is None or not peer.public_key

    def proof(self, m: pb.Receipt, key: bytes) -> Receipt:
        """A relayed version (a dispute): its maker's signature over its digest is all it proves."""
        digest = m.listed_digest or receipt_from_pb(m).digest
        receipt = Receipt(round_id=m.round, phase=Phase(m.phase), maker=m.maker_id, statements=(),
                          signature=m.signature, public_key=m.public_key, listed_digest=digest)
        try:
            self.ctx.security.check_receipt(receipt, key)
        except AuthError as exc:
            raise Refusal("PERMISSION_DENIED", f"receipt of round {m.round} from {m.maker_id[:MAX_ID_CHARS]}: {exc}") from None
        return receipt

    def check(self, r: Receipt, key: bytes) -> None:
        """Raise Refusal unless `r` carries `key`'s signature and every statement in it whose
        sender's key we know carries that sender's (once per distinct list)."""
        try:
            self.ctx.security.check_receipt(r, key)
        except AuthError as exc:
            raise Refusal("PERMISSION_DENIED", f"receipt of round {r.round_id} from {r.maker[:MAX_ID_CHARS]}: {exc}") from None
        if r.digest in self._checked:
            return
        if len(self.checked(r.statements)) < sum(self.key_of(s.sender, s.public_key) is not None for s in r.statements):
            raise Refusal("PERMISSION_DENIED", f"receipt of round {r.round_id} from {r.maker[:MAX_ID_CHARS]} lists a "
                          "statement its sender did not sign")
        self._checked[r.digest] = r.round_id

    def checked(self, statements: tuple[Statement, ...], vouched: dict[str, bytes] | None = None) -> tuple[Statement, ...]:
        """`statements` less those we cannot check, or whose signature does not verify."""
        kept = []
        for s in statements:
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
                self._verified[(s.sender, s.signature)] = s.round_id
            kept.append(s)
        return statements if len(kept) == len(statements) else tuple(kept)

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

    def prune(self, recent: Callable[[int], bool]) -> None:
        """Forget the marks of rounds no longer `recent`."""
        for checked in [k for k, round_id in self._verified.items() if not recent(round_id)]:
            del self._verified[checked]
        for digest in [d for d, round_id in self._checked.items() if not recent(round_id)]:
            del self._checked[digest]
