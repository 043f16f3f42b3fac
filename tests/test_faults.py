"""The fault plan's stream cuts: which outgoing contribution streams break, and where."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neuronode.swarm.faults import Faults
from neuronode.v1 import node_pb2 as pb

C = "127.0.0.1:7503"
B = "127.0.0.1:7502"


def plan(tmp_path: Path, **fields: object) -> Faults:
    path = tmp_path / "faults.json"
    path.write_text(json.dumps(fields))
    faults = Faults(str(path))
    faults.refresh()
    return faults


def allowed(faults: Faults, index: int, address: str, phase: int) -> bool:
    return faults.chunk_allowed(index, address=address, phase=phase)


def test_cut_after_chunks_breaks_every_stream_without_a_target(tmp_path: Path) -> None:
    faults = plan(tmp_path, cut_after_chunks=2)
    for address in (B, C):
        for phase in (pb.PHASE_UNSPECIFIED, pb.PHASE_SHARD, pb.PHASE_AVERAGED):
            assert [allowed(faults, i, address, phase) for i in range(4)] == [True, True, False, False]


def test_cut_to_and_cut_phase_narrow_the_cut(tmp_path: Path) -> None:
    faults = plan(tmp_path, cut_after_chunks=1, cut_to=[C], cut_phase="averaged")
    assert allowed(faults, 0, C, pb.PHASE_AVERAGED)
    assert not allowed(faults, 1, C, pb.PHASE_AVERAGED)
    assert allowed(faults, 1, B, pb.PHASE_AVERAGED)  # another peer
    assert allowed(faults, 1, C, pb.PHASE_SHARD)  # another phase
    assert allowed(faults, 1, C, pb.PHASE_UNSPECIFIED)
    faults = plan(tmp_path, cut_after_chunks=1, cut_phase="whole")
    assert not allowed(faults, 1, B, pb.PHASE_UNSPECIFIED)
    assert allowed(faults, 1, B, pb.PHASE_SHARD)


def test_no_plan_file_cuts_nothing() -> None:
    assert Faults(None).chunk_allowed(10**6, address=C, phase=pb.PHASE_AVERAGED)


def test_a_misspelt_phase_is_refused_and_the_previous_plan_kept(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    faults = plan(tmp_path, cut_after_chunks=1, cut_phase="averagd")
    assert "cut_phase must be one of whole, shard, averaged" in caplog.text
    assert faults.plan.cut_after_chunks == 0  # nothing of the unreadable plan applies
