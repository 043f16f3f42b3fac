"""Atomic checkpoints with digests.

File layout (one file per completed round, `checkpoints/round-00000012.ckpt`):

    MAGIC | u64 meta_len | meta JSON | u64 payload_len | payload (torch.save) | sha256(all before)

Writing goes to a temp file, fsync, rename, fsync of the folder, so a crash leaves either the old
or the new file, never half of one. Loading verifies the trailing digest; a corrupt or truncated
file is refused with a message and the next older good one is used.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuronode.errors import CheckpointError
from neuronode.events import fields

logger = logging.getLogger(__name__)

MAGIC = b"NEURONODE-CKPT1\n"
DIGEST_BYTES = 32
U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class Loaded:
    """A verified checkpoint: its small JSON `meta` and the torch `state`."""

    path: Path
    meta: dict[str, Any]
    state: dict[str, Any]


def checkpoint_dir(data_dir: str | Path) -> Path:
    return Path(data_dir) / "checkpoints"


def encode(meta: dict[str, Any], state: dict[str, Any]) -> bytes:
    """Serialize meta + state into the checkpoint byte layout (digest included)."""
    import torch  # here, not at the top: `neuronode status --data-dir` reads meta only, without torch

    buf = io.BytesIO()
    torch.save(state, buf)
    meta_b = json.dumps(meta, sort_keys=True).encode()
    payload = buf.getvalue()
    body = b"".join([MAGIC, U64.pack(len(meta_b)), meta_b, U64.pack(len(payload)), payload])
    return body + hashlib.sha256(body).digest()


def decode(blob: bytes, *, name: str = "checkpoint", meta_only: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """Verify and parse checkpoint bytes; raise CheckpointError with the reason."""
    if len(blob) < len(MAGIC) + 2 * U64.size + DIGEST_BYTES or not blob.startswith(MAGIC):
        raise CheckpointError(f"{name} is not a neuronode checkpoint or is truncated")
    body, digest = blob[:-DIGEST_BYTES], blob[-DIGEST_BYTES:]
    if hashlib.sha256(body).digest() != digest:
        raise CheckpointError(f"{name} is corrupt or truncated (digest mismatch)")
    pos = len(MAGIC)
    (meta_len,) = U64.unpack_from(body, pos)
    pos += U64.size
    meta = json.loads(body[pos : pos + meta_len])
    pos += meta_len
    (payload_len,) = U64.unpack_from(body, pos)
    pos += U64.size
    if pos + payload_len != len(body):
        raise CheckpointError(f"{name} has an inconsistent length")
    if meta_only:
        return meta, {}
    import torch

    state = torch.load(io.BytesIO(body[pos:]), map_location="cpu", weights_only=False)
    return meta, state


def save(data_dir: str | Path, round_id: int, meta: dict[str, Any], state: dict[str, Any], *, keep: int = 3) -> Path:
    """Write the checkpoint for `round_id` atomically and prune all but the newest `keep`."""
    folder = checkpoint_dir(data_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"round-{round_id:08d}.ckpt"
    tmp = path.with_suffix(".tmp")
    blob = encode(meta, state)
    with open(tmp, "wb") as fh:
        fh.write(blob)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(folder)
    for old in list_checkpoints(data_dir)[keep:]:
        old.unlink(missing_ok=True)
    return path


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(data_dir: str | Path) -> list[Path]:
    """Checkpoint files, newest round first."""
    folder = checkpoint_dir(data_dir)
    if not folder.is_dir():
        return []
    return sorted(folder.glob("round-*.ckpt"), reverse=True)


def load_latest(data_dir: str | Path, *, meta_only: bool = False) -> Loaded | None:
    """The newest checkpoint that verifies; bad ones are reported and skipped. None if none."""
    for path in list_checkpoints(data_dir):
        try:
            meta, state = decode(path.read_bytes(), name=str(path), meta_only=meta_only)
        except (CheckpointError, OSError, ValueError, RuntimeError) as exc:
            logger.error("refusing checkpoint %s: %s; trying the previous one", path, exc,
                         extra=fields("checkpoint_refused", checkpoint=path.name, reason=str(exc)))
            continue
        return Loaded(path=path, meta=meta, state=state)
    return None
