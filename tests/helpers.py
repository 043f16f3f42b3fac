"""What tests share: real `neuronode` processes on 127.0.0.1 (`Node`), polling with a deadline,
free ports, the SwarmConfig of in-process nodes, and the grpcio early-status workaround.
(Fixtures built on these live in conftest.py.)"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from neuronode.bench.common import free_port

# Several nodes share 2 cores: one torch thread each, quick heartbeats, small rounds.
# JSON log lines: tests read the nodes' events (Node.events) rather than match text.
NODE_DEFAULTS = ["--threads", "1", "--heartbeat-s", "0.5", "--log-level", "info", "--log-format", "json"]

# Importing torch, grpc and neuronode is ~85% of a small node's CPU (about 6 of 7 s on two busy
# cores), and the suite starts dozens of nodes. So each node is a process forked from a server
# that imported them once; it then runs `neuronode start` exactly as the console script does
# (neuronode.cli.main), with its output in its own log file.
FORKS = multiprocessing.get_context("forkserver")
FORKS.set_forkserver_preload(["neuronode.cli", "neuronode.node.daemon", "torch._dynamo", "torch.optim", __name__])


def run_cli(argv: list[str], log_path: str) -> None:
    """The body of a forked node: its output to its log file, then `neuronode ARGV`."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = sys.stderr = open(2, "w", buffering=1, closefd=False)  # open until the exit
    from neuronode.cli import main

    sys.exit(main(argv))


class Forked:
    """The slice of subprocess.Popen that Node uses, for a forked process."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self.process = process

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired("neuronode start", timeout or 0)
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()

    def send_signal(self, sig: int) -> None:
        assert self.process.pid is not None
        os.kill(self.process.pid, sig)


def neuronode_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "neuronode.cli", *args]


def torchrun(processes: int) -> list[str]:
    """`torchrun --standalone --nproc-per-node N -m neuronode`: one member of N processes."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
            "-m", "neuronode"]


