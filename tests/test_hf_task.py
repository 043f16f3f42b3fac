"""The hf task in-process: the data stream (per-seed order, held-out share, a restart that
continues the pass), settings compared by name, one-line errors, and `neuronode export` of the
built-in task (safetensors and its loader; checkpoints that do not verify are refused)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from neuronode.config import NodeConfig
from neuronode.node import checkpoint
from neuronode.node.export import ExportError, export
from neuronode.node.trainer import Trainer
from neuronode.swarm.context import Settings
from neuronode.training import TaskConfig, TaskError, create_task
from neuronode.training.textdata import Corpus, TokenStream, expand_shards, held_out, share_below

MARK = 10_000  # token id of "document k begins" is MARK + k


def write_shards(folder: Path, n_docs: int, n_shards: int) -> list[str]:
    """jsonl shards of documents 'doc K' + words: each document's first token names it."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(n_shards):
        path = folder / f"part-{s}.jsonl"
        with path.open("w") as fh:
            for k in range(s, n_docs, n_shards):
                fh.write(json.dumps({"text": f"doc {k} " + "w " * (3 + k % 11)}) + "\n")
        paths.append(str(path))
    return paths


def encode(text: str) -> list[int]:
    k = int(re.match(r"doc (\d+)", text).group(1))  # type: ignore[union-attr]
    return [MARK + k] + [ord(c) for c in text[len(f"doc {k}"):]]


def stream(paths: list[str], seed: int, *, share: float = 0.0) -> TokenStream:
    corpus = Corpus(shards=tuple(paths), holdout_below=share_below(share))
    return TokenStream(corpus, encode=encode, eos_id=1, batch_size=3, seq_len=16, seed=seed, shuffle_docs=8)


def begun(batch: tuple[torch.Tensor, torch.Tensor]) -> list[int]:
    """Documents whose first token is an input of this batch, in order (inputs of successive
    windows tile the token sequence, so each document begins in exactly one batch)."""
    x, _ = batch
    return [t - MARK for t in x.reshape(-1).tolist() if t >= MARK]


def test_restart_continues_the_pass_without_repeating(tmp_path: Path) -> None:
    """A stream saved mid-pass and loaded into a new one goes on exactly as the uninterrupted
    stream: every document of the pass comes once, none trained before the restart comes again."""
    paths = write_shards(tmp_path / "data", n_docs=60, n_shards=3)
    whole = stream(paths, seed=7)
    reference = [begun(next(whole)) for _ in range(40)]
    first = stream(paths, seed=7)
    before = [begun(next(first)) for _ in range(9)]
    saved = first.state_dict()
    assert saved["pass"] == 0 and 0 < saved["documents"] < 60
    resumed = stream(paths, seed=7)
    resumed.load_state_dict(torch.load(_round_trip(saved, tmp_path), weights_only=False))
    assert resumed.progress == first.progress
    after = [begun(next(resumed)) for _ in range(31)]
    assert before + after == reference  # the order is exact, not only without repeats
    docs = [k for batch in before + after for k in batch]
    first_pass = docs[:60]
    assert sorted(first_pass) == list(range(60))  # each document once in the pass
    assert set(docs[:len([k for b in before for k in b])]).isdisjoint(docs[len([k for b in before for k in b]):60])
    assert resumed.progress["data_pass"] == 1  # 40 batches of 48 tokens run past one pass


def _round_trip(state: dict[str, Any], tmp: Path) -> Path:
    path = tmp / "stream.pt"
    torch.save(state, path)
    return path


def test_each_seed_its_own_order_and_held_out_documents_never_trained(tmp_path: Path) -> None:
    paths = write_shards(tmp_path / "data", n_docs=80, n_shards=2)
    orders = {}
    for seed in (1, 2):
        s = stream(paths, seed=seed, share=0.2)
        orders[seed] = [k for _ in range(30) for k in begun(next(s))]
    assert orders[1][:20] != orders[2][:20]
    texts = {k: f"doc {k} " + "w " * (3 + k % 11) for k in range(80)}
    held = {k for k, t in texts.items() if held_out(t, 0.2)}
    assert 0 < len(held) < 40
    for order in orders.values():
        assert held.isdisjoint(order)
        assert sorted(order[:80 - len(held)]) == sorted(set(texts) - held)


