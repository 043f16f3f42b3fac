"""One key per member: every node signs what it says with its own Ed25519 key. Pure: no grpc.

The key lives in the data dir (`node.key`, the 32-byte private key, mode 0600) and is made on
first start. A node started without `--node-id` on a new data dir takes an id derived from its
public key (`k` + 32 base32 characters of its SHA-256, as libp2p derives peer ids), so its id
proves its key; a named id (`--node-id`, or one an older release kept in the data dir) is bound
to the first key a peer sees it with, for as long as that peer remembers it (and, under mutual
TLS, to the certificate that names it). Hellos, reduce-scatter receipts and every contribution
carry the maker's signature over a canonical encoding of what they say, under a domain label of
their own (`neuronode.security.auth.encode_fields`), so a recipient checks who made a statement
whoever delivered it, and two conflicting statements signed by one key prove that it lied.

The shared secret or the CA certificate decides who may join; the key decides who said what.
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from neuronode.security.auth import AuthError, _float, _int, encode_fields

KEY_FILE = "node.key"
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
DERIVED_PREFIX = "k"
DERIVED_CHARS = 32  # base32 characters of sha256(public key): 160 bits

_RAW = serialization.Encoding.Raw


class NodeKey:
    """A node's Ed25519 key pair."""

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._private = private
        self.public = private.public_key().public_bytes(_RAW, serialization.PublicFormat.Raw)

    @classmethod
    def generate(cls) -> NodeKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> NodeKey:
        """The key whose 32-byte private key is `seed` (tests name keys this way)."""
        return cls(Ed25519PrivateKey.from_private_bytes(hashlib.sha256(seed).digest()))

    @classmethod
    def load_or_create(cls, data_dir: Path) -> NodeKey:
        """The node's key from `data_dir/node.key`, made (0600) when the file does not exist."""
        path = data_dir / KEY_FILE
        if path.exists():
            raw = path.read_bytes()
            if len(raw) != 32:
                raise AuthError(f"{path} holds {len(raw)} bytes, not a 32-byte Ed25519 key; restore it "
                                "from a backup, or move it away to give this node a new identity")
            return cls(Ed25519PrivateKey.from_private_bytes(raw))
        key = cls.generate()
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(key._private.private_bytes(_RAW, serialization.PrivateFormat.Raw,
                                                 serialization.NoEncryption()))
        tmp.replace(path)
        return key

    @property
    def derived_id(self) -> str:
        return derived_id(self.public)

    def sign(self, domain: str, *fields: object) -> bytes:
        """Ed25519 signature over `encode_fields(domain, *fields)` (str, int or float fields)."""
        return self._private.sign(signed_bytes(domain, *fields))


def signed_bytes(domain: str, *fields: object) -> bytes:
    """What a signature covers: the fields, typed (ints, floats, str; bytes as hex), canonical."""
    typed: list[Any] = []
    for field in fields:
        if isinstance(field, int):  # bools too: signed as 0 or 1
            typed.append(_int(int(field)))
        elif isinstance(field, float):
            typed.append(_float(field))
        elif isinstance(field, bytes):
            typed.append(field.hex())
        elif isinstance(field, str):
            typed.append(field)
        else:
            raise TypeError(f"{domain}: cannot sign a {type(field).__name__}")
    return encode_fields("signed/" + domain, *typed)


def derived_id(public_key: bytes) -> str:
    """The node id a public key proves."""
    digest = base64.b32encode(hashlib.sha256(public_key).digest()).decode().lower()
    return DERIVED_PREFIX + digest[:DERIVED_CHARS]


def is_derived(node_id: str) -> bool:
    """True for an id of the derived form (a key must prove it); False for a named id."""
    return (len(node_id) == 1 + DERIVED_CHARS and node_id.startswith(DERIVED_PREFIX)
            and all(c in "abcdefghijklmnopqrstuvwxyz234567" for c in node_id[1:]))


def check_key(node_id: str, public_key: bytes) -> None:
    """Raise AuthError unless `public_key` is a well-formed key that may speak as `node_id`."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise AuthError(f"public key of {node_id[:128]!r} has {len(public_key)} bytes, not {PUBLIC_KEY_BYTES}")
    if is_derived(node_id) and derived_id(public_key) != node_id:
        raise AuthError(f"node id {node_id!r} is not the one its key derives ({derived_id(public_key)})")


def verify(public_key: bytes, signature: bytes, domain: str, *fields: object) -> None:
    """Raise AuthError unless `signature` is `public_key`'s over these fields."""
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        raise AuthError(f"{domain}: missing or malformed signature (start every member with the same release)")
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, signed_bytes(domain, *fields))
    except (InvalidSignature, ValueError):
        raise AuthError(f"{domain}: the signature does not verify (forged, or rewritten on the way)") from None
