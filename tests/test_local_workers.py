"""A member of several processes (DistributedDataParallel inside, gloo on the CPU) with a
single-process member: real `neuronode` processes, started by torchrun or --local-workers."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import Node, documents, llama, poll, run_to_end, stop, torchrun

from neuronode.node import checkpoint
from neuronode.node.status import from_peer

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(400)]

# A tiny model and few steps: each rank is a fresh process with one torch thread.
SMALL = ("--inner-steps", "5", "--batch-size", "4", "--seq-len", "32", "--d-model", "32", "--n-layers", "1",
         "--n-heads", "2", "--task-option", "corpus_mb=1", "--max-local-workers", "2")


def done(node: Node) -> dict[int, dict[str, Any]]:
    """Completed round -> its round_done event."""
    return {e["round"]: e for e in node.events("round_done")}


def streams(node: Node) -> list[dict[str, Any]]:
    """Every rank's data-stream position in the node's newest checkpoint."""
    loaded = checkpoint.load_latest(node.data_dir)
    assert loaded is not None
    return list(loaded.state["rank_batches"])


def running(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its parent to reap it does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_torchrun_member_and_single_process_end_with_one_digest(tmp_path: Path) -> None:
    """torchrun's 2 processes are one member (here training --task hf's tiny Llama): every round's
    average counts it once, weighing twice the samples of the single process; its two ranks end
    with the swarm's digest, each on its own data stream, both positions in the checkpoint.
    (--overlap and a lossy codec with error feedback: what rank 0 sends the other rank includes
    the look-ahead start.)"""
    pytest.importorskip("transformers")
    data = tmp_path / "corpus"
    data.mkdir()
    (data / "stories.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in documents(300)))
    hf = ("--task", "hf", "--task-option", f"model={llama(tmp_path / 'llama')},tokenizer=bytes,data={data}/*.jsonl,"
          "val_share=0.15", "--seq-len", "32", "--batch-size", "4", "--inner-steps", "5", "--inner-lr", "0.01",
          "--max-local-workers", "2")
    args = (*hf, "--rounds", "3", "--min-peers", "2", "--sync-timeout", "60", "--overlap", "--codec", "int8")
    a = Node(tmp_path, "a", *args, "--node-id", "a")
    m = Node(tmp_path, "m", *args, "--node-id", "m", "--peers", a.address, command=torchrun(2))
    run_to_end([a, m], timeout_s=300)
    sa, sm = a.status(), m.status()
    assert sa["round"] == sm["round"] == 3
    assert sa["param_digest"] == sm["param_digest"]
    assert sm["rank_param_digests"] == [sm["param_digest"]] * 2
    (follower,) = m.events("rank_stopped")
    assert (follower["rank"], follower["param_digest"]) == (1, sm["param_digest"])
    single = 5 * 4.0  # inner steps x batch size
    assert [e["weights"] for e in done(a).values()] == [{"a": single, "m": 2 * single}] * 3, a.log()
    assert sm["local_workers"] == 2 and sa["local_workers"] == 1
    assert len(sm["rank_tokens_per_s"]) == 2 and min(sm["rank_tokens_per_s"]) > 0
    assert sm["tokens_per_s"] == pytest.approx(sum(sm["rank_tokens_per_s"]))
    first, second = streams(m)
    assert first["windows"] == second["windows"] == 3 * 5 * 4
    assert first["seed"] != second["seed"]  # each rank its own shuffled stream


def test_rank_killed_member_restarts_then_sigterm_stops_it(tmp_path: Path) -> None:
    """`--local-workers 2 --max-restarts 1`: rank 1 killed -9 mid-round ends the member within
    seconds, its peer closes the round within one --sync-timeout, and the agent restarts the
    member from its checkpoint; it rejoins with the swarm's digest. SIGTERM to the launcher then
    stops both ranks at one step: exit 0 within 10 s, a checkpoint with both streams, and the
    peer's next round does not wait for it."""
    sync_timeout = 30.0
    args = (*SMALL, "--inner-steps", "20", "--sync-timeout", str(sync_timeout))
    a = Node(tmp_path, "a", *args, "--node-id", "a")
    m = Node(tmp_path, "m", *args, "--node-id", "m", "--peers", a.address, "--local-workers", "2",
             "--max-restarts", "1")
    try:
        a.start()
        m.start()
        poll("a round of both", lambda: any(len(e["contributors"]) == 2 for e in done(m).values()),
             timeout_s=240, context=m.log)
        pids = {e["rank"]: e["pid"] for e in m.events("rank_ready")}
        poll("m training", lambda: from_peer(m.address)["phase"] == "training", timeout_s=60, every_s=0.02)
        os.kill(pids[1], signal.SIGKILL)
        killed, killed_ts = time.monotonic(), time.time()
        poll("rank 0 to end", lambda: not running(pids[0]), timeout_s=30, every_s=0.1)
        assert time.monotonic() - killed < 10
        poll("the restarted member averaging with a", lambda: rejoined(m), timeout_s=240, context=m.log)
        rejoined_at = rejoined(m)["round"]
        # a logs the same round a moment before or after m (two processes): wait for its line too
        poll(f"a's round {rejoined_at}", lambda: rejoined_at in done(a), timeout_s=60, context=a.log)
        assert done(m)[rejoined_at]["param_digest"] == done(a)[rejoined_at]["param_digest"]

        before = max(done(a))
        stop(m, within_s=10)
        poll("a's next round", lambda: max(done(a)) > before, timeout_s=60)
        stop(a, within_s=20)
    finally:
        for node in (a, m):
            node.kill()
    outage = [e for e in a.events("round_done") if e["ts"] > killed_ts and "m" not in e["contributors"]]
    assert outage and all(e["sync_s"] < sync_timeout for e in outage), outage
    assert done(a)[before + 1]["sync_s"] < sync_timeout / 2  # m said it left: no deadline waited
    final = m.status()  # the checkpoint of the stop: the swarm's digest at that round
    assert final["round"] >= rejoined_at and final["param_digest"] == done(a)[final["round"]]["param_digest"]
    first, second = streams(m)
    assert first["batches_drawn"] == second["batches_drawn"]  # both ranks stopped at one step
    (stopped,) = [e for e in m.events("rank_stopped")]
    assert stopped["param_digest"] == m.events("stopped")[-1]["param_digest"]


def rejoined(m: Node) -> dict[str, Any] | None:
    """m's first round averaged with a since the agent restarted it, or None."""
    events = m.events()
    starts = [i for i, e in enumerate(events) if e.get("event") == "rank_ready" and e["restarts"] == 1]
    if not starts:
        return None
    return next((e for e in events[starts[0]:] if e.get("event") == "round_done" and len(e["contributors"]) == 2),
                None)
