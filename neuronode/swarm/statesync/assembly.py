"""The state a joiner assembles: the header it vouched for (every chunk's sha256 under the
state's roots), and the chunks verified against it so far, in any order, from any donor. Pure:
no sockets; `verify` runs in a worker thread, everything else on the loop."""

from __future__ import annotations

import hashlib

from neuronode.codec import Assembler, CodecError, decode_frame
from neuronode.state import STATE_CHUNK_ELEMENTS, GlobalState, chunks_root, state_root
from neuronode.swarm.statesync.donor import TRANSFER_CHUNK_BYTES
from neuronode.swarm.wire import Refusal
from neuronode.v1 import node_pb2 as pb


def header_chunks_root(header: pb.StateHeader) -> str:
    """The chunks_root of the chunk list a donor's header lists (computed here, never taken from
    the header): what its witnesses must have published for the round beside the param_digest
    (RoundDigest.momentum_digest), so the swarm vouches for every chunk digest a download is
    checked against."""
    params = -(-header.n_elements // STATE_CHUNK_ELEMENTS)
    digests = list(header.chunk_digests)
    return chunks_root(digests[:params], digests[params:] if header.has_momentum else None)


class StateReceiver:
    """The vouched header of one state and its chunks verified so far (`held`, stream order)."""

    def __init__(self, header: pb.StateHeader, *, n_elements: int, manifest_hash: str) -> None:
        self.n_elements, self.manifest_hash = n_elements, manifest_hash
        self.parts = {pb.STATE_PART_PARAMS: self.assembler()}
        if header.has_momentum:
            self.parts[pb.STATE_PART_MOMENTUM] = self.assembler()
        self.order = [(part, i) for part, a in self.parts.items() for i in range(a.count)]
        self.held: set[int] = set()
        self.verified_bytes = 0
        self.header = self.check(header)
        self.chunks_root = header_chunks_root(header)

    def assembler(self) -> Assembler:
        return Assembler(n_elems=self.n_elements, codec="fp32", chunk_bytes=TRANSFER_CHUNK_BYTES)

    @property
    def total_bytes(self) -> int:
        return sum(a.size_bytes for a in self.parts.values())

    @property
    def complete(self) -> bool:
        return len(self.held) == len(self.order)

    def missing(self) -> list[int]:
        return [i for i in range(len(self.order)) if i not in self.held]

    def check(self, header: pb.StateHeader) -> pb.StateHeader:
        """A full header (every chunk digest): this model's, its digests hashing to its root."""
        self.check_model(header)
        if header.has_momentum != (pb.STATE_PART_MOMENTUM in self.parts) or len(header.chunk_digests) != len(self.order):
            raise Refusal("INVALID_ARGUMENT", f"the header lists {len(header.chunk_digests)} chunk digests; "
                          f"this state has {len(self.order)} chunks")
        count = self.parts[pb.STATE_PART_PARAMS].count
        digests = list(header.chunk_digests)
        root = state_root(round_id=header.round, inner_steps_total=header.inner_steps_total,
                          n_elements=header.n_elements, params=digests[:count],
                          momentum=digests[count:] if header.has_momentum else None)
        if root != header.state_digest:
            raise Refusal("DATA_LOSS", "the state's chunk digests do not hash to its state_digest")
        return header

    def check_model(self, header: pb.StateHeader) -> None:
        if header.n_elements != self.n_elements or header.manifest_hash != self.manifest_hash:
            raise Refusal("FAILED_PRECONDITION", "donor holds another model (manifest differs)")
        if header.chunk_elements != STATE_CHUNK_ELEMENTS:
            raise Refusal("INVALID_ARGUMENT", f"unexpected chunk_elements {header.chunk_elements}")

    def serves_us(self, header: pb.StateHeader) -> None:
        """The header of a stream of chunks we asked for (without the list): it must be of the
        state we download; raises Refusal (FAILED_PRECONDITION: the donor holds another)."""
        self.check_model(header)
        if header.chunks_root != self.chunks_root:
            raise Refusal("FAILED_PRECONDITION", f"the donor serves another state (round {header.round}) than the "
                          f"one we download (round {self.header.round})")

    def retarget(self, header: pb.StateHeader) -> StateReceiver:
        """A receiver for another vouched `header`, keeping each chunk we verified whose digest
        it lists at the same place (a download cut part way never fetches those again)."""
        other = StateReceiver(header, n_elements=self.n_elements, manifest_hash=self.manifest_hash)
        if len(other.order) == len(self.order):
            for index in sorted(self.held):
                if other.header.chunk_digests[index] == self.header.chunk_digests[index]:
                    part, at = self.order[index]
                    other.store(index, self.parts[part].raw(at))
        return other

    def index_of(self, msg: pb.StateChunk) -> int:
        """A chunk message's place in stream order; raises Refusal for one this state lacks."""
        assembler = self.parts.get(msg.part)
        if assembler is None or not 0 <= msg.chunk_index < assembler.count or msg.chunk_count != assembler.count:
            raise Refusal("INVALID_ARGUMENT", f"unexpected state chunk {msg.part}/{msg.chunk_index} of {msg.chunk_count}")
        return msg.chunk_index + (self.parts[pb.STATE_PART_PARAMS].count if msg.part == pb.STATE_PART_MOMENTUM else 0)

    def verify(self, index: int, msg: pb.StateChunk) -> bytes:
        """Chunk `index`'s raw bytes once decompressed (bounded) and checked against its digest
        in the vouched header (a worker thread); raises Refusal."""
        part, at = self.order[index]
        try:
            raw = decode_frame(msg.payload, msg.compressed, expected_raw_len=self.parts[part].expected_raw_len(at))
        except CodecError as exc:
            raise Refusal("INVALID_ARGUMENT", f"state chunk {index}: {exc}") from None
        if hashlib.sha256(raw).digest() != self.header.chunk_digests[index]:
            raise Refusal("DATA_LOSS", f"state chunk {index} does not match its digest in the vouched chunk list")
        return raw

    def store(self, index: int, raw: bytes) -> None:
        """Keep a verified chunk (on the loop: one writer)."""
        part, at = self.order[index]
        self.parts[part].add(at, raw)
        self.held.add(index)
        self.verified_bytes += len(raw)

    def finish(self) -> GlobalState:
        """The whole state, checked against the header's digests (a worker thread; refuses NaN
        and Inf as it decodes: ValueError)."""
        if not self.complete:
            raise Refusal("DATA_LOSS", f"{len(self.order) - len(self.held)} state chunks are missing")
        if self.part_digest(pb.STATE_PART_PARAMS) != self.header.param_digest:
            raise Refusal("DATA_LOSS", "state parameters do not match the donor's param_digest")
        momentum = None
        if self.header.has_momentum:
            if self.part_digest(pb.STATE_PART_MOMENTUM) != self.header.momentum_digest:
                raise Refusal("DATA_LOSS", "state momentum does not match its digest")
            momentum = self.parts[pb.STATE_PART_MOMENTUM].decode()
        return GlobalState(round=self.header.round, param_digest=self.header.param_digest,
                           params=self.parts[pb.STATE_PART_PARAMS].decode(), momentum=momentum,
                           inner_steps_total=self.header.inner_steps_total)

    def part_digest(self, part: pb.StatePart) -> str:
        assembler, h = self.parts[part], hashlib.sha256()
        for i in range(assembler.count):
            h.update(assembler.raw(i))
        return h.hexdigest()
