"""Shared-secret membership proofs (neuronode.security.auth): pure, no network."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from neuronode.security import auth
from neuronode.security.auth import AuthError

SECRET = b"0123456789abcdef0123456789abcdef"
OTHER_SECRET = b"fedcba9876543210fedcba9876543210"
NOW_S = 1_750_000_000

texts = st.text(max_size=20)
ints = st.integers(min_value=0, max_value=2**64 - 1)
weights = st.floats(min_value=0, max_value=1e12, allow_nan=False, allow_infinity=False)

# Each kind of tag: (make, check, strategies of its fields, example fields).
KINDS: dict[str, tuple[Callable[..., str], Callable[..., None], dict[str, Any], dict[str, Any]]] = {
    "hello": (
        auth.hello_tag, auth.check_hello_tag,
        {"swarm_id": texts, "node_id": texts, "advertise": texts, "timestamp_s": ints},
        {"swarm_id": "s", "node_id": "node-a", "advertise": "10.0.0.1:7420", "timestamp_s": NOW_S},
    ),
    "request": (
        auth.request_tag, auth.check_request_tag,
        {"method": texts, "node_id": texts, "swarm_id": texts, "timestamp_s": ints},
        {"method": "Leave", "node_id": "node-a", "swarm_id": "s", "timestamp_s": NOW_S},
    ),
    "contribution": (
        auth.contribution_tag, auth.check_contribution_tag,
        {"swarm_id": texts, "round_id": ints, "sender_id": texts, "contribution_digest": texts,
         "codec": texts, "weight": weights, "total_elements": ints},
        {"swarm_id": "s", "round_id": 7, "sender_id": "node-a", "contribution_digest": "ab" * 32,
         "codec": "int8", "weight": 512.0, "total_elements": 10_000},
    ),
    "state": (
        auth.state_tag, auth.check_state_tag,
        {"swarm_id": texts, "round_id": ints, "param_digest": texts, "momentum_digest": texts,
         "n_elements": ints, "inner_steps_total": ints, "manifest_hash": texts},
        {"swarm_id": "s", "round_id": 7, "param_digest": "cd" * 32, "momentum_digest": "",
         "n_elements": 10_000, "inner_steps_total": 3_500, "manifest_hash": "a1" * 32},
    ),
}
TIMED = {"hello", "request"}


def check(kind: str, secret: bytes, tag: str, fields: dict[str, Any]) -> None:
    _, check_fn, _, _ = KINDS[kind]
    extra = {"now_s": fields["timestamp_s"]} if kind in TIMED else {}
    check_fn(secret, tag, **fields, **extra)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_round_trip(kind: str) -> None:
    make, _, _, example = KINDS[kind]
    tag = make(SECRET, **example)
    assert len(tag) == auth.TAG_HEX_CHARS and int(tag, 16) >= 0
    check(kind, SECRET, tag, example)
    assert make(SECRET, **example) == tag  # deterministic


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_wrong_secret_fails(kind: str) -> None:
    make, _, _, example = KINDS[kind]
    with pytest.raises(AuthError, match="membership proof does not match"):
        check(kind, OTHER_SECRET, make(SECRET, **example), example)


@pytest.mark.parametrize("kind", sorted(KINDS))
@given(data=st.data())
def test_every_field_change_breaks_the_tag(kind: str, data: st.DataObject) -> None:
    make, _, strategies, _ = KINDS[kind]
    fields = {name: data.draw(strategy, label=name) for name, strategy in strategies.items()}
    tag = make(SECRET, **fields)
    name = data.draw(st.sampled_from(sorted(strategies)), label="changed field")
    changed = data.draw(strategies[name].filter(lambda v: v != fields[name]), label="new value")
    with pytest.raises(AuthError):
        check(kind, SECRET, tag, {**fields, name: changed})


@pytest.mark.parametrize("kind", sorted(KINDS))
@given(tag=st.text(max_size=80))
def test_any_other_tag_string_is_a_mismatch_not_a_crash(kind: str, tag: str) -> None:
    make, _, _, example = KINDS[kind]
    if tag == make(SECRET, **example):
        return
    with pytest.raises(AuthError):
        check(kind, SECRET, tag, example)


def test_fields_are_length_prefixed_not_joined() -> None:
    a = auth.hello_tag(SECRET, swarm_id="ab", node_id="c", advertise="", timestamp_s=1)
    b = auth.hello_tag(SECRET, swarm_id="a", node_id="bc", advertise="", timestamp_s=1)
    assert a != b
    assert auth.encode_fields("x", "ab", "c") != auth.encode_fields("x", "a", "bc")


def test_a_tag_made_for_one_purpose_is_refused_for_another() -> None:
    fields: dict[str, Any] = {"node_id": "node-a", "swarm_id": "s", "timestamp_s": NOW_S}
    hello = auth.hello_tag(SECRET, advertise="Leave", **fields)
    assert hello != auth.request_tag(SECRET, method="Leave", **fields)
    with pytest.raises(AuthError):
        auth.check_request_tag(SECRET, hello, method="Leave", now_s=NOW_S, **fields)


def test_contribution_replayed_into_another_round_fails() -> None:
    fields = KINDS["contribution"][3]
    tag = auth.contribution_tag(SECRET, **fields)
    with pytest.raises(AuthError, match="round 8: contribution from 'node-a'"):
        auth.check_contribution_tag(SECRET, tag, **{**fields, "round_id": 8})


def test_forwarded_contribution_cannot_be_relabelled_to_another_sender() -> None:
    fields = KINDS["contribution"][3]
    tag = auth.contribution_tag(SECRET, **fields)
    with pytest.raises(AuthError):
        auth.check_contribution_tag(SECRET, tag, **{**fields, "sender_id": "node-b"})


@pytest.mark.parametrize("kind", sorted(TIMED))
@pytest.mark.parametrize(("offset_s", "ok"), [(0, True), (300, True), (-300, True),
                                               (301, False), (-301, False), (86_400, False)])
def test_timestamps_are_accepted_only_within_the_skew(kind: str, offset_s: int, ok: bool) -> None:
    make, check_fn, _, example = KINDS[kind]
    tag = make(SECRET, **example)
    now_s = example["timestamp_s"] + offset_s
    if ok:
        check_fn(SECRET, tag, **example, now_s=now_s)
    else:
        with pytest.raises(AuthError, match="replayed, or a clock is wrong"):
            check_fn(SECRET, tag, **example, now_s=now_s)


def test_skew_limit_is_adjustable() -> None:
    example = KINDS["hello"][3]
    tag = auth.hello_tag(SECRET, **example)
    auth.check_hello_tag(SECRET, tag, **example, now_s=NOW_S + 1000, max_skew_s=1000)
    with pytest.raises(AuthError, match="old"):
        auth.check_hello_tag(SECRET, tag, **example, now_s=NOW_S + 31, max_skew_s=30)


def test_weight_is_compared_as_a_float_and_counts_must_be_ints() -> None:
    fields = KINDS["contribution"][3]
    assert auth.contribution_tag(SECRET, **{**fields, "weight": 512}) == \
        auth.contribution_tag(SECRET, **fields)
    with pytest.raises(TypeError):
        auth.contribution_tag(SECRET, **{**fields, "total_elements": 10_000.0})
    with pytest.raises(TypeError):
        auth.contribution_tag(SECRET, **{**fields, "round_id": True})
    with pytest.raises(TypeError):
        auth.contribution_tag(SECRET, **{**fields, "sender_id": None})
    with pytest.raises(ValueError):
        auth.contribution_tag(SECRET, **{**fields, "weight": float("nan")})


def test_golden_tag_pins_the_encoding() -> None:
    # Peers of different versions must agree: changing the encoding must be a deliberate,
    # versioned change (the domain prefix says v1).
    assert auth.encode_fields("t", "ab", "") == (
        b"s\x00\x00\x00\x13neuronode-auth/v1/t" + b"s\x00\x00\x00\x02ab" + b"s\x00\x00\x00\x00")
    assert auth.contribution_tag(SECRET, **KINDS["contribution"][3]) == GOLDEN_CONTRIBUTION_TAG


GOLDEN_CONTRIBUTION_TAG = "1b0ab235b222a67ba7050d634f54cc1adc2608c38425ca36a85b5d5cd2dfcfc4"


def test_short_secret_is_refused_everywhere(tmp_path: Path) -> None:
    with pytest.raises(AuthError, match="at least 16"):
        auth.hello_tag(b"short", **KINDS["hello"][3])
    path = tmp_path / "swarm.secret"
    path.write_bytes(b"  0123456789abcde \n")  # 15 bytes once stripped
    with pytest.raises(AuthError, match="has 15 bytes; it needs at least 16"):
        auth.load_secret(path)


def test_load_secret_strips_whitespace(tmp_path: Path) -> None:
    path = tmp_path / "swarm.secret"
    path.write_bytes(SECRET + b"\n")
    assert auth.load_secret(path) == SECRET
    assert auth.load_secret(str(path)) == SECRET


def test_load_secret_explains_a_missing_or_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(AuthError, match="does not exist; create it with 'openssl rand"):
        auth.load_secret(tmp_path / "missing")
    with pytest.raises(AuthError, match="cannot read swarm secret file"):
        auth.load_secret(tmp_path)  # a directory
    empty = tmp_path / "empty"
    empty.write_bytes(b"\n")
    with pytest.raises(AuthError, match="has 0 bytes"):
        auth.load_secret(empty)


@pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")
def test_permissions_warning(tmp_path: Path) -> None:
    path = tmp_path / "swarm.secret"
    path.write_bytes(SECRET)
    path.chmod(0o600)
    assert auth.permissions_warning(path) is None
    path.chmod(0o644)
    warning = auth.permissions_warning(path)
    assert warning is not None and "mode 0644" in warning and "chmod 600" in warning
    assert auth.permissions_warning(tmp_path / "missing") is None


def test_auth_imports_no_network() -> None:
    from test_layering import imports_of

    names = imports_of(Path(auth.__file__))
    assert not {n for n in names if n.split(".")[0] in ("grpc", "asyncio", "socket", "cryptography")}


@pytest.mark.parametrize("timestamp", ["¹²³", "١٢٣", "1" * 40, "-5", ""])
def test_metadata_with_a_non_ascii_or_absurd_timestamp_is_refused_not_a_crash(timestamp: str) -> None:
    """`"¹²³".isdigit()` is True but int() fails: the node must answer AuthError, never crash."""
    from neuronode.swarm.guard.interceptors import AUTH_KEY
    from neuronode.swarm.guard.proofs import Security

    sec = Security(node_id="a", swarm_id="s", secret=b"k" * 32)
    good = dict(sec.metadata("Hello") or ())[AUTH_KEY]
    assert sec.verify_metadata(((AUTH_KEY, good),), "/neuronode.v1.Node/Hello") == "a"
    node_id, _, tag = good.rsplit(":", 2)
    with pytest.raises(AuthError):
        sec.verify_metadata(((AUTH_KEY, f"{node_id}:{timestamp}:{tag}"),), "/neuronode.v1.Node/Hello")
