"""Plain data shared by the training side and the swarm side, and the one digest of a state."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import torch

STATE_CHUNK_ELEMENTS = 1 << 18  # float32 elements per state chunk (1 MiB): the unit of transfer and of its digest


@dataclass(frozen=True)
class GlobalState:
    """What a node needs to continue with the swarm's model."""

    round: int
    param_digest: str
    params: torch.Tensor  # flat float32
    momentum: torch.Tensor | None  # flat float32, None before the first outer step
    inner_steps_total: int


def chunk_digests(vector: torch.Tensor) -> list[bytes]:
    """sha256 of each STATE_CHUNK_ELEMENTS slice of a flat float32 vector's little-endian bytes."""
    flat = vector.detach().to(torch.float32).contiguous().view(-1).numpy()
    return [hashlib.sha256(flat[start:start + STATE_CHUNK_ELEMENTS].data.cast("B")).digest()
            for start in range(0, flat.size, STATE_CHUNK_ELEMENTS)]


def state_root(*, round_id: int, inner_steps_total: int, n_elements: int, params: list[bytes],
               momentum: list[bytes] | None) -> str:
    """The state's digest: sha256 over its round, inner step count, size and the digests of its
    chunks (parameters, then momentum). Every chunk verifies on arrival against its own digest,
    the list of them against this root, so one digest vouches for the whole state."""
    h = hashlib.sha256(b"neuronode-state/1")
    h.update(struct.pack("<QQQ?", round_id, inner_steps_total, n_elements, momentum is not None))
    for digest in [*params, *(momentum or [])]:
        h.update(digest)
    return h.hexdigest()


def chunks_root(params: list[bytes], momentum: list[bytes] | None) -> str:
    """What a member publishes per round beside its param_digest (`RoundDigest.momentum_digest`,
    the name it had when it covered the momentum only), so that witnesses vouch for the whole
    chunk list of a donated state: sha256 over the digests of its chunks, parameters then
    momentum. A donor's header lists the same digests, so the joiner computes it before it
    downloads anything, and then checks every chunk, from any donor, against that vouched list
    as it arrives. Unlike `state_root` it leaves out the inner step count (members with other
    --inner-steps hold other counts; it only sets where the joiner's inner learning-rate
    schedule goes on) and the round (the witnesses publish it per round)."""
    h = hashlib.sha256(b"neuronode-chunks/1")
    h.update(struct.pack("<?", momentum is not None))
    for digest in [*params, *(momentum or [])]:
        h.update(digest)
    return h.hexdigest()


def state_digest(state: GlobalState) -> tuple[str, str]:
    """`state_root` and `chunks_root` of a whole state (hashes all of it: run it off the event
    loop)."""
    params = chunk_digests(state.params)
    momentum = chunk_digests(state.momentum) if state.momentum is not None else None
    return (state_root(round_id=state.round, inner_steps_total=state.inner_steps_total,
                       n_elements=state.params.numel(), params=params, momentum=momentum),
            chunks_root(params, momentum))
