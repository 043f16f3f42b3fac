"""How a node proves membership on the wire, and checks that its callers do.

- Shared secret (`--secret-file`): every call carries `neuronode-auth: NODE_ID:TIMESTAMP:TAG`
  metadata, TAG = HMAC over (method, node id, swarm id, timestamp); a server interceptor checks
  it before any handler runs and answers UNAUTHENTICATED otherwise. Contributions also carry a
  tag binding their round, sender and digest; Hello answers and state headers carry tags too,
  so the caller knows it talks to a member. Status from a loopback caller needs no proof (local
  health checks).
- Mutual TLS (`--tls-cert/--tls-key/--tls-ca`): the server requires a client certificate from
  the swarm CA, and channels present ours; a peer outside the CA never completes a handshake.
Both can be combined. The pure HMAC and certificate code lives in neuronode/security/.
- Always: every node signs what it says with its key (Hellos, contributions, receipts), and the
  requests that speak for it (Leave, FetchState, FetchContribution, CheckReachable, Session):
  those name the node they are for and a nonce, and that node takes each once
  (neuronode.swarm.guard.replay). The checks before any handler runs: neuronode.swarm.guard.interceptors.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from neuronode.averaging.agreement import Receipt, Statement
from neuronode.security import auth, identity
from neuronode.security.auth import AuthError
from neuronode.security.identity import NodeKey
from neuronode.swarm.guard.interceptors import (
    AUTH_KEY,
    NODE_SERVICE_PREFIX,
    AuthInterceptor,
    DecodeGuard,
)
from neuronode.swarm.wire import CHANNEL_OPTIONS, MAX_ID_CHARS, MAX_PEERS_LISTED
from neuronode.v1 import node_pb2 as pb

logger = logging.getLogger(__name__)

# Methods whose request body names the caller; the interceptor checks the metadata of all.


@dataclass(frozen=True)
class Security:
    """One node's credentials: its signing key always; the swarm secret and TLS files when the
    swarm is closed."""

    node_id: str
    swarm_id: str
    secret: bytes = b""
    tls_files: tuple[str, str, str] | None = None  # cert, key, ca
    key: NodeKey = field(default_factory=NodeKey.generate)
    checked: Checked = field(default_factory=lambda: Checked(), compare=False, repr=False)

    @property
    def enabled(self) -> bool:
        return bool(self.secret or self.tls_files)

    # ---- transport ----------------------------------------------------------------------

    def add_port(self, server: grpc.aio.Server, listen: str) -> int:
        if self.tls_files is None:
            return server.add_insecure_port(listen)
        from neuronode.security.tls import server_credentials

        cert, key, ca = (Path(p) for p in self.tls_files)
        return server.add_secure_port(listen, server_credentials(cert, key, ca))

    def channel(self, address: str, *, own_connection: bool = False, name: str = "") -> grpc.aio.Channel:
        """A channel to `address`; `own_connection`: one not shared with the process's other
        channels to it (grpc shares one connection among channels with equal settings); `name`:
        the host name an IP `address` was resolved from, which TLS checks the certificate against."""
        options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)] if own_connection else CHANNEL_OPTIONS
        if self.tls_files is None:
            return grpc.aio.insecure_channel(address, options=options)
        if name:
            options = [*options, ("grpc.ssl_target_name_override", name)]
        from neuronode.security.tls import channel_credentials

        cert, key, ca = (Path(p) for p in self.tls_files)
        return grpc.aio.secure_channel(address, channel_credentials(cert, key, ca), options=options)

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [DecodeGuard(), *([AuthInterceptor(self.verify_metadata)] if self.secret else [])]

    # ---- per-call proofs -------------------------------------------------------------------

    def metadata(self, method: str) -> tuple[tuple[str, str], ...] | None:
        """Metadata proving membership for a call to `method` (e.g. "Hello")."""
        if not self.secret:
            return None
        ts = int(time.time())
        tag = auth.request_tag(self.secret, method=NODE_SERVICE_PREFIX + method, node_id=self.node_id,
                               swarm_id=self.swarm_id, timestamp_s=ts)
        return ((AUTH_KEY, f"{self.node_id}:{ts}:{tag}"),)

    def verify_metadata(self, metadata: Any, method: str) -> str:
        """The caller's proven node id; raises AuthError when the proof is missing or wrong."""
        value = dict(metadata or ()).get(AUTH_KEY)
        if not isinstance(value, str) or value.count(":") < 2:
            raise AuthError("this swarm is closed: calls must prove membership (start the "
                            "caller with the swarm's --secret-file)")
        node_id, ts_s, tag = value.rsplit(":", 2)
        if not (ts_s.isascii() and ts_s.isdigit()) or len(ts_s) > 20 or len(node_id) > 128:
            raise AuthError("malformed membership proof")
        auth.check_request_tag(self.secret, tag, method=method, node_id=node_id,
                               swarm_id=self.swarm_id, timestamp_s=int(ts_s), now_s=time.time())
        return node_id

    def contribution_tag(self, **fields: Any) -> str:
        return auth.contribution_tag(self.secret, swarm_id=self.swarm_id, **fields) if self.secret else ""

    def check_contribution(self, tag: str, **fields: Any) -> None:
        if self.secret:
            auth.check_contribution_tag(self.secret, tag, swarm_id=self.swarm_id, **fields)

    def hello_proof(self, info: pb.NodeInfo, known: Sequence[pb.PeerRecord]) -> tuple[str, int]:
        """Tag and timestamp for a Hello we send (our `info`, the peers we list)."""
        if not self.secret:
            return "", 0
        ts = int(time.time())
        return auth.hello_tag(self.secret, swarm_id=self.swarm_id, node_id=self.node_id, advertise=info.advertise,
                              timestamp_s=ts, body=hello_body(info, known)), ts

    def check_hello_proof(self, tag: str, timestamp_s: int, info: pb.NodeInfo, known: Sequence[pb.PeerRecord]) -> None:
        """Raise AuthError unless a received Hello's tag binds its sender, time and content."""
        if self.secret:
            auth.check_hello_tag(self.secret, tag, swarm_id=self.swarm_id, node_id=info.node_id,
                                 advertise=info.advertise, timestamp_s=timestamp_s, now_s=time.time(),
                                 body=hello_body(info, known))

    # ---- signatures (neuronode.security.identity) --------------------------------------------

    def sign_hello(self, msg: pb.HelloRequest | pb.HelloResponse) -> None:
        """Put our key, the time, the HMAC tag (closed swarm) and our signature on a Hello."""
        msg.info.public_key = self.key.public
        msg.auth_tag, msg.timestamp_s = self.hello_proof(msg.info, msg.known_peers)
        if not msg.timestamp_s:
            msg.timestamp_s = int(time.time())
        msg.signature = self.key.sign("hello", self.swarm_id, msg.info.node_id, msg.timestamp_s,
                                      hello_body(msg.info, msg.known_peers))

    def check_hello_signature(self, msg: pb.HelloRequest | pb.HelloResponse) -> None:
        """Raise AuthError unless the Hello is signed, recently, by the key it carries, and that
        key may speak as its node id (a derived id must be the key's)."""
        info = msg.info
        identity.check_key(info.node_id, info.public_key)
        auth.check_fresh(msg.timestamp_s, time.time(), what="hello")
        self.verify(info.public_key, msg.signature, "hello", self.swarm_id, info.node_id, msg.timestamp_s,
                    hello_body(info, msg.known_peers))

    def verify(self, public_key: bytes, signature: bytes, domain: str, *fields: Any) -> None:
        """identity.verify, unless `check_ahead` (or an earlier call) verified the very same."""
        key = Checked.key_of(public_key, signature, domain, *fields)
        if key not in self.checked:
            identity.verify(public_key, signature, domain, *fields)
            self.checked.add(key)

    async def check_ahead(self, msg: pb.HelloRequest | pb.HelloResponse) -> None:
        """Verify the signatures a Hello carries (its own, its receipts', every statement they
        list: up to thousands) on our signature thread, so that the checks made when it is
        taken, on the event loop, find them done. Bad ones are left for those checks to refuse.
        A Hello with a few (a heartbeat: its own and compact receipts') is checked where it is
        taken: a thread hop would cost more than the checks."""
        try:
            items = hello_signatures(self.swarm_id, msg)
        except Exception:  # noqa: BLE001 - malformed: the checks on the loop refuse it, with a reason
            return
        if len(items) > FEW_SIGNATURES:
            good = await asyncio.get_running_loop().run_in_executor(verifier(), verified_keys, items)
            for key in good:
                self.checked.add(key)

    def sign_request(self, method: str, msg: Any, callee: str) -> Any:
        """Sign a Leave, FetchState, FetchContribution, CheckReachable or Session request as our
        node, for node `callee` only and for one use (a fresh nonce); returns `msg`."""
        msg.timestamp_s = int(time.time())
        msg.callee_id = callee
        msg.nonce = os.urandom(NONCE_BYTES)
        msg.signature = self.key.sign("request/" + method, *request_fields(self.swarm_id, method, msg))
        return msg

    def check_request_signature(self, method: str, msg: Any, public_key: bytes) -> bytes:
        """Raise AuthError unless `msg` is made for this node, recently, and signed by
        `public_key` (its node's); returns what its one use is remembered by (SpentRequests)."""
        if msg.callee_id != self.node_id:
            raise AuthError(f"this {method} request was signed for node {msg.callee_id[:MAX_ID_CHARS]!r}, not for "
                            f"this node ({self.node_id!r}): a signed request is good only at the node it was made "
                            "for (replayed from elsewhere, or sent to the wrong address)")
        if not MIN_NONCE_BYTES <= len(msg.nonce) <= MAX_NONCE_BYTES:
            raise AuthError(f"a {method} request carries a nonce of {MIN_NONCE_BYTES} to {MAX_NONCE_BYTES} bytes "
                            "(its one use)")
        auth.check_fresh(msg.timestamp_s, time.time(), what=method)
        fields = request_fields(self.swarm_id, method, msg)
        identity.verify(public_key, msg.signature, "request/" + method, *fields)
        return hashlib.sha256(identity.signed_bytes("request/" + method, *fields)).digest()

    def sign_statement(self, statement: Statement) -> bytes:
        """Our signature over a contribution's statement (neuronode.averaging.agreement)."""
        return self.key.sign("contribution", *statement_fields(self.swarm_id, statement))

    def check_statement(self, statement: Statement, public_key: bytes) -> None:
        """Raise AuthError unless `statement` carries `public_key`'s signature."""
        self.verify(public_key, statement.signature, "contribution", *statement_fields(self.swarm_id, statement))

    def sign_receipt(self, receipt: Receipt) -> bytes:
        return self.key.sign("receipt", *receipt_fields(self.swarm_id, receipt))

    def check_receipt(self, receipt: Receipt, public_key: bytes) -> None:
        """Raise AuthError unless `receipt` carries `public_key`'s signature (its statements are
        checked one by one: each is its own sender's word)."""
        self.verify(public_key, receipt.signature, "receipt", *receipt_fields(self.swarm_id, receipt))

    def receipt_hash(self, receipt: Receipt) -> bytes:
        """What two members compare to tell whether a maker told them the same (ReceiptEcho)."""
        return hashlib.sha256(identity.signed_bytes("receipt", *receipt_fields(self.swarm_id, receipt))).digest()

    def state_tag(self, **fields: Any) -> str:
        return auth.state_tag(self.secret, swarm_id=self.swarm_id, **fields) if self.secret else ""

    def check_state(self, tag: str, **fields: Any) -> None:
        if self.secret:
            auth.check_state_tag(self.secret, tag, swarm_id=self.swarm_id, **fields)


