"""The command line as a newcomer meets it: no abbreviated flag in any subcommand, the hf task's
own flags (--model, --tokenizer, --data, --val-data) beside --task-option with the same
precedence, and --print-params."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from helpers import llama

from neuronode.cli import build_parser, main
from neuronode.config_sources import build_config
from neuronode.errors import ConfigError


def parsers(parser: argparse.ArgumentParser, path: str = "neuronode") -> list[tuple[str, argparse.ArgumentParser]]:
    """Every parser under `neuronode`, with its command path."""
    out = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += parsers(sub, f"{path} {name}")
    return out


def test_no_subcommand_takes_an_abbreviated_flag() -> None:
    found = parsers(build_parser())
    assert len(found) > 10 and [p for p, parser in found if parser.allow_abbrev] == []


@pytest.mark.parametrize("argv", [
    ["start", "--inner-step", "5"],
    ["start", "--rou", "3"],
    ["bench", "sync", "--node", "3"],
    ["tokenizer", "train", "--data", "x", "--vocab", "300", "--out", "y", "--thread", "1"],
    ["status", "--data", "x"],
])
def test_an_abbreviated_flag_is_unknown(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unrecognized arguments" in err[0] and argv[-2] in err[0], err


def test_hf_flags_are_task_options_with_the_precedence_of_every_flag(tmp_path: Path) -> None:
    toml = tmp_path / "node.toml"
    toml.write_text('task = "hf"\nmodel = "from-toml"\ndata = "toml/*.jsonl"\ntokenizer = "tok"\n')
    cfg = build_config({"data": "a,b/*.jsonl"}, config_file=str(toml), environ={"NEURONODE_MODEL": "from-env"})
    assert cfg.task_options() == {"model": "from-env", "data": "a,b/*.jsonl", "tokenizer": "tok"}
    same = build_config({"task": "hf", "model": "m", "task_option": "model=m,val_share=0.1"}, environ={})
    assert same.task_options() == {"val_share": "0.1", "model": "m"}
    with pytest.raises(ConfigError, match=r"^--model m and --task-option model=other disagree"):
        build_config({"task": "hf", "model": "m", "task_option": "model=other"}, environ={})
    with pytest.raises(ConfigError, match=r"^--model, --data: options of --task hf"):
        build_config({"model": "m", "data": "d"}, environ={})


def test_print_params_builds_the_model_as_a_node_would(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    transformers = pytest.importorskip("transformers")
    model = llama(tmp_path / "tiny", vocab=300)
    data = tmp_path / "corpus"
    data.mkdir()
    (data / "a.txt").write_text("\n\n".join(f"paragraph {i} " + "words " * 30 for i in range(40)))
    argv = ["start", "--task", "hf", "--model", str(model), "--tokenizer", "bytes", "--data", str(data),
            "--seq-len", "32", "--batch-size", "2", "--inner-steps", "5", "--grad-accum", "2", "--print-params"]
    assert main(argv) == 0
    said: dict[str, Any] = json.loads(capsys.readouterr().out)
    reference = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(str(model)))
    assert said["n_params"] == sum(p.numel() for p in reference.parameters())
    assert said["tokens_per_round"] == 2 * 32 * 5 * 2 and said["settings"]["hidden_size"] == "64"
    assert main([*argv[:-3], "--print-params", "--data", str(tmp_path / "none")]) == 2  # the data is checked too
    assert "no file matches" in capsys.readouterr().err