def test_shard_list_file_and_missing_files_are_one_line(tmp_path: Path) -> None:
    paths = write_shards(tmp_path / "a,b", n_docs=4, n_shards=2)  # a comma, which --task-option splits on
    listing = tmp_path / "shards.txt"
    listing.write_text("a,b/part-*.jsonl\n")
    assert expand_shards(f"@{listing}", option="data") == paths
    with pytest.raises(TaskError, match=r"^data: no file matches .*nothing\*\.jsonl$"):
        expand_shards(str(tmp_path / "nothing*.jsonl"), option="data")
    with pytest.raises(TaskError, match="cannot read the shard list"):
        expand_shards(f"@{tmp_path / 'missing.txt'}", option="data")


def test_task_settings_mismatch_names_the_setting() -> None:
    ours = Settings(task=(("--seq-len", "64"), ("hidden_size", "64"), ("tokenizer", "aa")))
    assert ours.mismatch(ours) is None
    assert ours.mismatch(Settings(task=(("--seq-len", "64"), ("hidden_size", "96"), ("tokenizer", "bb")))) == (
        "hidden_size", "96", "64")
    assert ours.mismatch(Settings(task=(("--seq-len", "64"), ("hidden_size", "64"), ("tokenizer", "bb")))) == (
        "tokenizer", "bb", "aa")
    assert ours.mismatch(Settings()) == ("--seq-len", "(not set)", "64")


def tiny_model(folder: Path, **overrides: Any) -> Path:
    config = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 300, "max_position_embeddings": 64,
              **overrides}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def hf_config(tmp: Path, **options: str) -> TaskConfig:
    data = write_shards(tmp / "data", n_docs=40, n_shards=1)[0]
    opts = {"model": str(tiny_model(tmp / "model")), "tokenizer": "bytes", "data": data, "val_share": "0.3", **options}
    return TaskConfig(seed=3, data_seed=5, batch_size=2, seq_len=16, options=opts)


def test_hf_task_weights_from_the_seed_and_one_line_errors(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    cfg = hf_config(tmp_path)
    a, b = create_task("hf", cfg), create_task("hf", cfg)
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True))
    assert a.settings["hidden_size"] == "32" and a.settings["--seq-len"] == "16"
    assert {"config.json", "tokenizer.json"} <= set(a.files)
    loss = a.loss_fn(a.model, next(a.batches))
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert a.validate is not None and a.validate(a.model) > 0
    # A model directory with weights: the task starts from them, not from the seed.
    pretrained = tiny_model(tmp_path / "pretrained")
    with torch.no_grad():
        for p in a.model.parameters():
            p.add_(0.5)
    a.model.save_pretrained(str(pretrained))
    c = create_task("hf", hf_config(tmp_path, model=str(pretrained)))
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), c.model.parameters(), strict=True))
    assert c.settings["initial weights"] != b.settings["initial weights"]
    tiny_model(tmp_path / "small", vocab_size=200)
    with pytest.raises(TaskError, match=r"vocab_size 200, smaller than the tokenizer's 256 tokens"):
        create_task("hf", hf_config(tmp_path, model=str(tmp_path / "small")))
    with pytest.raises(TaskError, match=r"model=.*nowhere: no config.json there"):
        create_task("hf", hf_config(tmp_path, model=str(tmp_path / "nowhere")))
    with pytest.raises(TaskError, match=r"hf: give --task-option tokenizer=\.\.\."):
        create_task("hf", TaskConfig(seed=0, data_seed=0, options={"model": "m", "data": "d"}))


def test_hf_task_without_the_extra_says_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)  # as if not installed
    with pytest.raises(TaskError, match=r"needs the hf extra .*pip install '\.\[hf\]' in a clone"):
        create_task("hf", hf_config(tmp_path))


BYTELM = dict(d_model=32, n_layers=1, n_heads=2, seq_len=32, batch_size=4, inner_steps=2, threads=1)


