"""The task plug-in interface: TaskConfig validation and load_task's errors."""

import itertools
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from neuronode.training import (
    BUILTIN_TASKS,
    Task,
    TaskConfig,
    TaskError,
    bytelm,
    create_task,
    load_task,
)

torch.set_num_threads(1)

TESTS_DIR = Path(__file__).parent


@pytest.fixture
def plugin_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(TESTS_DIR))


@pytest.fixture
def tmp_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory on sys.path where a test can write throwaway plug-in modules."""
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def write_module(root: Path, name: str, source: str) -> None:
    (root / f"{name}.py").write_text(textwrap.dedent(source))


def test_builtin_names_resolve_to_bytelm() -> None:
    assert set(BUILTIN_TASKS) == {"bytelm", "builtin", "hf"}
    for name in ("bytelm", "builtin"):
        assert load_task(name) is bytelm.factory
    assert load_task(" bytelm ") is bytelm.factory
    from neuronode.training import hf

    assert load_task("hf") is hf.factory  # imports no Hugging Face library until it runs


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"seed": -1}, "seed"),
        ({"data_seed": 2**64}, "data_seed"),
        ({"batch_size": 0}, "batch_size"),
        ({"seq_len": -3}, "seq_len"),
        ({"d_model": 130, "n_heads": 4}, "divisible"),
    ],
)
def test_task_config_rejects_bad_values(kwargs: dict[str, int], needle: str) -> None:
    args: dict[str, Any] = {"seed": 0, "data_seed": 0} | kwargs
    with pytest.raises(TaskError, match=needle):
        TaskConfig(**args)


def test_task_config_options_are_a_read_only_copy() -> None:
    options = {"k": "v"}
    cfg = TaskConfig(seed=0, data_seed=0, options=options)
    options["k"] = "changed"
    assert cfg.options == {"k": "v"}
    with pytest.raises(TypeError):
        cfg.options["k"] = "x"  # type: ignore[index]


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("gpt5", "unknown task; use a built-in one (bytelm, builtin, hf) or 'package.module:factory'"),
        ("mod:", "expected 'package.module:factory'"),
        (":make", "expected 'package.module:factory'"),
        ("a:b:c", "expected 'package.module:factory'"),
        ("my-pkg.tasks:make", "expected 'package.module:factory'"),
        ("mypkg.tasks:make()", "expected 'package.module:factory'"),
        (
            "neuronode_no_such_pkg.tasks:make",
            "module 'neuronode_no_such_pkg.tasks' not found; is it installed / on PYTHONPATH?",
        ),
        ("neuronode.training.task:no_such_factory", "has no attribute 'no_such_factory'"),
        ("neuronode.training.task:BUILTIN_TASKS", "'BUILTIN_TASKS' is a tuple, not callable"),
    ],
)
def test_bad_specs_raise_task_error_saying_what_to_fix(spec: str, needle: str) -> None:
    with pytest.raises(TaskError) as info:
        load_task(spec)
    message = str(info.value)
    assert needle in message
    assert message.startswith(f"--task {spec}")
    assert "\n" not in message
    assert isinstance(info.value, ValueError)


def test_module_whose_dependency_is_missing_names_the_dependency(tmp_modules: Path) -> None:
    write_module(tmp_modules, "nn_task_missing_dep", "import neuronode_absent_dependency\n")
    with pytest.raises(TaskError, match="no module named 'neuronode_absent_dependency'"):
        load_task("nn_task_missing_dep:make")


def test_module_that_fails_on_import_reports_the_error(tmp_modules: Path) -> None:
    write_module(tmp_modules, "nn_task_broken", "raise RuntimeError('boom at import')\n")
    with pytest.raises(TaskError, match="raised RuntimeError: boom at import"):
        load_task("nn_task_broken:make")


def test_nested_attribute_resolves(tmp_modules: Path) -> None:
    write_module(
        tmp_modules,
        "nn_task_nested",
        """
        class Tasks:
            @staticmethod
            def make(cfg):
                return cfg
        """,
    )
    assert load_task("nn_task_nested:Tasks.make")(5) == 5  # type: ignore[arg-type]


def test_create_task_rejects_a_factory_that_returns_no_task(tmp_modules: Path) -> None:
    write_module(tmp_modules, "nn_task_wrong_type", "def make(cfg):\n    return 42\n")
    with pytest.raises(
        TaskError, match="returned a value of type 'int', not a neuronode.training.Task"
    ):
        create_task("nn_task_wrong_type:make", TaskConfig(seed=0, data_seed=0))


def test_plugin_example_loads_and_trains(plugin_path: None) -> None:
    cfg = TaskConfig(seed=3, data_seed=4, batch_size=32)
    task = create_task("plugin_task_example:make_task", cfg)
    assert isinstance(task, Task)
    assert task.samples_per_batch == 32
    again = create_task("plugin_task_example:make_task", cfg).model.state_dict()
    for name, value in task.model.state_dict().items():
        assert torch.equal(value, again[name])

    opt = torch.optim.SGD(task.model.parameters(), lr=0.1)
    losses = []
    for batch in itertools.islice(task.batches, 100):
        loss = task.loss_fn(task.model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.01 * losses[0]