def run_neuronode(*args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    """`neuronode ARGS` in a fresh process; its exit status and captured output."""
    return subprocess.run(neuronode_cmd(*args), capture_output=True, text=True, timeout=timeout_s, check=False)


class Node:
    """One `neuronode start` process with its own data dir, port and log file, forked from the
    warm server (`cold=True`: a fresh `python -m neuronode.cli` process instead; `command`: a
    fresh process of that command, e.g. `torchrun(2)`)."""

    def __init__(self, tmp: Path, name: str, *extra: str, port: int | None = None, cold: bool = False,
                 command: Sequence[str] = ()) -> None:
        self.cold = cold or bool(command)
        self.command = list(command) or neuronode_cmd()
        self.name = name
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.data_dir = tmp / name
        self.log_path = tmp / f"{name}.log"
        self.extra = list(extra)
        self.proc: subprocess.Popen[bytes] | Forked | None = None

    def start(self, *more: str) -> Node:
        args = ["start", "--data-dir", str(self.data_dir), "--listen", self.address,
                *NODE_DEFAULTS, *self.extra, *more]
        if not self.cold:
            process = FORKS.Process(target=run_cli, args=(args, str(self.log_path)), name=f"neuronode-{self.name}")
            process.start()
            self.proc = Forked(process)
            return self
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        log = open(self.log_path, "ab")  # noqa: SIM115 - the process owns it until exit
        self.proc = subprocess.Popen([*self.command, *args], stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        return self

    def wait(self, timeout_s: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout_s)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        """The node's structured log records (--log-format json) named `name`, or all of them."""
        records = []
        for line in self.log().splitlines():
            if line.startswith("{"):
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if name is None or record.get("event") == name:
                    records.append(record)
        return records

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def status(self, *, live: bool = False) -> dict[str, Any]:
        where = ["--peer", self.address] if live else ["--data-dir", str(self.data_dir)]
        out = run_neuronode("status", *where, "--json", timeout_s=30)
        if out.returncode != 0:
            raise RuntimeError(f"status of {self.name} failed: {out.stderr.strip()}")
        return dict(json.loads(out.stdout))


def stop(node: Node, *, within_s: float) -> None:
    """SIGTERM `node`: it exits 0 within `within_s` seconds (a failure shows its log tail)."""
    assert node.proc is not None
    sent = time.monotonic()
    node.proc.send_signal(signal.SIGTERM)
    assert node.wait(within_s) == 0, f"{node.name}:\n{node.log()[-4000:]}"
    assert time.monotonic() - sent < within_s


def finish(nodes: Sequence[Node], timeout_s: float = 400) -> None:
    """Every node exits 0 within `timeout_s` (each); a failure shows that node's log tail."""
    for node in nodes:
        assert node.wait(timeout_s) == 0, f"{node.name}:\n{node.log()[-4000:]}"


def run_to_end(nodes: Sequence[Node], timeout_s: float = 300) -> None:
    """Start `nodes` together, wait until every one exits 0 (`finish`), kill what is left."""
    try:
        for node in nodes:
            node.start()
        finish(nodes, timeout_s)
    finally:
        for node in nodes:
            node.kill()


def poll(what: str, predicate: Callable[[], Any], *, timeout_s: float, every_s: float = 0.2,
         context: Callable[[], str] | None = None) -> Any:
    """Wait for `predicate()` to return something truthy; fail with `what` (and `context()`,
    e.g. a log tail) at the deadline."""
    deadline = time.monotonic() + timeout_s
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - keep polling until the deadline
            last_exc = exc
        time.sleep(every_s)
    where = f"\n{context()}" if context is not None else ""
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what} (last error: {last_exc}){where}")


# grpcio's asyncio client may report a client stream the server refused before reading all of
# it as INTERNAL "Internal error from Core" instead of the server's status (grpc/grpc#36066; a
# fix is pending upstream in grpc/grpc#43486). A refusal is deterministic, so tests that check a
# refused push's status send it again when they meet this.
GRPC_EARLY_STATUS_BUG = "Internal error from Core"


def hides_refusal(code: Any, details: str) -> bool:
    """True if (code, details) is that grpcio client bug rather than the node's answer."""
    return getattr(code, "name", "") == "INTERNAL" and details == GRPC_EARLY_STATUS_BUG


async def wait_until(predicate: Callable[[], bool], *, what: str, timeout_s: float = 10.0) -> None:
    """Poll `predicate` (the code under test runs meanwhile) until it holds; fail naming `what`
    after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"still waiting after {timeout_s} s for {what}")
        await asyncio.sleep(0.02)


def non_loopback_ipv4() -> str | None:
    """This machine's address on its default route, if it has one (no packet is sent): a
    caller that dials it reaches a local server from a host that is not loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.1", 9))
        except OSError:
            return None
        host = str(sock.getsockname()[0])
    return None if host.startswith("127.") or host == "0.0.0.0" else host


def swarm_config(node_id: str, **overrides: Any) -> Any:
    """The SwarmConfig of an in-process test node on 127.0.0.1:0 (fields overridable)."""
    from neuronode.swarm.node import SwarmConfig

    fields: dict[str, Any] = dict(node_id=node_id, swarm_id="net-test", manifest_hash="a1" * 32, n_elements=10_000,
                                  listen="127.0.0.1:0", advertise="", heartbeat_s=0.2, sync_timeout_s=20.0)
    fields.update(overrides)
    return SwarmConfig(**fields)


class Nodes:
    """Starts in-process SwarmNodes on 127.0.0.1:0; `stop_all` stops every one still running."""

    def __init__(self, executor: ThreadPoolExecutor) -> None:
        self.executor = executor
        self.running: list[Any] = []

    async def start(self, node_id: str, *, peers: Iterable[str] = (), **overrides: Any) -> Any:
        from neuronode.swarm.guard.proofs import Security
        from neuronode.swarm.node import SwarmNode

        cfg = swarm_config(node_id, peers=tuple(peers), **overrides)
        node = SwarmNode(cfg, executor=self.executor,
                         security=Security(node_id=node_id, swarm_id=cfg.swarm_id, key=key_of(node_id)))
        await node.start()
        self.running.append(node)
        return node

    async def stop(self, node: Any) -> None:
        self.running.remove(node)
        await node.stop(grace_s=0.5)

    async def stop_all(self) -> None:
        nodes, self.running = self.running, []
        await asyncio.gather(*(n.stop(grace_s=0.5) for n in nodes), return_exceptions=True)


def encode(node_id: str, x: Any, *, round_id: int = 0, weight: float = 1.0, chunk_bytes: int = 4096,
           base_digest: str = "") -> Any:
    """What a node's encoder makes of `x` for one round (fp32, zstd 1, no error feedback)."""
    from neuronode.codec import VectorEncoder

    encoder = VectorEncoder(codec="fp32", chunk_bytes=chunk_bytes, zstd_level=1, byte_shuffle=False)
    return encoder.encode(x, 0.0, weight=weight, round_id=round_id, sender_id=node_id, base_digest=base_digest)


def key_of(node_id: str) -> Any:
    """The signing key tests give `node_id` (the same in every test and process: a raw client
    speaking as an in-process node signs as that node)."""
    from neuronode.security.identity import NodeKey

    return NodeKey.from_seed(b"neuronode-test-key/" + node_id.encode())


def sign_header(chunk: Any, *, key: Any = None, default: bytes = b"") -> bytes:
    """The signature of `chunk.sender_id` (its test key, or `key`) over the statement a chunk
    header makes; `default` for a header that makes none (an unknown phase)."""
    from neuronode.swarm.guard.proofs import Security
    from neuronode.swarm.streams.headers import header_statement

    try:
        statement = header_statement(chunk)
    except ValueError:
        return default
    return Security(node_id=chunk.sender_id, swarm_id=chunk.swarm_id,
                    key=key or key_of(chunk.sender_id)).sign_statement(statement)


def chunks_of(c: Any, *, swarm_id: str, sender_id: str = "", secret: bytes = b"", key: Any = None) -> list[Any]:
    """The ContributionChunk stream that carries contribution `c` (as `sender_id`), tagged with
    `secret` when given and signed with `key` (default: key_of(sender_id)), as the wire
    protocol defines it."""
    from neuronode.swarm.guard.proofs import Security
    from neuronode.swarm.streams.headers import bound_digest, header_statement
    from neuronode.swarm.wire import CODEC_TO_PB
    from neuronode.v1 import node_pb2 as pb

    sender_id = sender_id or c.sender_id
    security = Security(node_id=sender_id, swarm_id=swarm_id, secret=secret, key=key or key_of(sender_id))
    signed = dict(round_id=c.round_id, sender_id=sender_id,
                  contribution_digest=bound_digest(c.digest, c.base_digest, c.phase, c.shard_index, c.members,
                                                   c.contributors),
                  codec=c.codec, weight=c.weight, total_elements=c.n_elements)
    chunks = [pb.ContributionChunk(
        round_id=c.round_id, sender_id=sender_id, swarm_id=swarm_id, chunk_index=f.index, chunk_count=f.count,
        codec=CODEC_TO_PB[c.codec], compressed=f.compressed, payload=f.data, contribution_digest=c.digest,
        weight=c.weight, total_elements=c.n_elements, chunk_elements=c.chunk_elements,
        auth_tag=security.contribution_tag(**signed), base_digest=c.base_digest, sender_host=c.host)
        for f in c.frames]
    signature = security.sign_statement(header_statement(chunks[0])) if chunks else b""
    for chunk in chunks:
        chunk.signature = signature
    return chunks


# ---- --task hf: a tiny Llama and a corpus of short stories (docs/models.md) ----------------------

WORDS = ("the cat sat on a mat while dogs ran fast over green hills and birds sang songs of joy in an old "
         "town by the river where children played games until the sun went down").split()


def documents(n: int) -> list[str]:
    rng = random.Random(1)
    return [f"story {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(15, 60))) + "." for i in range(n)]


def llama(folder: Path, *, hidden: int = 64, vocab: int = 512) -> Path:
    """The tiny Llama of docs/models.md: 2 layers, hidden 64."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "intermediate_size": 2 * hidden, "vocab_size": vocab, "max_position_embeddings": 256}))
    return folder


class Script:
    """A transformers logits processor that makes generate() emit `tokens`, one a step, then the
    last one again: what a trained model would say, without training one long enough to say it
    (to check where generation stops)."""

    def __init__(self, prompt_len: int, tokens: list[int]) -> None:
        self.prompt_len = prompt_len
        self.tokens = tokens

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        step = input_ids.shape[1] - self.prompt_len
        forced = scores.new_full(scores.shape, -float("inf"))
        forced[:, self.tokens[min(step, len(self.tokens) - 1)]] = 0.0
        return forced
