"""--task hf with real `neuronode start` processes: a tiny Llama trained by two nodes from jsonl
(tokenizer from `neuronode tokenizer train`) and from parquet (tokenizer=bytes, one node
restarted mid-run), `neuronode export` loaded by transformers, and members with another
tokenizer or hidden size refused naming the setting."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import Node, documents, finish, llama, run_neuronode

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(900)]
transformers = pytest.importorskip("transformers")

# Small and quick on one thread: 6 inner steps of 4 x 32 tokens per round.
COMMON = ("--task", "hf", "--seq-len", "32", "--batch-size", "4", "--inner-steps", "6", "--sync-timeout", "120",
          "--inner-lr", "0.01")


def refusals(node: Node) -> list[str]:
    return [e["detail"] for e in node.events() if e.get("event") in ("refused", "refused_by", "refusing_peer")]


def val_losses(node: Node) -> list[float]:
    """val_loss before training (round 0), then after each round."""
    return [node.events("validated")[0]["val_loss"], *(e["val_loss"] for e in node.events("round_done"))]


def check_swarm(nodes: list[Node], rounds: int) -> dict[str, Any]:
    statuses = [n.status() for n in nodes]
    assert all(s["round"] == rounds for s in statuses), statuses
    assert len({s["param_digest"] for s in statuses}) == 1
    for node in nodes:
        losses = val_losses(node)
        assert losses[-1] < losses[0] - 0.5, (node.name, losses)
    return statuses[0]


def test_two_nodes_train_a_tiny_llama_from_jsonl_and_export_loads_in_transformers(tmp_path: Path) -> None:
    data = tmp_path / "corpus"
    data.mkdir()
    with (data / "stories.jsonl").open("w") as fh:
        for text in documents(300):
            fh.write(json.dumps({"text": text}) + "\n")
    tok = tmp_path / "tok"
    made = run_neuronode("tokenizer", "train", "--data", str(data / "*.jsonl"), "--vocab", "400", "--out", str(tok),
                         timeout_s=300)
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["vocab"] == 400
    model = llama(tmp_path / "model")
    options = f"model={model},tokenizer={tok},data={data}/*.jsonl,val_share=0.15"
    a = Node(tmp_path, "a", *COMMON, "--rounds", "3", "--task-option", options, "--node-id", "a", "--min-peers", "2")
    b = Node(tmp_path, "b", *COMMON, "--rounds", "3", "--task-option", options, "--node-id", "b", "--min-peers", "2",
             "--peers", a.address)
    # Another tokenizer (the same model config fits both): refused, naming the tokenizer.
    e = Node(tmp_path, "e", *COMMON, "--rounds", "1", "--inner-steps", "1", "--node-id", "e", "--peers", a.address,
             "--task-option", options.replace(f"tokenizer={tok}", "tokenizer=bytes"))
    try:
        for node in (a, b, e):
            node.start()
        assert e.wait(120) == 2, e.log()[-3000:]  # refused by every peer it knows: it stops
        finish([a, b], 600)
    finally:
        for node in (a, b, e):
            node.kill()
    final = check_swarm([a, b], 3)
    assert all(ev["contributors"] == ["a", "b"] for n in (a, b) for ev in n.events("round_done"))
    said = refusals(e) + refusals(a)
    assert any("settings mismatch" in r and "runs tokenizer " in r for r in said), said

    out = tmp_path / "exported"
    exported = run_neuronode("export", "--data-dir", str(a.data_dir), "--out", str(out), timeout_s=120)
    assert exported.returncode == 0, exported.stderr
    assert json.loads(exported.stdout)["param_digest"] == final["param_digest"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    sample = "story 7: the cat sat by the river."
    ids = tokenizer(sample)["input_ids"]
    assert tokenizer.decode(ids) == sample
    assert_logits_are_the_swarms(loaded, model, a.data_dir, ids)


def assert_logits_are_the_swarms(loaded: Any, model_dir: Path, data_dir: Path, ids: list[int]) -> None:
    """The exported model's logits equal those of the global parameters in the node's checkpoint,
    put into the architecture built from the config the swarm was given."""
    import torch

    from neuronode.node import checkpoint

    state = checkpoint.load_latest(data_dir)
    assert state is not None
    config = transformers.AutoConfig.from_pretrained(str(model_dir))
    reference = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for p, g in zip(reference.parameters(), state.state["engine"]["global_params"], strict=True):
            p.copy_(g)
        x = torch.tensor([ids])
        assert torch.allclose(loaded(x).logits, reference(x).logits, atol=1e-5)


def test_parquet_bytes_tokenizer_restart_continues_the_stream(tmp_path: Path) -> None:
    """b stops after round 2 (its first run has --rounds 2; a, with --min-peers 2, waits for it)
    and is started again: it resumes its data stream where its checkpoint left it (not from the
    start of the pass) and the two end with one digest. A node with another hidden size is
    refused naming hidden_size. (Stopping b with a signal once it finished round 2 raced with
    rounds of 0.1 s on an idle machine: b could contribute to round 3 first, a finish alone, and
    b wait for it forever.)"""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "corpus"
    data.mkdir()
    docs = documents(240)
    for part in range(2):
        pq.write_table(pa.table({"content": docs[part::2]}), data / f"part-{part}.parquet")
    options = f"tokenizer=bytes,data={data}/*.parquet,text_field=content,val_share=0.15"
    common = (*COMMON, "--rounds", "4", "--min-peers", "2")
    a = Node(tmp_path, "a", *common, "--node-id", "a", "--task-option", f"model={llama(tmp_path / 'm64')},{options}")
    b = Node(tmp_path, "b", *common, "--node-id", "b", "--peers", a.address,
             "--task-option", f"model={tmp_path / 'm64'},{options}")
    d = Node(tmp_path, "d", *COMMON, "--rounds", "1", "--inner-steps", "1", "--node-id", "d", "--peers", a.address,
             "--task-option", f"model={llama(tmp_path / 'm96', hidden=96)},{options}")
    nodes = [a, b, d]
    try:
        a.start()
        b.start("--rounds", "2")  # the last --rounds wins
        d.start()
        assert b.wait(600) == 0, b.log()[-3000:]
        stopped = b.status()
        assert stopped["round"] == 2 and stopped["data_pass"] == 0 and stopped["data_documents"] > 0
        b.start()
        assert d.wait(120) == 2, d.log()[-3000:]  # refused by every peer it knows: it stops
        finish([a, b], 600)
    finally:
        for node in nodes:
            node.kill()
    check_swarm([a, b], 4)
    resumed = b.events("resumed")
    assert len(resumed) == 1, b.log()[-3000:]
    assert (resumed[0]["data_pass"], resumed[0]["data_documents"]) == (0, stopped["data_documents"])
    assert b.status()["data_documents"] > stopped["data_documents"]
    said = refusals(d) + refusals(a)
    assert any("settings mismatch" in r and "runs hidden_size 96" in r and "hidden_size 64" in r for r in said), said
