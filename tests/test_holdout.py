"""The validation split of --task hf (neuronode.training.holdout): a share that holds out too few
tokens for one window on a small corpus rises to the fewest documents of smallest hash that
fill one, alike on every node, says so at start, and those documents are never trained on."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from neuronode.events import record_fields
from neuronode.training.holdout import validation_split
from neuronode.training.task import TaskConfig, TaskError, create_task
from neuronode.training.textdata import Corpus, TokenStream, doc_hash, held_out, share_below

SEQ_LEN = 64


def encode(text: str) -> list[int]:
    return list(text.encode())


def corpus(folder: Path, n_docs: int, words: int = 12, *, unlucky: float = 0.0) -> list[str]:
    """`n_docs` documents of `words` words, one jsonl shard; their texts. With `unlucky`, the
    first such corpus (by a salt in the texts) of which that share holds out no document."""
    folder.mkdir(parents=True, exist_ok=True)
    for salt in range(1000):
        texts = [f"doc {i}.{salt}: " + " ".join(f"w{(i * 7 + j) % 50}" for j in range(words)) for i in range(n_docs)]
        if not any(held_out(t, unlucky) for t in texts):
            break
    (folder / "part.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return texts


def split(folder: Path, share: float) -> tuple[int, int]:
    below, windows = validation_split([str(folder / "part.jsonl")], text_field="text", share=share, encode=encode,
                                      eos_id=0, seq_len=SEQ_LEN, n_windows=4)
    return below, windows.size(0)


def test_a_share_that_holds_out_too_little_rises_to_one_window(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    texts = corpus(tmp_path, 100)
    share = 0.001
    assert not any(held_out(t, share) for t in texts)  # 100 documents, a share of 0.1%: none held out
    with caplog.at_level(logging.WARNING):
        below, n_windows = split(tmp_path, share)
    assert split(tmp_path, share) == (below, n_windows)  # every node the same
    held = sorted((t for t in texts if doc_hash(t) < below), key=doc_hash)
    assert n_windows >= 1 and sum(len(encode(t)) + 1 for t in held) >= SEQ_LEN + 1
    assert sum(len(encode(t)) + 1 for t in held[:-1]) < SEQ_LEN + 1  # the fewest that fill a window
    said = [record_fields(r) for r in caplog.records if record_fields(r).get("event") == "holdout_raised"]
    assert said and said[0]["held"] == 0 and said[0]["documents"] == 100 and said[0]["now_held"] == len(held)
    stream = TokenStream(Corpus(shards=(str(tmp_path / "part.jsonl"),), holdout_below=below), encode=encode,
                         eos_id=0, batch_size=4, seq_len=SEQ_LEN, seed=1)
    trained = set()
    for _ in range(30):  # more than one pass
        x, _ = next(stream)
        trained |= {t for t in texts if encode(t)[:12] in [row[i:i + 12] for row in x.tolist() for i in range(SEQ_LEN)]}
    assert trained and not trained & set(held)


def test_a_share_that_holds_out_enough_stands(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    corpus(tmp_path, 100)
    with caplog.at_level(logging.WARNING):
        assert split(tmp_path, 0.3)[0] == share_below(0.3)
    assert not [r for r in caplog.records if record_fields(r).get("event") == "holdout_raised"]


def test_a_corpus_too_small_for_a_window_and_training_is_one_line(tmp_path: Path) -> None:
    corpus(tmp_path, 3, words=2)
    with pytest.raises(TaskError, match=r"^validation: the corpus holds 3 document\(s\), too little"):
        split(tmp_path, 0.01)


def test_the_hf_task_starts_on_a_hundred_documents_with_val_share_2_percent(tmp_path: Path) -> None:
    """The docs' example: a small corpus, val_share=0.02, and no document hashing into that
    share. Before, the start stopped ("the held-out documents have 0 tokens")."""
    pytest.importorskip("transformers")
    corpus(tmp_path / "corpus", 100, words=40, unlucky=0.02)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 256, "max_position_embeddings": 128}))
    task = create_task("hf", TaskConfig(seed=1, data_seed=2, batch_size=2, seq_len=SEQ_LEN, options={
        "model": str(model), "tokenizer": "bytes", "data": str(tmp_path / "corpus"), "val_share": "0.02"}))
    assert task.validate is not None and task.validate(task.model) > 0
