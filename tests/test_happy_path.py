"""scripts/happy_path.py, the count docs/architecture.md quotes, keeps working: one real round of
three members, both measures, and the path follows Δ across the wire (a tracer that lost the
mark would list only the sender's side)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Where Δ must pass on any round: encoded, pushed, received, filed, averaged.
ON_EVERY_PATH = {"codec.contribution", "codec.framing", "averaging.alltoall", "averaging.book",
                 "swarm.transport", "swarm.streams.inbound", "swarm.streams.chunks", "diloco.aggregate"}


@pytest.mark.timeout(180)
def test_the_happy_path_script_measures_both_ways() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "happy_path.py")], capture_output=True,
                          text=True, timeout=170, env=env, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    ran, path = set(result["modules"]), set(result["path"]["modules"])
    assert result["count"] == len(ran) and result["path"]["count"] == len(path)
    assert ON_EVERY_PATH <= path <= ran, (sorted(ON_EVERY_PATH - path), sorted(path - ran))
    assert not any(m.startswith("v1") for m in ran)  # generated code does not count
    assert result["swarm"] == sum(m.startswith("swarm.") for m in ran)