NONCE_BYTES = 16  # a signed request's nonce: what makes each one unique, so each is good once
MIN_NONCE_BYTES, MAX_NONCE_BYTES = 8, 64


def request_fields(swarm_id: str, method: str, msg: Any) -> tuple[Any, ...]:
    """What a signed request's signature covers: who asks, when, which node it is for, its
    nonce, and everything it asks (a field added to one of these requests must be added here)."""
    head = (swarm_id, msg.node_id, int(msg.timestamp_s), msg.callee_id, bytes(msg.nonce))
    if method == "FetchState":
        return (*head, int(msg.resume_from), bytes(msg.resume_digest))
    if method == "CheckReachable":
        return (*head, msg.address)
    if method == "FetchContribution":
        return (*head, int(msg.round_id), msg.sender_id, int(msg.phase), int(msg.shard_index), bytes(msg.body))
    if method in ("Leave", "Session"):
        return head
    raise ValueError(f"{method} is not a signed request")


Signed = tuple[bytes, bytes, str, tuple[Any, ...]]  # public key, signature, domain, fields
FEW_SIGNATURES = 8  # a Hello carrying at most this many has them checked on the loop (about 0.5 ms)


@functools.cache
def verifier() -> ThreadPoolExecutor:
    """The process's one thread for check_ahead: signature checks wait for nothing else
    (decoding, averaging), and nodes in one process (tests) share it."""
    return ThreadPoolExecutor(1, thread_name_prefix="signatures")


