"""`neuronode export` of a --task hf node round-trips: transformers loads the directory, and its
config, generation config and tokenizer agree on the end-of-text token the swarm trained with,
so generate() stops there; every file has the same mode; nothing says how it was loaded."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import Script, documents, llama

from neuronode.config import NodeConfig
from neuronode.node import checkpoint
from neuronode.node.export import export
from neuronode.node.trainer import Trainer
from neuronode.training.tokenizer import LOAD_KEYS, train_tokenizer

transformers = pytest.importorskip("transformers")


def exported(tmp: Path) -> Path:
    """A two-step hf node's checkpoint (trained tokenizer, the docs' tiny Llama), exported."""
    corpus = tmp / "corpus"
    corpus.mkdir()
    (corpus / "stories.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in documents(120)))
    train_tokenizer(str(corpus), vocab_size=300, out=str(tmp / "tok"), threads=1)  # a folder as --data
    cfg = NodeConfig(data_dir=str(tmp / "node"), task="hf", model=str(llama(tmp / "tiny", vocab=300)),
                     tokenizer=str(tmp / "tok"), data=str(corpus), seq_len=32, batch_size=2, inner_steps=2,
                     threads=1)
    trainer = Trainer(cfg, node_id="x")
    trainer.train_round(threading.Event())
    trainer.apply_average(trainer.pseudo_gradient())
    meta = {"round": 1, "param_digest": trainer.engine.param_digest(), "manifest_hash": trainer.engine.manifest_hash()}
    checkpoint.save(tmp / "node", 1, meta, trainer.state_dict())
    export(str(tmp / "node"), str(tmp / "model"), say=print)
    return tmp / "model"


@pytest.mark.timeout(300)
def test_an_exported_model_stops_generating_at_end_of_text(tmp_path: Path) -> None:
    out = exported(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.eos_token_id == eos and tok.pad_token_id == eos
    config = json.loads((out / "config.json").read_text())
    assert (config["eos_token_id"], config["bos_token_id"], config["pad_token_id"]) == (eos, eos, eos)
    assert model.generation_config.eos_token_id == eos and model.generation_config.pad_token_id == eos
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert not LOAD_KEYS & set(tok_config), tok_config

    prompt = tok("story 1: the cat", return_tensors="pt")
    n = prompt["input_ids"].shape[1]
    words = [i for i in tok(" sat on the mat")["input_ids"] if i != eos]
    script = [*words[:3], eos, *words[3:], *words]  # then it would go on, if nothing stopped it
    with torch.no_grad():
        out_ids = model.generate(**prompt, max_new_tokens=len(script), do_sample=False,
                                 logits_processor=[Script(n, script)])[0].tolist()
    assert out_ids[n:] == [*words[:3], eos], (out_ids[n:], script)
    assert tok.decode(out_ids[n:], skip_special_tokens=True) == tok.decode(words[:3])


@pytest.mark.timeout(300)
def test_exported_files_share_one_mode(tmp_path: Path) -> None:
    umask = os.umask(0o022)
    try:
        out = exported(tmp_path)
    finally:
        os.umask(umask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= set(modes)
    assert set(modes.values()) == {0o644}, modes


def test_tokenizer_train_threads_gives_the_same_tokenizer(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in documents(60)))
    results: list[dict[str, Any]] = [train_tokenizer(str(corpus), vocab_size=290, out=str(tmp_path / f"t{n}"),
                                                     threads=n) for n in (1, 2)]
    assert results[0]["tokenizer_hash"] == results[1]["tokenizer_hash"]
    assert [r["threads"] for r in results] == [1, 2]
