"""The one contribution record, from the encoder to the assembler, and the encoder that makes it.

A `Contribution` is one node's pseudo-gradient (or a reduce-scatter slice or averaged shard of
it) for one round: who made it and for what (round, sender, phase, shard, members, the
parameters it started from), its weight, and its payload. `data` holds the raw codec payloads
(an Assembler), decoded lazily: a node averages the decoded wire form of every contribution,
its own included, so lossy codecs leave every replica with the same result. The sender's own
record also holds its `frames` (zstd output or raw payloads, what goes on the wire); a received
one has none, since its payloads are already in `data`.

`VectorEncoder` is what a node and `neuronode bench sync` both use, so the benchmark measures
exactly the node's encoding. Pure CPU work; callers run it in a thread.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from neuronode.codec.feedback import ErrorFeedback
from neuronode.codec.framing import Assembler, ContributionDigest, Frame, encode_frames
from neuronode.codec.geometry import chunk_elements
from neuronode.codec.quant import CodecError
from neuronode.codec.registry import get_codec

logger = logging.getLogger(__name__)

AUTO_ZSTD = -1  # --zstd-level -1
SLOW_LINK_BYTES_PER_S = 10e6  # 80 Mbit/s: below this, every byte saved counts


def auto_zstd_level(link_bytes_per_s: float, compress_bytes_per_s: float, *, capped: bool = False,
                    saved_fraction: float = 1.0) -> int:
    """--zstd-level auto. zstd costs 1/compress seconds per raw byte and saves saved_fraction/link
    seconds of sending: skip it unless it saves more than it costs (compress x saved > link); level 1
    when it pays or nothing is measured yet; level 3 only on a known slow link (an upload cap
    under 80 Mbit/s), since a measured push rate also reflects a busy receiver.
    `link_bytes_per_s` is the rate at which this encoding leaves (the upload rate divided by the
    number of peers it is sent to)."""
    if link_bytes_per_s <= 0 or compress_bytes_per_s <= 0:
        return 1
    if compress_bytes_per_s * saved_fraction <= link_bytes_per_s:
        return 0
    return 3 if capped and link_bytes_per_s < SLOW_LINK_BYTES_PER_S else 1


class Phase(enum.IntEnum):
    """What a contribution is (the wire's ContributionChunk.phase has the same numbers)."""

    WHOLE = 0  # a whole pseudo-gradient (all-to-all)
    SHARD = 1  # reduce-scatter: one member's slice of the reducer's shard
    AVERAGED = 2  # reduce-scatter: a reducer's averaged shard
    UPDATE = 3  # a round's averaged pseudo-gradient as a member applied it (catching up by rounds)

    @property
    def label(self) -> str:
        return ("contribution", "shard slices", "averaged shard", "averaged update")[self]


@dataclass
class Contribution:
    """One contribution for one round (see the module docstring)."""

    round_id: int
    sender_id: str
    codec: str  # the codec's wire name (a sparse codec's parameters are the swarm's settings)
    weight: float
    data: Assembler  # raw codec payloads; decode(), add_into() and decode_into() read them
    n_elements: int  # elements of the whole model (a shard covers part of them)
    digest: str  # BLAKE3 of the raw payloads in order
    chunk_elements: int
    shuffled: bool = False
    base_digest: str = ""  # param_digest of the parameters the sender's round started from
    phase: Phase = Phase.WHOLE
    shard_index: int = 0
    members: tuple[str, ...] = ()  # reduce-scatter: the round's members (sorted)
    contributors: tuple[str, ...] = ()  # averaged shard: whom it averages
    # The host its maker says its connections come from (what its peers agree they see; "" on
    # loopback or while unknown): the average weighs a host's ids as one member by it, and every
    # receiver that sees the maker itself checks it (neuronode.averaging.protocol).
    host: str = ""
    frames: list[Frame] = field(default_factory=list, repr=False)  # ours only: what goes on the wire
    zstd_level: int = 0
    # The maker's signature over its statement (neuronode.averaging.agreement) and its key: a
    # received contribution keeps them, so we can list it in our receipt and serve it on.
    signature: bytes = field(default=b"", repr=False)
    public_key: bytes = field(default=b"", repr=False)

    @property
    def lineage(self) -> tuple[str, tuple[str, ...]]:
        """Only contributions made from the same parameters, for the same members, average."""
        return (self.base_digest, self.members)

    @property
    def frame_bytes(self) -> int:
        return sum(len(f.data) for f in self.frames)


@dataclass
class VectorEncoder:
    """Encodes flat float32 vectors with one codec: the zstd level (auto included), the
    byte-shuffle rule, frames, digest, and an Assembler of the raw payloads (a node averages the
    decoded wire form of its own contribution too, so lossy codecs leave every replica with the
    same result). One thread at a time: it keeps the last measured zstd rate."""

    codec: str
    chunk_bytes: int
    zstd_level: int  # AUTO_ZSTD: auto_zstd_level(link rate, our last zstd rate)
    byte_shuffle: bool
    capped: bool = False  # an upload cap is set (auto may then compress harder)
    compress_rate: float = 0.0  # bytes/s our last zstd pass managed (0: not measured)
    saved_fraction: float = 1.0  # share of the raw bytes our last zstd pass saved

    def encode(self, vector: torch.Tensor, link_bytes_per_s: float, *, weight: float = 1.0,
               round_id: int = 0, sender_id: str = "", **identity: Any) -> Contribution:
        """`vector` encoded into a Contribution of `round_id` by `sender_id`; `identity` gives
        the other fields of who made it and for what (phase, shard_index, members, ...)."""
        c = get_codec(self.codec)
        level = self.zstd_level
        if level == AUTO_ZSTD:
            level = auto_zstd_level(link_bytes_per_s, self.compress_rate, capped=self.capped,
                                    saved_fraction=self.saved_fraction)
        # Byte planes compress better for float codecs (measured: fp32 1.11x -> 1.27x, bf16
        # 1.29x -> 1.47x with zstd 1); int codecs have one-byte elements, nothing to split.
        shuffle = self.byte_shuffle and c.shuffle_width > 1 and level > 0
        digest = ContributionDigest()
        own = Assembler(n_elems=vector.numel(), codec=self.codec, chunk_bytes=self.chunk_bytes, shuffle=shuffle)
        started = time.perf_counter()
        frames = list(encode_frames(vector, codec=self.codec, chunk_bytes=self.chunk_bytes,
                                    zstd_level=level, shuffle=shuffle, digest=digest, own=own))
        if level > 0 and vector.numel():
            elapsed_s = max(time.perf_counter() - started, 1e-9)
            raw_bytes = sum(f.raw_len for f in frames)
            self.compress_rate = raw_bytes / elapsed_s
            self.saved_fraction = max(0.0, 1.0 - sum(len(f.data) for f in frames) / raw_bytes)
        identity.setdefault("n_elements", vector.numel())
        return Contribution(round_id=round_id, sender_id=sender_id, codec=c.name, weight=weight,
                            data=own, digest=digest.hexdigest(),
                            chunk_elements=chunk_elements(self.codec, self.chunk_bytes),
                            shuffled=shuffle, frames=frames, zstd_level=level, **identity)


@dataclass(frozen=True)
class EncoderConfig:
    codec: str  # a name get_codec takes (the sparse codec's with its parameters: codec_spec)
    chunk_bytes: int
    zstd_level: int  # AUTO_ZSTD: auto by measured link speed
    byte_shuffle: bool
    capped: bool = False  # an upload cap is set (auto zstd may compress harder)
    feedback_decay: float = 1.0  # error feedback: residual × decay + Δ (--sparse-decay)


@dataclass
class Encoded:
    """Our contribution of a round: its parts (one, or one shard per member) and the
    compensated pseudo-gradient they encode (--overlap's look-ahead needs it)."""

    parts: list[Contribution]
    compensated: torch.Tensor


Aggregate = Callable[[Mapping[str, Any]], torch.Tensor]


class ContributionEncoder:
    """A node's wire encoder and error feedback, used from one thread only.

    VectorEncoder keeps the last measured zstd rate and error feedback is a running sum: neither
    is thread-safe. Under --overlap with reduce-scatter a reducer encodes round r's averaged
    shard while round r+1's contribution is being encoded, so a node runs every method here on
    one executor thread of its own, and a call from another thread raises."""

    def __init__(self, cfg: EncoderConfig, *, n_elements: int, sender_id: str) -> None:
        self.cfg = cfg
        self.sender_id = sender_id
        self.vector = VectorEncoder(codec=cfg.codec, chunk_bytes=cfg.chunk_bytes, zstd_level=cfg.zstd_level,
                                    byte_shuffle=cfg.byte_shuffle, capped=cfg.capped)
        self.n_elements = n_elements
        self.feedback = ErrorFeedback(n_elements, decay=cfg.feedback_decay) if get_codec(cfg.codec).lossy else None
        self.residual_norm = 0.0  # L2 norm of the feedback's residual after the last encode (a float: read anywhere)
        # Rounds of pseudo-gradient the feedback carries (`carry`, each faded by the decay since):
        # 0 when what it holds is only what the wire lost.
        self.carried_rounds = 0.0
        self._thread: int | None = None

    def _on_one_thread(self) -> None:
        ident = threading.get_ident()
        if self._thread is None:
            self._thread = ident
        if ident != self._thread:
            raise RuntimeError("a ContributionEncoder is used from one thread only (the node's encoder pool)")

    def contribution(self, delta: torch.Tensor, ranges: list[tuple[int, int]], link_bytes_per_s: float, *,
                     weight: float, round_id: int, **identity: Any) -> Encoded:
        """`delta` plus the feedback carried from the last round, cut at `ranges` (one range, or
        one shard per member: part j gets shard_index j), each part encoded on its own; the
        feedback then learns from the wire form."""
        self._on_one_thread()
        rounds = self.cfg.feedback_decay * self.carried_rounds + 1.0
        if self.feedback is not None:
            delta = self.feedback.compensate(delta)
        # Rounds carried (`carry`) are sent as their mean: the weight stays one round's samples.
        sent = delta if rounds == 1.0 else delta / rounds
        parts = [self.vector.encode(sent[a:b], link_bytes_per_s, weight=weight, round_id=round_id,
                                    sender_id=self.sender_id, shard_index=j, n_elements=delta.numel(), **identity)
                 for j, (a, b) in enumerate(ranges)]
        if self.feedback is not None:
            self.feedback.update_parts(delta, [(a, p.data) for (a, _), p in zip(ranges, parts, strict=True)],
                                       scale=rounds)
            self.residual_norm = float(self.feedback.residual.norm())
        self.carried_rounds = 0.0
        return Encoded(parts=parts, compensated=delta)

    def carry(self, delta: torch.Tensor) -> None:
        """A round we do not send (`--averaging gather`, not one of its makers): `delta` joins
        the feedback (residual ← decay × residual + delta), to go with our next contribution,
        which sends the rounds it carries as their mean (`contribution`)."""
        self._on_one_thread()
        if self.feedback is None:  # a lossless codec keeps none until it first carries
            self.feedback = ErrorFeedback(self.n_elements, decay=self.cfg.feedback_decay)
        self.feedback.residual = self.feedback.compensate(delta)
        self.carried_rounds = self.cfg.feedback_decay * self.carried_rounds + 1.0
        self.residual_norm = float(self.feedback.residual.norm())

    def reduce(self, aggregate: Aggregate, pieces: Mapping[str, Contribution], link_bytes_per_s: float, *,
               round_id: int, **identity: Any) -> Contribution:
        """A reducer's job: aggregate every member's slice of our shard (sorted by node id), then
        encode the result as our averaged shard; its weight is the total of the pieces'."""
        self._on_one_thread()
        avg = aggregate({sender: (c.data, c.weight) for sender, c in pieces.items()})
        weight = float(sum(c.weight for c in pieces.values()))

        def encode(shard: torch.Tensor) -> Contribution:
            return self.vector.encode(shard, link_bytes_per_s, weight=weight, round_id=round_id,
                                      sender_id=self.sender_id, phase=Phase.AVERAGED,
                                      contributors=tuple(sorted(pieces)), **identity)

        try:  # the encoder refuses NaN/Inf in the pass it makes anyway (no second pass here)
            return encode(avg)
        except CodecError:
            logger.error("round %d: averaged shard is not finite; sending a zero update for it", round_id)
            return encode(torch.zeros_like(avg))

    def reset(self) -> None:
        """After adopting the swarm's state: the feedback of our old lineage no longer applies."""
        self._on_one_thread()
        if self.feedback is not None:
            self.feedback.reset()
            self.residual_norm = 0.0
        self.carried_rounds = 0.0

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        self._on_one_thread()
        if self.feedback is None:
            return None
        state = self.feedback.state_dict()
        if self.carried_rounds:
            state["carried_rounds"] = torch.tensor(self.carried_rounds, dtype=torch.float64)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore `state_dict()`'s (a checkpoint's; one without `carried_rounds` carries none)."""
        self._on_one_thread()
        carried = state.get("carried_rounds")
        if self.feedback is None and carried is not None:  # a lossless codec that was carrying
            self.feedback = ErrorFeedback(self.n_elements, decay=self.cfg.feedback_decay)
        if self.feedback is not None:
            self.feedback.load_state_dict(state)
            self.residual_norm = float(self.feedback.residual.norm())
            self.carried_rounds = float(carried) if isinstance(carried, torch.Tensor) else 0.0