def save_round(trainer: Trainer, data_dir: Path, round_id: int) -> Path:
    meta = {"round": round_id, "param_digest": trainer.engine.param_digest(),
            "manifest_hash": trainer.engine.manifest_hash()}
    return checkpoint.save(data_dir, round_id, meta, trainer.state_dict())


def test_export_bytelm_and_refuse_checkpoints_that_do_not_verify(tmp_path: Path) -> None:
    from neuronode.training.bytelm import load_exported

    trainer = Trainer(NodeConfig(data_dir=str(tmp_path), **BYTELM), node_id="x")  # type: ignore[arg-type]
    trainer.train_round(__import__("threading").Event())
    trainer.apply_average(trainer.pseudo_gradient())
    older = save_round(trainer, tmp_path, 1)
    x = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        expected = trainer.task.model.eval()(x)  # the model holds the global parameters after the outer step
    lines: list[str] = []
    result = export(str(tmp_path), str(tmp_path / "out"), say=lines.append)
    assert result["checkpoint"] == older.name and lines == []
    assert torch.allclose(load_exported(tmp_path / "out")(x), expected, atol=1e-6)
    # A newer checkpoint whose parameters do not hash to its recorded digest: refused, older used.
    newer = save_round(trainer, tmp_path, 2)
    meta, state = checkpoint.decode(newer.read_bytes())
    state["engine"]["global_params"][0].add_(1.0)
    newer.write_bytes(checkpoint.encode(meta, state))
    assert export(str(tmp_path), str(tmp_path / "out2"), say=lines.append)["checkpoint"] == older.name
    assert len(lines) == 1 and lines[0].startswith(f"refusing checkpoint {newer.name}: ") and "param_digest" in lines[0]
    blob = bytearray(older.read_bytes())
    blob[len(blob) // 2] ^= 1
    older.write_bytes(bytes(blob))
    with pytest.raises(ExportError, match="no checkpoint verifies"):
        export(str(tmp_path), str(tmp_path / "out3"), say=lines.append)
    assert "digest mismatch" in lines[-1]


@pytest.mark.timeout(60)
async def test_a_named_setting_is_refused_before_the_manifest(nodes: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Two members whose manifests differ because a size differs: what they are told names the
    size and both values, not "model manifest mismatch"."""
    from helpers import wait_until

    from neuronode.events import record_fields

    caplog.set_level(logging.INFO, logger="neuronode.swarm")
    a = await nodes.start("a", settings=Settings(task=(("hidden_size", "64"),)))
    await nodes.start("b", peers=[a.advertise], manifest_hash="b2" * 32, settings=Settings(task=(("hidden_size", "96"),)))

    def details() -> list[str]:
        return [str(record_fields(r).get("detail", "")) for r in caplog.records
                if record_fields(r).get("event") in ("refused", "refused_by", "refusing_peer")]

    await wait_until(lambda: bool(details()), what="b's hello to be refused")
    assert details() and all(d.startswith("settings mismatch: b runs hidden_size 96, this node (a) hidden_size 64")
                             for d in details()), details()


def test_export_and_tokenizer_cli_mistakes_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from neuronode.cli import main

    assert main(["export", "--data-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")]) == 1
    assert main(["export", "--data-dir", str(tmp_path), "--out", str(tmp_path / "out")]) == 1
    assert main(["tokenizer", "train", "--data", str(tmp_path / "none*.txt"), "--vocab", "300",
                 "--out", str(tmp_path / "tok")]) == 2
    assert main(["tokenizer", "train", "--data", str(tmp_path / "none*.txt"), "--vocab", "100",
                 "--out", str(tmp_path / "tok")]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 4, lines
    assert "does not exist" in lines[0] and "no checkpoint there" in lines[1]
    assert "no file matches" in lines[2] and "at least 257 tokens" in lines[3]


def test_status_carries_the_task_settings_and_data_position() -> None:
    from neuronode.swarm.wire import dict_to_status, status_to_dict

    fields = {"task": "hf", "n_params": 147776, "task_settings": {"--seq-len": "32", "hidden_size": "64"},
              "data_pass": 1, "data_documents": 17}
    back = status_to_dict(dict_to_status(fields))
    assert {k: back[k] for k in fields} == fields
    json.dumps(back)  # what `neuronode status` prints
