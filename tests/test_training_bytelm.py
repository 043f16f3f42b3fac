"""The built-in byte-level LM task: model, corpus split, batch stream, validation, training."""

import itertools
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from neuronode.training import Task, TaskConfig, TaskError, bytelm, load_task

torch.set_num_threads(1)

SMALL: dict[str, Any] = {"batch_size": 8, "seq_len": 64, "d_model": 64, "n_layers": 2, "n_heads": 2}


def make(seed: int = 0, data_seed: int = 0, **kwargs: Any) -> Task:
    return bytelm.factory(TaskConfig(seed=seed, data_seed=data_seed, **kwargs))


def gpt(task: Task) -> bytelm.GPT:
    assert isinstance(task.model, bytelm.GPT)
    return task.model


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_default_model_size_and_tied_head() -> None:
    task = make()
    assert 0.8e6 < n_params(task.model) < 0.9e6  # well under the 5M budget
    assert gpt(task).lm_head.weight is gpt(task).wte.weight
    assert task.samples_per_batch == 16
    assert task.tokens_per_batch == 16 * 128


def test_initial_val_loss_is_near_uniform_over_bytes() -> None:
    task = make(seed=1)
    assert task.validate is not None
    loss = task.validate(task.model)
    # Sits a little below ln(256) = 5.55: the tied head already favours repeating the input
    # byte, and about a quarter of stdlib bytes repeat the previous one (indentation).
    assert math.log(256) - 0.45 < loss < math.log(256) + 0.3


def test_same_seed_gives_bit_identical_weights_and_spares_the_global_rng() -> None:
    rng_before = torch.get_rng_state()
    a, b = gpt(make(seed=7, data_seed=1)), gpt(make(seed=7, data_seed=2))
    assert torch.equal(torch.get_rng_state(), rng_before)
    for (name, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(p, q), name
    c = gpt(make(seed=8))
    assert not torch.equal(a.wte.weight, c.wte.weight)


def test_batches_depend_on_data_seed_only() -> None:
    x1, y1 = next(make(seed=0, data_seed=5).batches)
    x2, y2 = next(make(seed=9, data_seed=5).batches)
    x3, _ = next(make(seed=0, data_seed=6).batches)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, x3)
    assert x1.shape == y1.shape == (16, 128)
    assert x1.dtype == y1.dtype == torch.long


@settings(max_examples=15, deadline=None)
@given(data_seed=st.integers(0, 2**64 - 1), drawn=st.integers(0, 5))
def test_batch_state_dict_resumes_the_same_stream(data_seed: int, drawn: int) -> None:
    corpus = bytelm.load_corpus()
    kwargs: dict[str, Any] = {
        "batch_size": 4,
        "seq_len": 16,
        "seed": data_seed,
        "device": torch.device("cpu"),
    }
    stream = bytelm.ByteBatches(corpus.train, **kwargs)
    for _ in range(drawn):
        next(stream)
    state = stream.state_dict()
    expected = list(itertools.islice(stream, 3))

    resumed = bytelm.ByteBatches(corpus.train, **kwargs)
    resumed.load_state_dict(state)
    assert resumed.batches_drawn == drawn
    for (x, y), (rx, ry) in zip(expected, itertools.islice(resumed, 3), strict=True):
        assert torch.equal(x, rx) and torch.equal(y, ry)
        assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one byte


def test_split_is_by_file_disjoint_and_deterministic() -> None:
    corpus = bytelm.load_corpus()
    assert not set(corpus.train_files) & set(corpus.val_files)
    assert all(bytelm.is_val_file(f) for f in corpus.val_files)
    assert not any(bytelm.is_val_file(f) for f in corpus.train_files)
    assert 0.03 < len(corpus.val_files) / len(corpus.train_files) < 0.3
    assert corpus.train.numel() + corpus.val.numel() >= bytelm.DEFAULT_CORPUS_BYTES

    bytelm.load_corpus.cache_clear()
    again = bytelm.load_corpus()
    assert again is not corpus
    assert (again.train_files, again.val_files) == (corpus.train_files, corpus.val_files)
    assert again.digest == corpus.digest
    assert torch.equal(again.train, corpus.train) and torch.equal(again.val, corpus.val)


def test_corpus_prunes_tests_and_site_packages_and_caps_bytes(tmp_path: Path) -> None:
    for rel in ["a.py", "pkg/b.py", "pkg/c.txt", "site-packages/x.py", "test/t.py", "z/d.py"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(rel.encode() * 10)
    assert bytelm.stdlib_files(tmp_path) == ["a.py", "pkg/b.py", "z/d.py"]

    def split_text(corpus: bytelm.ByteCorpus) -> list[bytes]:
        return [bytes(part.tolist()) for part in (corpus.train, corpus.val)]

    with pytest.raises(TaskError, match="no Python sources"):
        bytelm.load_corpus(1, str(tmp_path))  # the cap stops after one file: no val side
    # Pick names so both sides get a file, whatever crc32 says about the ones above.
    val_name = next(f"v{i}.py" for i in itertools.count() if bytelm.is_val_file(f"v{i}.py"))
    (tmp_path / val_name).write_bytes(b"VAL")
    corpus = bytelm.load_corpus(10_000, str(tmp_path))
    assert val_name in corpus.val_files
    assert b"VAL\0" in split_text(corpus)[1]
    assert b"VAL" not in split_text(corpus)[0]


def test_validate_is_deterministic_and_restores_mode() -> None:
    task = make(**SMALL)
    assert task.validate is not None
    task.model.train()
    first = task.validate(task.model)
    assert task.model.training
    task.model.eval()
    assert task.validate(task.model) == first
    assert not task.model.training
    # Another node (other data seed) measures on the same windows.
    other = make(data_seed=99, **SMALL)
    assert other.validate(other.model) == first  # type: ignore[misc]


def test_short_training_run_lowers_val_loss() -> None:
    task = make(seed=0, data_seed=1, **SMALL)
    assert task.validate is not None
    before = task.validate(task.model)
    opt = torch.optim.AdamW(task.model.parameters(), lr=3e-3)
    for batch in itertools.islice(task.batches, 60):
        loss = task.loss_fn(task.model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = task.validate(task.model)
    assert after < before - 1.0, (before, after)


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"corpus_gb": "1"}, "unknown --task-option corpus_gb"),
        ({"val_windows": "many"}, "bad --task-option value"),
        ({"val_windows": "0"}, "val_windows >= 1"),
        ({"corpus_mb": "-2"}, "corpus_mb must be > 0"),
    ],
)
def test_bad_options_raise_task_error(options: dict[str, str], needle: str) -> None:
    with pytest.raises(TaskError, match=needle):
        make(options=options)


def test_options_and_builtin_alias() -> None:
    cfg = TaskConfig(seed=0, data_seed=0, options={"val_windows": "2"}, **SMALL)
    task = load_task("builtin")(cfg)
    assert task.validate is not None and math.isfinite(task.validate(task.model))


def test_unusable_device_raises_task_error() -> None:
    with pytest.raises(TaskError, match="not a torch device"):
        make(device="toaster")
    if not torch.cuda.is_available():
        with pytest.raises(TaskError, match="CUDA is not available"):
            make(device="cuda")
