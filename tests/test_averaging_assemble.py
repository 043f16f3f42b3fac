"""Pure helpers of the averaging protocols (no processes, no sockets)."""

from __future__ import annotations

import torch

from neuronode.averaging.reducescatter import assemble
from neuronode.codec import Phase, VectorEncoder, shard_ranges


def test_assemble_shards_concatenates_and_zeroes_a_missing_reducers_shard() -> None:
    """Every averaged shard lands in its range; a reducer that sent nothing leaves zeros there
    (the output buffer starts uninitialised, so this must be explicit)."""
    members = ("a", "b", "c")
    n = 1000
    ranges = shard_ranges(n, len(members), "int8")
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    enc = VectorEncoder(codec="int8", chunk_bytes=256, zstd_level=0, byte_shuffle=False)
    averaged = {}
    for index, member in enumerate(members):
        if member == "b":
            continue  # b died before sending its averaged shard
        start, stop = ranges[index]
        averaged[member] = enc.encode(x[start:stop], 0.0, round_id=4, sender_id=member, members=members,
                                      contributors=members, shard_index=index, phase=Phase.AVERAGED)
    for _ in range(3):  # reuse of freed buffers must not leak old values into the gap
        junk = torch.full((n,), 7.0)
        del junk
        average, contributors = assemble(averaged, members, ranges, n, round_id=4)
        assert contributors == ["a", "b", "c"]
        b_start, b_stop = ranges[1]
        assert torch.equal(average[b_start:b_stop], torch.zeros(b_stop - b_start))
        for index in (0, 2):
            start, stop = ranges[index]
            assert torch.equal(average[start:stop], averaged[members[index]].data.decode())
