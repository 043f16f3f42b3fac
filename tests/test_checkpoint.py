"""Atomic checkpoints: digest-verified, corrupt ones refused, resume gives the same next loss."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch

from neuronode.config import NodeConfig
from neuronode.errors import CheckpointError
from neuronode.events import record_fields
from neuronode.node import checkpoint
from neuronode.node.trainer import Trainer

SMALL = dict(d_model=32, n_layers=1, n_heads=2, seq_len=32, batch_size=4, inner_steps=3,
             threads=1, codec="fp32", rounds=4)


def test_round_trip_and_pruning(tmp_path: Path) -> None:
    for r in range(1, 6):
        checkpoint.save(tmp_path, r, {"round": r}, {"x": torch.full((3,), float(r))}, keep=3)
    names = [p.name for p in checkpoint.list_checkpoints(tmp_path)]
    assert names == ["round-00000005.ckpt", "round-00000004.ckpt", "round-00000003.ckpt"]
    loaded = checkpoint.load_latest(tmp_path)
    assert loaded is not None and loaded.meta["round"] == 5
    assert torch.equal(loaded.state["x"], torch.full((3,), 5.0))
    assert not list(checkpoint.checkpoint_dir(tmp_path).glob("*.tmp"))


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "garbage"])
def test_corrupt_checkpoint_refused_previous_used(tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    checkpoint.save(tmp_path, 1, {"round": 1}, {"x": torch.ones(100)})
    newest = checkpoint.save(tmp_path, 2, {"round": 2}, {"x": torch.zeros(100)})
    blob = bytearray(newest.read_bytes())
    if damage == "flip":
        blob[len(blob) // 2] ^= 0x01
    elif damage == "truncate":
        blob = blob[: len(blob) - 100]
    elif damage == "empty":
        blob = bytearray()
    else:
        blob = bytearray(b"hello world" * 10)
    newest.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError):
        checkpoint.decode(bytes(blob), name=str(newest))
    with caplog.at_level(logging.ERROR):
        loaded = checkpoint.load_latest(tmp_path)
    assert loaded is not None and loaded.meta["round"] == 1
    refused = [record_fields(r) for r in caplog.records if getattr(r, "event", "") == "checkpoint_refused"]
    assert [r["checkpoint"] for r in refused] == [newest.name]


def test_no_checkpoint_gives_none(tmp_path: Path) -> None:
    assert checkpoint.load_latest(tmp_path) is None


def test_trainer_resume_gives_same_next_loss(tmp_path: Path) -> None:
    """Train two rounds, checkpoint, train a third; a fresh trainer from the checkpoint matches."""
    cfg = NodeConfig(data_dir=str(tmp_path), **SMALL)  # type: ignore[arg-type]
    stop = threading.Event()
    a = Trainer(cfg, node_id="node-a")
    for _ in range(2):
        a.train_round(stop)
        a.apply_average(a.pseudo_gradient())  # fp32 alone: the average is our own pseudo-gradient
    checkpoint.save(tmp_path, a.engine.round, {"round": a.engine.round}, a.state_dict())
    a.train_round(stop)
    expected_loss, expected_delta = a.loss, a.engine.pseudo_gradient()

    b = Trainer(cfg, node_id="node-a")
    loaded = checkpoint.load_latest(tmp_path)
    assert loaded is not None
    b.load_state_dict(loaded.state)
    assert b.engine.round == 2
    b.train_round(stop)
    assert b.loss == expected_loss
    assert torch.equal(b.engine.pseudo_gradient(), expected_delta)


FIXTURES = Path(__file__).resolve().parent / "fixtures"
FIXTURE_FLAGS = dict(rounds=2, inner_steps=2, d_model=8, n_layers=1, n_heads=2, batch_size=2, seq_len=8,
                     threads=1, task_option=("corpus_mb=1", "val_windows=4"),
                     node_id="fixture-node", swarm_id="fixture")
# folder, codec, param_digest at round 2 (each folder's README says how it was made)
RELEASES = [
    ("checkpoint-v0.1", "int8", "08ea91195e34efa93569aa00a4f6413c9d5cc86b9667098e39fc3e7e83df62e3"),
    ("checkpoint-v0.4", "sparse", "f8ed7e98b3a65ebe2c6fc1314b52b8e0297f1f2ec1e066da540e8dcf4ec03437"),
]


@pytest.mark.parametrize(("folder", "codec", "digest"), RELEASES, ids=[r[0] for r in RELEASES])
def test_a_checkpoint_of_an_earlier_release_restores(tmp_path: Path, folder: str, codec: str, digest: str) -> None:
    """A checkpoint an earlier release wrote (tests/fixtures/checkpoint-*) restores: its round,
    its parameters (param_digest) and its codec's error feedback."""
    from neuronode.node.daemon import Daemon

    target = checkpoint.checkpoint_dir(tmp_path)
    target.mkdir(parents=True)
    (target / "round-00000002.ckpt").write_bytes((FIXTURES / folder / "round-00000002.ckpt").read_bytes())
    cfg = NodeConfig(data_dir=str(tmp_path), codec=codec, **FIXTURE_FLAGS)  # type: ignore[arg-type]
    stored = checkpoint.load_latest(tmp_path)
    assert stored is not None
    daemon = Daemon(cfg, trainer=Trainer(cfg, node_id="fixture-node"), node_id="fixture-node", data_dir=tmp_path)
    daemon.restore()
    assert daemon.engine.round == 2
    assert daemon.engine.param_digest() == digest
    feedback = daemon.pools.encode.submit(daemon.encoder.state_dict).result()  # the encoder's own thread
    assert feedback is not None
    assert torch.equal(feedback["residual"], stored.state["feedback"]["residual"])
    assert feedback["residual"].abs().sum() > 0
    daemon.pools.shutdown()


def test_save_and_load_hold_no_copy_of_the_serialized_state(tmp_path: Path) -> None:
    """The payload streams to and from the file: Python never holds the serialized bytes (a
    1B-parameter node's state is ~24 GB; three copies of it were made before)."""
    import tracemalloc

    state = {"x": torch.randn(4 << 20)}  # 16 MiB (tensor storage is not traced; bytes objects are)
    tracemalloc.start()
    try:
        checkpoint.save(tmp_path, 1, {"round": 1}, state)
        _, save_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        loaded = checkpoint.load_latest(tmp_path)
        _, load_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert loaded is not None and torch.equal(loaded.state["x"], state["x"])
    assert save_peak < 4 << 20 and load_peak < 4 << 20, (save_peak, load_peak)
