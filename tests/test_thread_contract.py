"""The thread contract: everything that touches the wire encoder and error feedback runs on
one thread (VectorEncoder keeps its last zstd rate and is not thread-safe; error feedback is a
running sum). Two real daemons in one process, reduce-scatter under --overlap: the case where a
reducer's averaged shard is encoded while the next round's contribution is."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import free_port

from neuronode.codec import ErrorFeedback, VectorEncoder
from neuronode.config import NodeConfig

TINY = dict(rounds=3, inner_steps=2, d_model=8, n_layers=1, n_heads=2, batch_size=2, seq_len=8,
            threads=1, task_option=("corpus_mb=1", "val_windows=4"), codec="int8",
            averaging="reduce-scatter", overlap=True, min_peers=2, heartbeat_s=0.2,
            sync_timeout=20.0, swarm_id="threads")


def recording(fn: Callable[..., Any], seen: set[str]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        seen.add(threading.current_thread().name)
        return fn(*args, **kwargs)

    return wrapper


@pytest.mark.timeout(120)
def test_encoder_and_error_feedback_run_on_one_thread_per_node(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from neuronode.library import Swarm
    from neuronode.node.startup import Identity
    from neuronode.node.trainer import Trainer
    from neuronode.security.identity import NodeKey

    seen: set[str] = set()
    monkeypatch.setattr(VectorEncoder, "encode", recording(VectorEncoder.encode, seen))
    for name in ("compensate", "update_parts", "reset"):
        monkeypatch.setattr(ErrorFeedback, name, recording(getattr(ErrorFeedback, name), seen))
    ports = {"a": free_port(), "b": free_port()}
    trainers: list[Trainer] = []
    failures: list[BaseException] = []

    def member(name: str, other: str) -> None:
        """One node as `neuronode start` runs it: its trainer's loop, the node beside it."""
        try:
            cfg = NodeConfig(data_dir=str(tmp_path / name), listen=f"127.0.0.1:{ports[name]}",
                             peers=(f"127.0.0.1:{ports[other]}",), node_id=f"node-{name}", **TINY)
            (tmp_path / name).mkdir()
            trainer = Trainer(cfg, node_id=cfg.node_id)
            trainers.append(trainer)
            identity = Identity(node_id=cfg.node_id, key=NodeKey.generate(), data_dir=tmp_path / name)
            swarm = Swarm.around(trainer, identity=identity, stop=None, progress=False)
            trainer.train(swarm.step, stop=threading.Event(), finished=lambda: swarm.finished)
            swarm.close()
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=member, args=pair) for pair in (("a", "b"), ("b", "a"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert [t.engine.round for t in trainers] == [3, 3]
    # One thread name per node's encoder; both nodes' pools share their names, so one name in all.
    assert len(seen) == 1, f"encoder and error feedback ran on several threads: {sorted(seen)}"
