"""Scripts of one's own in a swarm, as real processes: the CNN example (plain PyTorch and
neuronode.Swarm) twice, and the Hugging Face Trainer example (its callback) twice beside a
`neuronode start --task hf` member with the same model, tokenizer and sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import Node, documents, free_port, llama

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def script(name: str, *args: str, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, str(EXAMPLES / name), *args], stdout=out, stderr=subprocess.STDOUT,
                                env=env)


def result(process: subprocess.Popen[bytes], log: Path, timeout_s: float = 240) -> dict[str, Any]:
    """The JSON line a script prints when done (it exits 0)."""
    try:
        code = process.wait(timeout=timeout_s)
    finally:
        if process.poll() is None:
            process.kill()
    text = log.read_text(errors="replace")
    assert code == 0, text[-4000:]
    line = next(ln for ln in reversed(text.splitlines()) if ln.startswith('{"round"'))
    return dict(json.loads(line))


def test_the_cnn_example_trains_with_two_processes_to_one_digest(tmp_path: Path) -> None:
    first = f"127.0.0.1:{free_port()}"
    common = ("--rounds", "3", "--inner-steps", "10", "--min-peers", "2")
    a = script("cnn_swarm.py", "--listen", first, "--data-dir", str(tmp_path / "a"), "--data-seed", "1", *common,
               log=tmp_path / "a.log")
    b = script("cnn_swarm.py", "--listen", "127.0.0.1:0", "--peers", first, "--data-dir", str(tmp_path / "b"),
               "--data-seed", "2", *common, log=tmp_path / "b.log")
    done = [result(a, tmp_path / "a.log"), result(b, tmp_path / "b.log")]
    assert [d["round"] for d in done] == [3, 3]
    assert done[0]["param_digest"] == done[1]["param_digest"]
    assert all(d["contributors"] == 2 for d in done)
    assert all(d["val_loss"] < d["val_loss_before"] for d in done)


def test_two_trainer_scripts_and_a_neuronode_start_member_share_one_swarm(tmp_path: Path) -> None:
    """Two `transformers.Trainer` processes with NeuronodeCallback and one `neuronode start
    --task hf` member, the same tiny Llama (saved weights), the byte tokenizer and the sizes:
    three rounds of all three, one digest, validation loss below round 0's everywhere."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import torch

    model = llama(tmp_path / "model", hidden=32, vocab=260)
    torch.manual_seed(0)
    built = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(str(model)))
    built.save_pretrained(str(model))  # every member starts from these weights
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(documents(240)):  # one document a file (how --task hf reads .txt)
        (corpus / f"story-{i:03d}.txt").write_text(text + "\n")
    sizes = ("--seq-len", "32", "--batch-size", "4", "--inner-steps", "5", "--rounds", "3", "--min-peers", "3")
    node = Node(tmp_path, "daemon", "--task", "hf", *sizes, "--sync-timeout", "120", "--inner-lr", "0.01",
                "--task-option", f"model={model},tokenizer=bytes,data={corpus}/*.txt,val_share=0.15")
    trainers = []
    try:
        node.start()
        for name, seed in (("hf-a", "1"), ("hf-b", "2")):
            trainers.append((script("hf_trainer_swarm.py", "--model", str(model), "--data", f"{corpus}/*.txt",
                                    "--data-dir", str(tmp_path / name), "--peers", node.address, "--seed", seed,
                                    *sizes, log=tmp_path / f"{name}.log"), tmp_path / f"{name}.log"))
        done = [result(process, log) for process, log in trainers]
        assert node.wait(120) == 0, node.log()[-4000:]
    finally:
        node.kill()
        for process, _ in trainers:
            if process.poll() is None:
                process.kill()
    status = node.status()
    assert status["round"] == 3 and [d["round"] for d in done] == [3, 3]
    assert {d["param_digest"] for d in done} == {status["param_digest"]}
    assert all(len(e["contributors"]) == 3 for e in node.events("round_done"))
    assert all(len(d["contributors"]) == 3 for d in done)
    assert all(d["val_loss"] < d["val_loss_before"] for d in done), done
    losses = [node.events("validated")[0]["val_loss"], *(e["val_loss"] for e in node.events("round_done"))]
    assert losses[-1] < losses[0], losses