class Checked:
    """Signatures verified already, by digest of (key, signature, signed bytes): a hit stands for
    a check that passed. Bounded: the oldest are forgotten first."""

    MAX = 1 << 16

    def __init__(self) -> None:
        self._seen: dict[bytes, None] = {}

    @staticmethod
    def key_of(public_key: bytes, signature: bytes, domain: str, *fields: Any) -> bytes:
        return hashlib.sha256(public_key + signature + identity.signed_bytes(domain, *fields)).digest()

    def __contains__(self, key: bytes) -> bool:
        return key in self._seen

    def add(self, key: bytes) -> None:
        self._seen[key] = None
        if len(self._seen) > self.MAX:
            for old in list(self._seen)[:self.MAX // 8]:
                del self._seen[old]


def verified_keys(items: list[Signed]) -> list[bytes]:
    """The Checked keys of the signatures among `items` that verify (run in a worker thread)."""
    good = []
    for public_key, signature, domain, fields in items:
        try:
            identity.verify(public_key, signature, domain, *fields)
        except Exception:  # noqa: BLE001 - whatever a bad one raises, it is not verified
            continue
        good.append(Checked.key_of(public_key, signature, domain, *fields))
    return good


def hello_signatures(swarm_id: str, msg: pb.HelloRequest | pb.HelloResponse) -> list[Signed]:
    """Every signature a Hello carries, with what it signs: the Hello's, its receipts' (over
    their lists' digests) and their statements' (each under the key it names)."""
    from neuronode.averaging.agreement import statements_digest
    from neuronode.swarm.receipts.wire import check_sizes, statement_from_pb

    info = msg.info
    check_sizes(info)  # no more than an honest Hello carries (a Refusal otherwise: nothing checked ahead)
    items: list[Signed] = [(info.public_key, msg.signature, "hello",
                            (swarm_id, info.node_id, msg.timestamp_s, hello_body(info, msg.known_peers)))]
    for m in [*info.receipts, *info.disputed]:
        statements = tuple(statement_from_pb(s, m.round) for s in m.statements if s.phase in (0, 1, 2))
        digest = m.listed_digest or statements_digest(statements)
        items.append((m.public_key, m.signature, "receipt", (swarm_id, int(m.round), int(m.phase), m.maker_id,
                                                              digest.hex())))
        items.extend((st.public_key, st.signature, "contribution", statement_fields(swarm_id, st)) for st in statements)
    return items


def statement_fields(swarm_id: str, s: Statement) -> tuple[Any, ...]:
    """What a contribution's signature covers: its statement, in this swarm."""
    return (swarm_id, int(s.round_id), s.sender, int(s.phase), int(s.shard_index), s.lineage, s.body)


def receipt_fields(swarm_id: str, r: Receipt) -> tuple[Any, ...]:
    """What a receipt's signature covers: its round, phase and maker, and the digest of the
    statements it lists (agreement.statements_digest)."""
    return (swarm_id, int(r.round_id), int(r.phase), r.maker, r.digest.hex())


def receipt_summary(r: pb.Receipt) -> list[Any]:
    """Every field of a wire receipt, for hello_body."""
    return [r.round, int(r.phase), r.maker_id, r.signature.hex(), r.public_key.hex(),
            [[s.sender_id, int(s.phase), s.shard_index, s.lineage.hex(), s.body.hex(), s.signature.hex(),
              s.public_key.hex()] for s in r.statements], r.listed_digest.hex(), r.statement_ids.hex()]


def hello_body(info: pb.NodeInfo, known: Sequence[pb.PeerRecord]) -> str:
    """Digest of everything a Hello says besides what its tag binds directly, in a canonical
    form: a field added to NodeInfo or PeerRecord must be added here too. Only the peer records
    a node reads (the first MAX_PEERS_LISTED) count, so a flood costs no hashing."""
    fields = [info.node_id, info.swarm_id, info.protocol_version, info.manifest_hash, info.advertise,
              info.round, info.param_digest, [[d.round, d.param_digest, d.contributors, d.momentum_digest] for d in info.recent_digests],
              info.leaving, info.contributes_from,
              [receipt_summary(r) for r in info.receipts],
              [[e.round, int(e.phase), e.maker_id, e.receipt_hash.hex(), e.whole] for e in info.echoes],
              [receipt_summary(r) for r in info.disputed],
              [[w.round, int(w.phase), w.maker_id, w.receipt_hash.hex(), w.whole] for w in info.wanted],
              [info.settings.codec, info.settings.averaging, info.settings.aggregator, info.settings.outer_lr,
               info.settings.outer_momentum, info.settings.overlap,
               [[t.name, t.value] for t in info.settings.task], info.settings.sparse_k,
               info.settings.sparse_bits, info.settings.sparse_block, info.settings.sparse_decay,
               info.settings.max_weight, info.settings.max_local_workers, info.settings.gather_makers],
              info.public_key.hex(), int(info.reachable), list(info.carried_by),
              [[p.node_id, p.address] for p in known[:MAX_PEERS_LISTED]]]
    return hashlib.sha256(json.dumps(fields, separators=(",", ":")).encode()).hexdigest()
