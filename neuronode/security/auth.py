"""Shared-secret membership proofs (HMAC-SHA256). Pure: no grpc, no asyncio.

Every member of a closed swarm holds the same secret (a file given with the daemon's secret
flag). A message carries a tag, HMAC-SHA256(secret, canonical encoding of the fields that
matter), so a receiver can tell that the sender knows the secret and that those fields were
not changed on the way.

What a tag proves, and what it does not:
- It proves membership, not identity: every member can compute every tag, so a member can
  still claim to be another member. Per-node identity comes from mutual TLS (`certs`).
- Each kind of tag starts with its own domain label, so a tag made for one purpose (a Hello)
  is never valid for another (a contribution), even when the field values coincide.
- Fields are length-prefixed, never joined with separators, so ("ab", "c") and ("a", "bc")
  encode differently.
- Hello and request tags carry a timestamp and are accepted within `max_skew_s` of the
  receiver's clock: a captured message can be replayed only inside that window.
- Contribution tags carry the round and the sender: a contribution cannot be replayed into
  another round, and a forwarded one still names the member that made it.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import operator
import os
import stat
import struct
from pathlib import Path
from typing import SupportsIndex

from neuronode.errors import NeuronodeError

MIN_SECRET_BYTES = 16
DEFAULT_MAX_SKEW_S = 300
TAG_HEX_CHARS = 64  # hex of one SHA-256 output

_DOMAIN_PREFIX = "neuronode-auth/v1/"
_TYPE_STR = b"s"
_TYPE_INT = b"i"
_TYPE_FLOAT = b"f"


class AuthError(NeuronodeError, ValueError):
    """A secret file that cannot be used, or a message whose membership proof does not hold."""

    exit_code = 2


def load_secret(path: str | os.PathLike[str]) -> bytes:
    """Read a swarm secret: the file's bytes without surrounding whitespace, at least 16 bytes.

    Raises AuthError when the file is missing, unreadable or too short. Call
    `permissions_warning` as well to tell the user when others can read the file.
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise AuthError(f"swarm secret file {p} does not exist; create it with "
                        f"'openssl rand -hex 32 > {p} && chmod 600 {p}'") from None
    except OSError as exc:
        raise AuthError(f"cannot read swarm secret file {p}: {exc.strerror or exc}") from None
    secret = raw.strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise AuthError(f"swarm secret in {p} has {len(secret)} bytes; it needs at least "
                        f"{MIN_SECRET_BYTES} (e.g. 'openssl rand -hex 32 > {p}')")
    return secret


def permissions_warning(path: str | os.PathLike[str]) -> str | None:
    """A one-line warning when group or others may access the secret file, else None."""
    if os.name != "posix":
        return None
    p = Path(path)
    try:
        mode = stat.S_IMODE(p.stat().st_mode)
    except OSError:
        return None  # load_secret reports a missing file
    if mode & 0o077:
        return (f"swarm secret file {p} has mode {mode:04o}, so other users may read it; "
                f"run 'chmod 600 {p}'")
    return None


def hello_tag(secret: bytes, *, swarm_id: str, node_id: str, advertise: str,
              timestamp_s: int, body: str = "") -> str:
    """Proof of membership for a Hello (either direction), valid near `timestamp_s`. `body`
    is a digest of the rest of the message (rounds, digests, peer lists), so that an on-path
    attacker cannot rewrite it (neuronode.swarm.guard.proofs.hello_body)."""
    return _tag(secret, "hello", swarm_id, node_id, advertise, _int(timestamp_s), body)


def check_hello_tag(secret: bytes, tag: str, *, swarm_id: str, node_id: str, advertise: str,
                    timestamp_s: int, now_s: float, body: str = "",
                    max_skew_s: float = DEFAULT_MAX_SKEW_S) -> None:
    """Raise AuthError unless `tag` is `hello_tag(...)` and `timestamp_s` is within the skew."""
    expected = hello_tag(secret, swarm_id=swarm_id, node_id=node_id, advertise=advertise,
                         timestamp_s=timestamp_s, body=body)
    _compare(tag, expected, f"hello from node {node_id!r}")
    _check_fresh(timestamp_s, now_s, max_skew_s, f"hello from node {node_id!r}")


def request_tag(secret: bytes, *, method: str, node_id: str, swarm_id: str,
                timestamp_s: int) -> str:
    """Proof of membership for a request without a body worth binding (Status, Leave, FetchState)."""
    return _tag(secret, "request", method, node_id, swarm_id, _int(timestamp_s))


def check_request_tag(secret: bytes, tag: str, *, method: str, node_id: str, swarm_id: str,
                      timestamp_s: int, now_s: float,
                      max_skew_s: float = DEFAULT_MAX_SKEW_S) -> None:
    """Raise AuthError unless `tag` is `request_tag(...)` and `timestamp_s` is within the skew."""
    expected = request_tag(secret, method=method, node_id=node_id, swarm_id=swarm_id,
                           timestamp_s=timestamp_s)
    _compare(tag, expected, f"{method} request from node {node_id!r}")
    _check_fresh(timestamp_s, now_s, max_skew_s, f"{method} request from node {node_id!r}")


