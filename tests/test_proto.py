"""Generated protobuf code is current, and the declared runtime range matches the generator."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_not_stale(tmp_path: Path) -> None:
    written = load_generator().generate(tmp_path)
    assert written
    for fresh in written:
        committed = ROOT / fresh.relative_to(tmp_path)
        assert committed.exists(), f"{committed} missing: run `make proto`"
        assert committed.read_bytes() == fresh.read_bytes(), f"{committed} is stale: run `make proto`"


def test_protobuf_runtime_range_matches_generator() -> None:
    gen = (ROOT / "neuronode/v1/node_pb2.py").read_text()
    version = re.search(r"Protobuf Python Version: (\d+)\.(\d+)\.(\d+)", gen)
    assert version, "generated file names no protobuf version"
    major, minor, patch = (int(x) for x in version.groups())
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [d for d in deps if d.startswith("protobuf")]
    assert f">={major}.{minor}.{patch}" in spec, spec
    assert f"<{major + 1}" in spec, spec
