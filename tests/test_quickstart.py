"""docs/models.md's quick start, run as written: its commands are read from the page (not copied
here), run by bash with the installed `neuronode` command, at smaller sizes (each change below
must find its text, so a page that changes fails here rather than run something else), on a
corpus of a hundred short documents. Two nodes train together to one digest, the export loads in
transformers, and its generate() stops at the end-of-text token."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import Script, documents, free_port

from neuronode.node.status import from_data_dir

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(600)]
transformers = pytest.importorskip("transformers")

PAGE = Path(__file__).resolve().parent.parent / "docs" / "models.md"
BIN = Path(sys.executable).parent  # where pip installed the `neuronode` command


def quick_start() -> tuple[str, str]:
    """(the quick start's text, its one shell block)."""
    text = PAGE.read_text()
    section = text[text.index("## Quick start"):]
    section = section[:section.index("\n## ")]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    assert len(blocks) == 1, blocks
    return section, blocks[0]


def smaller(block: str, *, ports: tuple[int, int]) -> str:
    """The page's commands at the test's sizes and on free ports."""
    changes = {"--vocab 4096": "--vocab 400", '"vocab_size": 4096': '"vocab_size": 400',
               "--seq-len 128": "--seq-len 32", "--rounds 10": "--rounds 2", "--inner-steps 50": "--inner-steps 4",
               "127.0.0.1:7420": f"127.0.0.1:{ports[0]}", "127.0.0.1:7421": f"127.0.0.1:{ports[1]}"}
    for old, new in changes.items():
        assert old in block, f"docs/models.md's quick start no longer says {old!r}"
        block = block.replace(old, new)
    return block


def test_the_quick_start_of_docs_models_runs_as_written(tmp_path: Path) -> None:
    section, block = quick_start()
    assert (BIN / "neuronode").exists()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "stories.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in documents(100)))
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PYTHONUNBUFFERED": "1"}
    script = "set -euo pipefail\n" + smaller(block, ports=(free_port(), free_port()))
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=500, check=False)
    said = f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-6000:]}"
    assert done.returncode == 0, said

    a, b = from_data_dir(str(tmp_path / "a")), from_data_dir(str(tmp_path / "b"))
    assert a["round"] == b["round"] == 2 and a["param_digest"] == b["param_digest"], said
    assert a["last_round_contributors"] == b["last_round_contributors"] == 2, said
    printed = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    params, export = printed[1], printed[2]  # after the tokenizer's summary
    assert export["param_digest"] == a["param_digest"] and export["n_params"] == params["n_params"], printed
    assert done.stdout.strip().splitlines()[-1].startswith("Once upon"), said  # the model wrote

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "my-model")).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "my-model"))
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    prompt = tok("Once upon", return_tensors="pt")
    n = prompt["input_ids"].shape[1]
    words = [i for i in tok(" the cat sat by the river")["input_ids"] if i != eos]
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False,
                         logits_processor=[Script(n, [*words[:2], eos, *words])])[0].tolist()
    assert out[n:] == [*words[:2], eos], out[n:]  # it stops at the end of the text

    # What the page claims of the model it describes (its vocabulary, not the test's).
    claimed = float(re.search(r"about ([0-9.]+)M parameters", section).group(1))  # type: ignore[union-attr]
    config = json.loads(re.search(r"<<'EOF'\n(.*?)\nEOF", block, re.S).group(1))  # type: ignore[union-attr]
    real = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config)).parameters())
    assert round(real / 1e6, 2) == claimed, real
