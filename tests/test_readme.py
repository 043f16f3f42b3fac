"""The README stays true: every flag is documented and its plug-in example is the tested one."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from neuronode.config import NodeConfig, flag_name

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_every_start_flag_is_documented() -> None:
    missing = [flag_name(f.name) for f in dataclasses.fields(NodeConfig) if flag_name(f.name) not in README]
    assert missing == []


def test_plugin_example_matches_tested_file() -> None:
    body = (ROOT / "tests" / "plugin_task_example.py").read_text()
    code = body[body.index("import torch"):]
    assert code in README


def test_two_setup_commands_exist_in_makefile() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "make run" in README and "make test" in README
    assert "\nrun:" in makefile and "\ntest:" in makefile
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    # CI: the README's test command, then the compose swarm in containers (the README says so).
    assert ci[-2:] == ["make test", "bash scripts/compose_check.sh"]
    assert "scripts/compose_check.sh" in README
