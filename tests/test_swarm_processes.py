"""Real `neuronode start` processes on 127.0.0.1 forming a swarm."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import Node, finish, poll, run_to_end

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(400)]


def done(node: Node) -> dict[int, dict[str, Any]]:
    """Completed round -> its round_done event (contributors, param_digest, loss, ...)."""
    return {e["round"]: e for e in node.events("round_done")}


def repairs(node: Node) -> list[dict[str, Any]]:
    return [e for e in node.events("catching_up") if e["reason"] == "diverged"]


def refusals(node: Node) -> list[str]:
    """What the node refused, or was refused with, in its Hellos (the reasons it logged)."""
    return [e["detail"] for e in node.events() if e.get("event") in ("refused", "refused_by", "refusing_peer")]


def test_three_nodes_chain_bootstrap_identical_replicas(tmp_path: Path) -> None:
    """A alone, B knows A, C knows only B: all learn all, average, and agree bit for bit.
    D trains another model (other --d-model): refused by the others, naming --d-model, it stops
    (exit 2) instead of training alone."""
    args = ("--rounds", "3", "--inner-steps", "20", "--sync-timeout", "60")
    a = Node(tmp_path, "a", *args)
    b = Node(tmp_path, "b", *args, "--peers", a.address)
    c = Node(tmp_path, "c", *args, "--peers", b.address)
    d = Node(tmp_path, "d", "--rounds", "2", "--inner-steps", "10", "--d-model", "64", "--peers", a.address)
    nodes = [a, b, c, d]
    try:
        for node in (a, b, c):
            node.start()
        poll("node a to serve", lambda: a.status(live=True), timeout_s=60)
        d.start()
        assert d.wait(60) == 2, d.log()[-4000:]
        finish([a, b, c], 300)
    finally:
        for node in nodes:
            node.kill()
    statuses = [n.status() for n in (a, b, c)]
    for s in statuses:
        assert s["round"] == 3
        assert s["last_round_contributors"] == 3
        assert s["bytes_sent"] > 0 and s["bytes_received"] > 0
    assert len({s["param_digest"] for s in statuses}) == 1
    assert len({s["node_id"] for s in statuses}) == 3
    # Different data streams: their local losses differ, so equal digests come from averaging.
    assert len({done(n)[1]["loss"] for n in (a, b, c)}) == 3
    # The odd model is refused on both sides, naming the size that differs, and never averaged in.
    assert any("settings mismatch" in r and "--d-model 64" in r and "--d-model 128" in r for r in refusals(d)), d.log()
    assert any("settings mismatch" in r and "--d-model" in r for r in refusals(a)), a.log()
    assert "every bootstrap peer refused this node" in d.log() and not d.events("round_done")


def run_swarm(tmp: Path, names: list[str], *args: str) -> list[Node]:
    """Start `names` together and wait until all exit. Each waits for all (--min-peers) before
    closing a round, so no node trains round 0 alone while the others are still starting."""
    tmp.mkdir(parents=True, exist_ok=True)
    args = (*args, "--min-peers", str(len(names)))
    first = Node(tmp, names[0], *args, "--node-id", names[0])
    nodes = [first] + [Node(tmp, n, *args, "--node-id", n, "--peers", first.address) for n in names[1:]]
    run_to_end(nodes)
    return nodes


@pytest.mark.timeout(900)
def test_reduce_scatter_identical_replicas_and_fewer_bytes(tmp_path: Path) -> None:
    """Three nodes average by reduce-scatter: one digest, every round with all three, and each
    node sends clearly less than all-to-all would (2(N-1)/N instead of N-1 contributions)."""
    small = ("--rounds", "3", "--inner-steps", "5", "--batch-size", "8", "--codec", "fp32",
             "--zstd-level", "0", "--aggregator", "mean")  # norm-clip bounds shards, not whole vectors
    rs = run_swarm(tmp_path / "rs", ["a", "b", "c"], *small, "--averaging", "reduce-scatter")
    a2a = run_swarm(tmp_path / "a2a", ["a", "b", "c"], *small)
    rs_status = [n.status() for n in rs]
    assert len({s["param_digest"] for s in rs_status}) == 1
    assert all(s["round"] == 3 and s["last_round_contributors"] == 3 for s in rs_status)
    rs_sent = sum(s["bytes_sent"] for s in rs_status)
    a2a_status = [n.status() for n in a2a]
    a2a_sent = sum(s["bytes_sent"] for s in a2a_status)
    assert rs_sent < 0.8 * a2a_sent, (rs_sent, a2a_sent)  # 4/3 vs 2 contributions per node
    # With a lossless codec the shard-wise average is the same sum in the same order.
    assert rs_status[0]["param_digest"] == a2a_status[0]["param_digest"]


def test_overlap_keeps_replicas_identical(tmp_path: Path) -> None:
    nodes = run_swarm(tmp_path, ["a", "b"], "--rounds", "4", "--inner-steps", "5", "--batch-size", "8",
                      "--overlap")
    statuses = [n.status() for n in nodes]
    assert len({s["param_digest"] for s in statuses}) == 1
    assert all(s["round"] == 4 for s in statuses)
    assert all(0 < s["utilization"] <= 1 for s in statuses)


@pytest.mark.parametrize("averaging", ["all-to-all", "reduce-scatter"])
def test_overlap_late_joiner_listens_to_its_join_round_then_matches(tmp_path: Path, averaging: str) -> None:
    """Under --overlap the swarm's round-R contributions come from the parameters before the
    state a joiner adopts at round R. The joiner listens to round R (its peers do not wait for it
    there), contributes from R + 1 on, and ends with the swarm's digest. Without that rule every
    such join diverged again and again; what remains is the join race (a member may fix round
    R + 1's members or close it before the joiner's announcement arrives), which costs at most one
    repair (docs/fault-tolerance.md)."""
    args = ("--rounds", "20", "--inner-steps", "10", "--batch-size", "8", "--overlap",
            "--averaging", averaging)
    a = Node(tmp_path, "a", *args, "--node-id", "a")
    b = Node(tmp_path, "b", *args, "--node-id", "b", "--peers", a.address)
    try:
        a.start()
        poll("node a to finish two rounds", lambda: a.status(live=True)["round"] >= 2, timeout_s=120)
        b.start()
        finish([a, b], 300)
    finally:
        for node in (a, b):
            node.kill()
    joined = b.events("adopted")
    assert joined, b.log()
    # A download that ends after a moved on is followed by a second one (b is behind again and
    # drops the first listen); the state b kept is the last it adopted, and it listened there.
    assert joined[-1]["round_id"] in [e["round_id"] for e in b.events("listening")]
    statuses = [n.status() for n in (a, b)]
    assert all(s["round"] == 20 for s in statuses)
    assert statuses[0]["param_digest"] == statuses[1]["param_digest"]
    assert statuses[1]["last_round_contributors"] == 2
    assert len(repairs(a) + repairs(b)) <= 1, repairs(a) + repairs(b)


def test_reduce_scatter_joiner_listens_to_its_join_round_so_members_agree(tmp_path: Path) -> None:
    """Under reduce-scatter each member fixes a round's members when its inner steps end. a
    trains 4 steps a round, b 30: a fixes long before b, so a joiner's announcement usually lands
    between the two. Were c a member of its join round for b but not for a, they would drop each
    other's slices and wait out the deadline, and their replicas would part. c listens to the
    round it adopted instead, is a member from the next one, and every round agrees."""
    common = ("--rounds", "7", "--batch-size", "8", "--averaging", "reduce-scatter", "--sync-timeout", "30",
              "--min-peers", "2",  # a waits for b before round 0, so only c joins the running swarm
              "--max-weight", "240")  # inner steps differ: one bound for all (b's 30 x 8)
    a = Node(tmp_path, "a", *common, "--inner-steps", "4", "--node-id", "a")
    b = Node(tmp_path, "b", *common, "--inner-steps", "30", "--node-id", "b", "--peers", a.address)
    c = Node(tmp_path, "c", *common, "--inner-steps", "10", "--node-id", "c", "--peers", a.address)
    nodes = (a, b, c)
    try:
        a.start()
        b.start()
        poll("a and b to finish two rounds", lambda: a.status(live=True)["round"] >= 2, timeout_s=180)
        c.start()
        finish(nodes, 360)
    finally:
        for node in nodes:
            node.kill()
    joined = c.events("adopted")
    assert joined, c.log()
    k = joined[0]["round_id"]
    assert k + 2 <= 7, c.log()  # c contributed to one round at least
    assert [(e["round_id"], e["phase"]) for e in c.events("listening")] == [(k, "averaged")], c.log()
    per_node = {n.name: {r: (len(e["contributors"]), e["param_digest"], ",".join(e["contributors"]))
                         for r, e in done(n).items()} for n in nodes}
    for node in nodes:
        assert not repairs(node), (node.name, node.log()[-3000:])
    # The round c listened to (done as round k + 1) and every later one: one result everywhere;
    # from c's first round as a member (k + 1, done as k + 2) on, all three contributed.
    for r in range(k + 1, 8):
        results = {name: per_node[name][r] for name in per_node}
        assert len({res[1] for res in results.values()}) == 1, (r, results)
        assert results["a"][2] == ("a,b" if r == k + 1 else "a,b,c"), (r, results)
    assert len({n.status()["param_digest"] for n in nodes}) == 1


def skipped_shard_0(node: Node) -> set[int]:
    """Rounds in which the node gave shard 0 (a's) no update: it had it but not every member did
    (shards_skipped), or it never got it (shard_missing)."""
    return ({e["round_id"] for e in node.events("shards_skipped") if e["shards"] == [0]}
            | {e["round_id"] for e in node.events("shard_missing") if e["reducers"] == ["a"]})


def start_cut_trio(tmp_path: Path) -> tuple[Node, Node, Node]:
    """a, b and c averaging by reduce-scatter (all three members from round 0: --min-peers 3),
    a's averaged-shard streams to c breaking after one chunk on every try."""
    common = ("--rounds", "3", "--inner-steps", "5", "--batch-size", "8", "--averaging", "reduce-scatter",
              "--sync-timeout", "6", "--chunk-bytes", "65536", "--min-peers", "3")
    a = Node(tmp_path, "a", *common, "--node-id", "a")
    b = Node(tmp_path, "b", *common, "--node-id", "b", "--peers", a.address)
    c = Node(tmp_path, "c", *common, "--node-id", "c", "--peers", a.address)
    plan = tmp_path / "faults-a.json"
    plan.write_text(json.dumps({"cut_after_chunks": 1, "cut_to": [c.address], "cut_phase": "averaged"}))
    a.start("--fault-file", str(plan), "--log-level", "debug")  # debug: a logs each finished push
    b.start()
    c.start()
    return a, b, c


def test_reduce_scatter_shard_lost_on_one_link_is_skipped_by_every_member(tmp_path: Path) -> None:
    """a's averaged shard never reaches c (the stream breaks after one chunk, every try), while b
    gets it. c publishes a receipt without it after its gather deadline; a and b wait for that
    receipt, so all three apply the same shards: shard 0 (a's) gets no update, on every member
    alike, and every round ends with one digest everywhere, without a repair."""
    nodes = a, b, c = start_cut_trio(tmp_path)
    try:
        finish(nodes, 300)
    finally:
        for node in nodes:
            node.kill()
    for node in nodes:
        assert not repairs(node), (node.name, node.log()[-3000:])
        assert not node.events("receipt_deadline"), (node.name, node.log()[-3000:])
        # Shard 0 (a's, members sorted) was skipped in every round: by a and b, which had it,
        # after reading c's receipt, and by c, which never got it.
        assert skipped_shard_0(node) == {0, 1, 2}, (node.name, node.log()[-3000:])
    per_node = {n.name: {r: e["param_digest"] for r, e in done(n).items()} for n in nodes}
    for r in (1, 2, 3):
        assert len({per_node[name][r] for name in per_node}) == 1, (r, per_node)
    assert len({n.status()["param_digest"] for n in nodes}) == 1


def test_reduce_scatter_reducer_killed_mid_gather_leaves_the_others_identical(tmp_path: Path) -> None:
    """a sends its averaged shard (shard 0) to b while its stream to c keeps breaking, and is
    killed in round 1's gather once b has the shard. b and c end round 1 with one result: the
    shard that did not reach every live member gets no update anywhere.
    (--min-peers 3 keeps all three members from round 0 on; b and c then wait for a third
    member in round 2, and the test stops them there.)"""
    a, b, c = start_cut_trio(tmp_path)

    def round_1_results() -> dict[str, str]:
        return {n.name: done(n)[2]["param_digest"] for n in (b, c) if 2 in done(n)}

    try:
        def shard_reached_b() -> bool:
            return any(e["round_id"] == 1 and e["peer_id"] == "b" and e["phase"] == "averaged"
                       for e in a.events("pushed"))

        # a's averaged shard is all at b (its stream to c broke after the first chunk): kill a.
        poll("a's round-1 averaged shard to reach b", shard_reached_b, timeout_s=180,
             context=lambda: a.log()[-2000:])
        a.kill()
        poll("b and c to finish round 1", lambda: len(round_1_results()) == 2, timeout_s=120,
             context=lambda: b.log()[-1500:] + c.log()[-1500:])
    finally:
        for node in (a, b, c):
            node.kill()
    for node in (b, c):
        assert not repairs(node), (node.name, node.log()[-3000:])
        assert any(e["round_id"] == 1 and e["reducers"] == ["a"] for e in node.events("shard_missing")), \
            (node.name, node.log()[-3000:])
    assert any(e["round_id"] == 1 and e["shards"] == [0] for e in b.events("shards_skipped")), b.log()[-3000:]  # b had it
    results = round_1_results()
    assert results["b"] == results["c"], results


def test_a_member_with_another_codec_is_refused_at_hello_and_the_others_finish(tmp_path: Path) -> None:
    """Reduce-scatter, a model whose size splits unevenly into 64-element blocks: c runs --codec
    int8, a and b fp32. Shard bounds depend on the codec, so c's slices crashed the reducers
    ("contribution has 189760 elements, expected 189800"); c is now refused at Hello, naming
    --codec, and stops (exit 2); a and b average as two."""
    common = ("--rounds", "3", "--inner-steps", "3", "--batch-size", "4", "--seq-len", "32",
              "--averaging", "reduce-scatter", "--d-model", "120", "--n-layers", "3", "--n-heads", "4",
              "--sync-timeout", "20")
    a = Node(tmp_path, "a", *common, "--codec", "fp32", "--node-id", "a", "--min-peers", "2")
    b = Node(tmp_path, "b", *common, "--codec", "fp32", "--node-id", "b", "--min-peers", "2", "--peers", a.address)
    c = Node(tmp_path, "c", *common, "--codec", "int8", "--node-id", "c", "--peers", a.address)
    nodes = [a, b, c]
    try:
        for node in nodes:
            node.start()
        assert c.wait(120) == 2, c.log()[-3000:]
        finish([a, b], 300)
    finally:
        for node in nodes:
            node.kill()
    assert any("--codec fp32" in r and "--codec int8" in r for r in refusals(c)), c.log()[-3000:]
    statuses = [n.status() for n in (a, b)]
    assert all(s["round"] == 3 for s in statuses) and statuses[0]["param_digest"] == statuses[1]["param_digest"]
    assert all(e["contributors"] == ["a", "b"] for n in (a, b) for e in n.events("round_done"))


def test_a_contribution_cut_on_one_link_is_fetched_and_every_round_averages_everyone(tmp_path: Path) -> None:
    """Issue 18: a's pushes to b break after one chunk, every try. b sees c's and d's receipts
    list a's contribution, stops waiting for a's own push once it waited a quarter of
    --sync-timeout (before, until its deadline, every round), and fetches it from one of them: every
    member averages all four, every round, with one digest and no repair (before receipts, b
    averaged three and parted every round)."""
    common = ("--rounds", "3", "--inner-steps", "5", "--batch-size", "8", "--sync-timeout", "6",
              "--chunk-bytes", "65536", "--min-peers", "4")
    a = Node(tmp_path, "a", *common, "--node-id", "a")
    b, c, d = (Node(tmp_path, n, *common, "--node-id", n, "--peers", a.address) for n in "bcd")
    plan = tmp_path / "faults-a.json"
    plan.write_text(json.dumps({"cut_after_chunks": 1, "cut_to": [b.address], "cut_phase": "whole"}))
    nodes = [a, b, c, d]
    try:
        a.start("--fault-file", str(plan))
        for node in (b, c, d):
            node.start()
        finish(nodes, 300)
    finally:
        for node in nodes:
            node.kill()
    for node in nodes:
        assert not repairs(node), (node.name, node.log()[-3000:])
        assert all(e["contributors"] == ["a", "b", "c", "d"] for e in done(node).values()), \
            (node.name, {r: e["contributors"] for r, e in done(node).items()})
    assert [e["sender"] for e in b.events("fetched")] == ["a"] * 3, b.log()[-3000:]
    assert not b.events("deadline") and len(b.events("fetch_early")) == 3, b.log()[-3000:]
    assert len({n.status()["param_digest"] for n in nodes}) == 1


def test_sparse_codec_keeps_replicas_identical_and_its_residual_survives_a_restart(tmp_path: Path) -> None:
    """Three nodes average --codec sparse contributions: one digest every round, all three in
    each. What the wire has not carried yet (the error-feedback residual) is in each node's
    checkpoint, and a node restarted from it carries on with it."""
    from neuronode.config import NodeConfig
    from neuronode.node import checkpoint
    from neuronode.node.daemon import Daemon
    from neuronode.node.trainer import Trainer

    small = ("--rounds", "2", "--inner-steps", "3", "--batch-size", "4", "--seq-len", "32", "--d-model", "64",
             "--n-layers", "2", "--n-heads", "2", "--codec", "sparse", "--sparse-k", "32")
    nodes = run_swarm(tmp_path, ["a", "b", "c"], *small)
    statuses = [n.status() for n in nodes]
    assert len({s["param_digest"] for s in statuses}) == 1
    for node in nodes:
        assert [(e["round"], len(e["contributors"])) for e in node.events("round_done")] == [(1, 3), (2, 3)]
    assert {s["codec"] for s in statuses} == {"sparse:k=32,bits=2,block=4096"}
    stored = checkpoint.load_latest(nodes[0].data_dir)
    assert stored is not None
    residual = stored.state["feedback"]["residual"]
    assert float(residual.norm()) > 0
    assert statuses[0]["feedback_norm"] == pytest.approx(float(residual.norm()), rel=1e-6)
    cfg = NodeConfig(data_dir=str(nodes[0].data_dir), node_id="a", codec="sparse", sparse_k=32, batch_size=4,
                     seq_len=32, d_model=64, n_layers=2, n_heads=2, threads=1)
    daemon = Daemon(cfg, trainer=Trainer(cfg, node_id="a"), node_id="a", data_dir=nodes[0].data_dir)
    try:
        daemon.restore()
        restored = daemon.pools.encode.submit(daemon.encoder.state_dict).result()  # the encoder's thread
        assert restored is not None and torch.equal(restored["residual"], residual)
        assert daemon.status()["feedback_norm"] == statuses[0]["feedback_norm"]
    finally:
        daemon.pools.shutdown()
