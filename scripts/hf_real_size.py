"""Real size for --task hf (docs/benchmarks.md): two `neuronode start` processes on 127.0.0.1 train
a Llama of about 27M parameters for a few rounds; prints one JSON object with seconds per inner
step, bytes per round, peak RSS per node, checkpoint and export seconds.

The corpus is the running Python's standard library source (as the built-in task's), written
as jsonl; the tokenizer is trained on it by `neuronode tokenizer train`. Nothing is downloaded.
Needs the hf extra. Usage: python scripts/hf_real_size.py [--rounds 3] [--inner-steps 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

# A Llama of 27.4M parameters: 6 layers of width 512, vocabulary 8192, untied output layer.
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512, "num_hidden_layers": 6,
         "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 1376, "vocab_size": 8192,
         "max_position_embeddings": 1024, "tie_word_embeddings": False}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def neuronode(*args: str) -> list[str]:
    return [sys.executable, "-m", "neuronode.cli", *args]


def write_corpus(folder: Path, max_bytes: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    root, total = Path(sysconfig.get_paths()["stdlib"]), 0
    with (folder / "stdlib.jsonl").open("w") as fh:
        for path in sorted(root.rglob("*.py")):
            if "site-packages" in path.parts or "test" in path.parts:
                continue
            text = path.read_text(errors="replace")
            fh.write(json.dumps({"text": text}) + "\n")
            total += len(text)
            if total >= max_bytes:
                break


def events(log: Path) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def step_seconds(evs: list[dict[str, Any]], inner_steps: int) -> list[float]:
    """Per round: (contribution ready - previous round's end) / inner steps."""
    start = next(e["ts"] for e in evs if e.get("event") == "joined")
    out = []
    for e in evs:
        if e.get("event") == "contribution_ready":
            out.append((e["ts"] - start) / inner_steps)
        elif e.get("event") == "round_done":
            start = e["ts"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inner-steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--codec", default="bf16")
    parser.add_argument("--out", default="hf-real-size")
    args = parser.parse_args()
    work = Path(args.out).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "corpus" / "stdlib.jsonl").exists():
        write_corpus(work / "corpus", 8 << 20)
    if not (work / "tok").exists():
        subprocess.run(neuronode("tokenizer", "train", "--data", str(work / "corpus" / "*.jsonl"), "--vocab",
                                 str(LLAMA["vocab_size"]), "--out", str(work / "tok")), check=True)
    (work / "model").mkdir(exist_ok=True)
    (work / "model" / "config.json").write_text(json.dumps(LLAMA, indent=2))
    options = f"model={work / 'model'},tokenizer={work / 'tok'},data={work / 'corpus'}/*.jsonl,val_share=0.02,val_windows=4"
    common = ["--task", "hf", "--task-option", options, "--rounds", str(args.rounds), "--inner-steps",
              str(args.inner_steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
              "--codec", args.codec, "--threads", "1", "--min-peers", "2", "--sync-timeout", "600",
              "--log-format", "json", "--log-level", "debug"]
    ports = [free_port(), free_port()]
    procs = []
    for i, name in enumerate(("a", "b")):
        data_dir = work / name
        if data_dir.exists():
            subprocess.run(["rm", "-rf", str(data_dir)], check=True)
        peers = ["--peers", f"127.0.0.1:{ports[0]}"] if i else []
        log = (work / f"{name}.log").open("w")
        cmd = ["/usr/bin/time", "-v", *neuronode("start", "--data-dir", str(data_dir), "--listen",
                                                 f"127.0.0.1:{ports[i]}", "--node-id", name, *common, *peers)]
        procs.append((name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
    t0 = time.perf_counter()
    for _, proc, log in procs:
        proc.wait()
        log.close()
    wall_s = time.perf_counter() - t0
    result: dict[str, Any] = {"params": None, "rounds": args.rounds, "inner_steps": args.inner_steps,
                              "batch": f"{args.batch_size}x{args.seq_len}", "codec": args.codec,
                              "wall_s": round(wall_s, 1), "nodes": {}, "uptime": os.getloadavg()}
    for name, proc, _ in procs:
        log_path = work / f"{name}.log"
        text, evs = log_path.read_text(errors="replace"), events(log_path)
        rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
        status = json.loads(subprocess.run(neuronode("status", "--data-dir", str(work / name), "--json"),
                                           capture_output=True, text=True, check=True).stdout)
        result["params"] = status.get("n_params")
        saved = [e["seconds"] for e in evs if e.get("event") == "checkpoint_saved"]
        ckpt_bytes = [e["bytes"] for e in evs if e.get("event") == "checkpoint_saved"]
        result["nodes"][name] = {
            "exit": proc.returncode, "peak_rss_mib": round(int(rss.group(1)) / 1024) if rss else None,
            "step_s": [round(s, 2) for s in step_seconds(evs, args.inner_steps)],
            "bytes_sent_per_round": status["bytes_sent"] // max(status["round"], 1),
            "bytes_received_per_round": status["bytes_received"] // max(status["round"], 1),
            "checkpoint_s": saved, "checkpoint_mib": round(max(ckpt_bytes or [0]) / 2**20, 1),
            "val_loss": [e["val_loss"] for e in evs if e.get("event") in ("validated", "round_done")],
            "param_digest": status["param_digest"][:16],
        }
    t1 = time.perf_counter()
    exported = subprocess.run(neuronode("export", "--data-dir", str(work / "a"), "--out", str(work / "exported")),
                              capture_output=True, text=True, check=True)
    result["export_s_wall"] = round(time.perf_counter() - t1, 2)
    result["export_s"] = json.loads(exported.stdout)["seconds"]
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
