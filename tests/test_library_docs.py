"""docs/library.md's complete example runs as written (extracted from the file, not copied):
a member alone on a local text file, two rounds."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import documents

DOC = Path(__file__).resolve().parent.parent / "docs" / "library.md"


def example() -> str:
    section = DOC.read_text().split("## A complete example on local data", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "docs/library.md lost its example"
    return match.group(1)


@pytest.mark.timeout(120)
def test_the_documented_example_trains_on_a_local_text_file(tmp_path: Path) -> None:
    script = tmp_path / "swarm_text.py"
    script.write_text(example())
    text = tmp_path / "book.txt"
    text.write_text("\n".join(documents(100)))
    out = subprocess.run([sys.executable, str(script), str(text), "--data-dir", str(tmp_path / "a"),
                          "--listen", "127.0.0.1:0", "--rounds", "2"], capture_output=True, text=True, timeout=110,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    round_id, val_loss, digest = out.stdout.split()
    assert int(round_id) == 2 and float(val_loss) < 5.55 and len(digest) == 16  # ln 256 = 5.55 before training
