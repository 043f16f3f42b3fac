"""Receipts on the wire: the three forms a receipt travels in (its statements whole, their
8-byte ids, or its list's digest alone; neuronode.swarm.receipts.receipts says when each), and the bounds
a Hello's receipts, echoes, wants and disputes keep."""

from __future__ import annotations

import hashlib

from neuronode.averaging.agreement import Receipt, Statement
from neuronode.codec.contribution import Phase
from neuronode.swarm.membership.table import MAX_MEMBERS
from neuronode.swarm.wire import MAX_ID_CHARS, MAX_PEERS_LISTED, Refusal
from neuronode.v1 import node_pb2 as pb

RECEIPT_ROUNDS = 3  # rounds per phase whose receipts a node announces (the slowest member decides 2x --sync-timeout late)
MAX_RECEIPTS = 2 * RECEIPT_ROUNDS  # in one NodeInfo (two phases)
MAX_ECHOES = 1024
MAX_DISPUTED = 8
MAX_WANTED = 64  # receipts one Hello asks for in full
ID_BYTES = 8  # a statement's short id in a compact receipt


def statement_to_pb(s: Statement) -> pb.Statement:
    return pb.Statement(sender_id=s.sender, phase=int(s.phase), shard_index=s.shard_index,  # type: ignore[arg-type]
                        lineage=s.lineage, body=s.body, signature=s.signature, public_key=s.public_key)


def statement_from_pb(m: pb.Statement, round_id: int) -> Statement:
    return Statement(round_id=round_id, sender=m.sender_id, phase=Phase(m.phase), shard_index=m.shard_index,
                     lineage=m.lineage, body=m.body, signature=m.signature, public_key=m.public_key)


def short_id(s: Statement) -> bytes:
    """What a compact receipt says of a statement (a hint: the rebuilt list must hash to the
    signed digest, so a collision only costs asking for the list in full)."""
    return hashlib.sha256(s.signature + s.lineage + s.body).digest()[:ID_BYTES]


def receipt_to_pb(r: Receipt, form: str = "full") -> pb.Receipt:
    """`r` on the wire: its statements in "full", their short "ids", or its "digest" only."""
    m = pb.Receipt(round=r.round_id, phase=int(r.phase), maker_id=r.maker, signature=r.signature,  # type: ignore[arg-type]
                   public_key=r.public_key, listed_digest=r.digest)
    if form == "full":
        m.statements.extend(statement_to_pb(s) for s in r.statements)
    elif form == "ids":
        m.statement_ids = b"".join(short_id(s) for s in r.statements)
    return m


def receipt_from_pb(m: pb.Receipt) -> Receipt:
    """A receipt in full form (or, with no statements, the empty list: see `Receipts.rebuild`)."""
    statements = tuple(statement_from_pb(s, m.round) for s in m.statements)
    return Receipt(round_id=m.round, phase=Phase(m.phase), maker=m.maker_id, statements=statements,
                   signature=m.signature, public_key=m.public_key)


def check_sizes(info: pb.NodeInfo) -> None:
    """Refuse a Hello whose receipts, echoes or disputes exceed what an honest node sends."""
    receipts = [*info.receipts, *info.disputed]
    if (len(info.receipts) > MAX_RECEIPTS or len(info.disputed) > MAX_DISPUTED or len(info.echoes) > MAX_ECHOES
            or len(info.wanted) > MAX_WANTED
            or any(r.phase not in (Phase.WHOLE, Phase.AVERAGED) or len(r.statements) > MAX_MEMBERS
                   or len(r.maker_id) > MAX_ID_CHARS or len(r.listed_digest) not in (0, 32)
                   or len(r.statement_ids) > ID_BYTES * MAX_MEMBERS or len(r.statement_ids) % ID_BYTES
                   for r in receipts)
            or any(len(s.sender_id) > MAX_ID_CHARS or s.shard_index >= MAX_PEERS_LISTED or s.phase != r.phase
                   or len(s.lineage) != 32 or len(s.body) != 32 for r in receipts for s in r.statements)
            or any(len(e.maker_id) > MAX_ID_CHARS or len(e.receipt_hash) != 32 or e.phase not in (Phase.WHOLE, Phase.AVERAGED)
                   for e in [*info.echoes, *info.wanted])):
        raise Refusal("INVALID_ARGUMENT", f"hello carries at most {MAX_RECEIPTS} receipts of at most "
                      f"{MAX_MEMBERS} statements or {ID_BYTES}-byte ids (whole or averaged phase, 32-byte "
                      f"hashes), {MAX_ECHOES} echoes, {MAX_WANTED} wanted and {MAX_DISPUTED} disputed receipts")
