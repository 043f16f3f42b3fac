"""Atomic checkpoints with digests.

File layout (one file per completed round, `checkpoints/round-00000012.ckpt`):

    MAGIC | u64 meta_len | meta JSON | u64 payload_len | payload (torch.save) | sha256(all before)

Writing goes to a temp file, fsync, rename, fsync of the folder, so a crash leaves either the old
or the new file, never half of one. Loading verifies the trailing digest; a corrupt or truncated
file is refused with a message and the next older good one is used. Both stream: the payload
goes from torch.save to the file and back through a window on it, the digest is computed in
1 MiB chunks, so memory holds the state once, never its serialized bytes.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

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
    """Serialize meta + state into the checkpoint byte layout (digest included), in memory."""
    buf = io.BytesIO()
    write(buf, meta, state)  # torch is imported there, not at the top: `status --data-dir` reads meta only
    return buf.getvalue()


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
    """Write the checkpoint for `round_id` atomically and prune all but the newest `keep`.

    The payload streams from torch.save into the file and the digest is taken reading it back,
    so no copy of the serialized state is held in memory (a 1B-parameter node's is ~24 GB)."""
    folder = checkpoint_dir(data_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"round-{round_id:08d}.ckpt"
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w+b") as fh:
        write(fh, meta, state)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(folder)
    for old in list_checkpoints(data_dir)[keep:]:
        old.unlink(missing_ok=True)
    return path


def write(fh: BinaryIO, meta: dict[str, Any], state: dict[str, Any]) -> None:
    """The checkpoint layout into `fh` (opened w+b at its start): what `encode` returns."""
    import torch

    meta_b = json.dumps(meta, sort_keys=True).encode()
    fh.write(b"".join([MAGIC, U64.pack(len(meta_b)), meta_b, U64.pack(0)]))
    start = fh.tell()
    torch.save(state, fh)
    end = fh.tell()
    fh.seek(start - U64.size)
    fh.write(U64.pack(end - start))
    fh.seek(0)
    hasher = hashlib.sha256()
    for chunk in _chunks(fh, end):
        hasher.update(chunk)
    fh.seek(end)
    fh.write(hasher.digest())


def read(path: Path, *, meta_only: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """Verify and parse a checkpoint file without holding its bytes: the digest streams, the
    payload loads through a window on the file. Raises CheckpointError with the reason."""
    name = str(path)
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size < len(MAGIC) + 2 * U64.size + DIGEST_BYTES or fh.read(len(MAGIC)) != MAGIC:
            raise CheckpointError(f"{name} is not a neuronode checkpoint or is truncated")
        fh.seek(0)
        hasher = hashlib.sha256()
        for chunk in _chunks(fh, size - DIGEST_BYTES):
            hasher.update(chunk)
        if hasher.digest() != fh.read(DIGEST_BYTES):
            raise CheckpointError(f"{name} is corrupt or truncated (digest mismatch)")
        fh.seek(len(MAGIC))
        (meta_len,) = U64.unpack(fh.read(U64.size))
        meta = json.loads(fh.read(meta_len))
        (payload_len,) = U64.unpack(fh.read(U64.size))
        start = fh.tell()
        if start + payload_len != size - DIGEST_BYTES:
            raise CheckpointError(f"{name} has an inconsistent length")
        if meta_only:
            return meta, {}
        import torch

        state = torch.load(io.BufferedReader(_Window(fh, start, payload_len)), map_location="cpu", weights_only=False)
        return meta, state


def _chunks(fh: BinaryIO, n_bytes: int, chunk_bytes: int = 1 << 20) -> Iterator[bytes]:
    """The next `n_bytes` of `fh`, in chunks."""
    while n_bytes > 0:
        chunk = fh.read(min(chunk_bytes, n_bytes))
        if not chunk:
            raise CheckpointError("checkpoint ended early")
        n_bytes -= len(chunk)
        yield chunk


class _Window(io.RawIOBase):
    """`length` bytes of `fh` from `start`, as a seekable file of their own (torch.load's zip
    reader seeks relative to the payload's start)."""

    def __init__(self, fh: BinaryIO, start: int, length: int) -> None:
        self.fh, self.start, self.length, self.pos = fh, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, min(self.length, base + offset))
        return self.pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = min(len(view), self.length - self.pos)
        if n <= 0:
            return 0
        self.fh.seek(self.start + self.pos)
        got = self.fh.readinto(view[:n])  # type: ignore[attr-defined]
        self.pos += got
        return got


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
            meta, state = read(path, meta_only=meta_only)
        except (CheckpointError, OSError, ValueError, RuntimeError) as exc:
            logger.error("refusing checkpoint %s: %s; trying the previous one", path, exc,
                         extra=fields("checkpoint_refused", checkpoint=path.name, reason=str(exc)))
            continue
        return Loaded(path=path, meta=meta, state=state)
    return None
