"""The main job: a local swarm of neuronode nodes on the built-in task (no downloads).

Starts N `neuronode start` processes on 127.0.0.1 (the first alone, every other one bootstrapping
from the previous, so peer exchange has to find the rest), shows their round lines as they
come, then prints each node's final status. Ctrl-C stops every node cleanly.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

ROUND_WORDS = ("round ", "joined", "left", "refus", "agreement", "ERROR", "WARNING")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def relay(name: str, stream: object) -> None:
    for raw in iter(stream.readline, b""):  # type: ignore[attr-defined]
        line = raw.decode(errors="replace").rstrip()
        if any(word in line for word in ROUND_WORDS):
            print(f"[{name}] {line}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--data-dir", default="neuronode-data/local-swarm",
                        help="wiped at start: the demo always begins from scratch")
    args = parser.parse_args()
    root = Path(args.data_dir)
    shutil.rmtree(root, ignore_errors=True)
    ports = [free_port() for _ in range(args.nodes)]
    procs: list[subprocess.Popen[bytes]] = []
    threads = []
    for i, port in enumerate(ports):
        name = chr(ord("a") + i)
        cmd = [sys.executable, "-m", "neuronode.cli", "start", "--listen", f"127.0.0.1:{port}",
               "--data-dir", str(root / name), "--rounds", str(args.rounds),
               "--inner-steps", str(args.inner_steps), "--threads", "1"]
        if i:
            cmd += ["--peers", f"127.0.0.1:{ports[i - 1]}"]
        print(f"[{name}] $ neuronode {' '.join(cmd[3:])}", flush=True)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs.append(proc)
        t = threading.Thread(target=relay, args=(name, proc.stdout), daemon=True)
        t.start()
        threads.append(t)

    def stop(*_: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    codes = [p.wait() for p in procs]
    for t in threads:
        t.join(timeout=5)
    print("\nfinal status (neuronode status --data-dir DIR):")
    for i in range(args.nodes):
        name = chr(ord("a") + i)
        out = subprocess.run([sys.executable, "-m", "neuronode.cli", "status", "--json",
                              "--data-dir", str(root / name)], capture_output=True, text=True)
        if out.returncode == 0:
            s = json.loads(out.stdout)
            print(f"[{name}] round {s['round']} val_loss {s['val_loss']:.4f} contributors "
                  f"{s['last_round_contributors']} digest {s['param_digest'][:16]}")
        else:
            print(f"[{name}] {out.stderr.strip()}")
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