def contribution_tag(secret: bytes, *, swarm_id: str, round_id: int, sender_id: str,
                     contribution_digest: str, codec: str, weight: float,
                     total_elements: int) -> str:
    """Binds a contribution (through its payload digest) to its round, sender and header.

    `codec` is the codec's name (e.g. "int8"), the same string on both sides; `weight` is
    encoded by its exact float64 bits, so both sides must pass the value the wire carries.
    """
    return _tag(secret, "contribution", swarm_id, _int(round_id), sender_id,
                contribution_digest, codec, _float(weight), _int(total_elements))


def check_contribution_tag(secret: bytes, tag: str, *, swarm_id: str, round_id: int,
                           sender_id: str, contribution_digest: str, codec: str, weight: float,
                           total_elements: int) -> None:
    """Raise AuthError unless `tag` is `contribution_tag(...)` of exactly these fields."""
    expected = contribution_tag(secret, swarm_id=swarm_id, round_id=round_id,
                                sender_id=sender_id, contribution_digest=contribution_digest,
                                codec=codec, weight=weight, total_elements=total_elements)
    _compare(tag, expected, f"round {round_id}: contribution from {sender_id!r}")


def state_tag(secret: bytes, *, swarm_id: str, round_id: int, param_digest: str,
              momentum_digest: str, n_elements: int, inner_steps_total: int,
              manifest_hash: str) -> str:
    """Binds a state transfer header: the receiver installs only state a member vouched for.

    The digests cover the payload, so checking this tag and then the digests covers it all.
    There is no timestamp: an old state is still a real swarm state, and a joiner notices it is
    behind from the rounds its peers report.
    """
    return _tag(secret, "state", swarm_id, _int(round_id), param_digest, momentum_digest,
                _int(n_elements), _int(inner_steps_total), manifest_hash)


def check_state_tag(secret: bytes, tag: str, *, swarm_id: str, round_id: int,
                    param_digest: str, momentum_digest: str, n_elements: int,
                    inner_steps_total: int, manifest_hash: str) -> None:
    """Raise AuthError unless `tag` is `state_tag(...)` of exactly these fields."""
    expected = state_tag(secret, swarm_id=swarm_id, round_id=round_id,
                         param_digest=param_digest, momentum_digest=momentum_digest,
                         n_elements=n_elements, inner_steps_total=inner_steps_total,
                         manifest_hash=manifest_hash)
    _compare(tag, expected, f"round {round_id}: state header")


# --- encoding -----------------------------------------------------------------------------


class _Int(int):
    """An int field (kept apart from str fields in the encoding)."""


class _Float(float):
    """A float field, encoded by its float64 bits."""


def _int(value: SupportsIndex) -> _Int:
    # operator.index refuses floats, so 3.0 is never silently taken for 3.
    if isinstance(value, bool):
        raise TypeError("expected an int, got a bool")
    return _Int(operator.index(value))


def _float(value: float) -> _Float:
    f = float(value)
    if not math.isfinite(f):
        raise ValueError(f"expected a finite float, got {f}")
    return _Float(f)


def encode_fields(domain: str, *fields: str | _Int | _Float) -> bytes:
    """Canonical bytes: the domain label, then each field as type byte + 4-byte length + value."""
    out = bytearray()
    for field in (_DOMAIN_PREFIX + domain, *fields):
        if isinstance(field, _Int):
            kind, value = _TYPE_INT, str(int(field)).encode()
        elif isinstance(field, _Float):
            kind, value = _TYPE_FLOAT, struct.pack(">d", field)
        elif isinstance(field, str):
            kind, value = _TYPE_STR, field.encode("utf-8")
        else:
            raise TypeError(f"cannot encode {type(field).__name__}")
        out += kind + struct.pack(">I", len(value)) + value
    return bytes(out)


def _tag(secret: bytes, domain: str, *fields: str | _Int | _Float) -> str:
    if len(secret) < MIN_SECRET_BYTES:
        raise AuthError(f"swarm secret has {len(secret)} bytes; it needs at least "
                        f"{MIN_SECRET_BYTES}")
    for field in fields:
        if not isinstance(field, str | _Int | _Float):
            raise TypeError(f"{domain} tag: expected str, got {type(field).__name__}")
    return hmac.new(secret, encode_fields(domain, *fields), hashlib.sha256).hexdigest()


def _compare(tag: str, expected: str, what: str) -> None:
    # compare_digest on bytes: constant time, and any str (even non-ASCII) is just a mismatch.
    if not isinstance(tag, str) or not hmac.compare_digest(tag.encode(), expected.encode()):
        raise AuthError(f"{what}: membership proof does not match "
                        "(missing, or made with another swarm secret)")


def check_fresh(timestamp_s: int, now_s: float, *, what: str, max_skew_s: float = DEFAULT_MAX_SKEW_S) -> None:
    """Raise AuthError when `timestamp_s` is more than `max_skew_s` from `now_s`."""
    _check_fresh(timestamp_s, now_s, max_skew_s, what)


def _check_fresh(timestamp_s: int, now_s: float, max_skew_s: float, what: str) -> None:
    skew_s = now_s - timestamp_s
    if abs(skew_s) > max_skew_s:
        direction = "old" if skew_s > 0 else "in the future"
        raise AuthError(f"{what}: timestamp is {abs(skew_s):.0f} s {direction} "
                        f"(limit {max_skew_s:.0f} s); replayed, or a clock is wrong")
