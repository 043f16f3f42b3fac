"""What an operator sees: gRPC health, Prometheus metrics, JSON logs, status and the live line.

Real `neuronode start` processes on 127.0.0.1; every wait polls with a deadline.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import NODE_DEFAULTS, Node, free_port, neuronode_cmd, poll
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.swarm]

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICES = ("", "neuronode.v1.Node")
# Small rounds on a small batch: the nodes share two cores with other tests.
LIGHT = ("--batch-size", "8", "--seq-len", "64", "--task-option", "val_windows=4")
METRIC_NAMES = {
    "neuronode_rounds_total", "neuronode_inner_steps_total", "neuronode_loss",
    "neuronode_val_loss", "neuronode_tokens_per_second", "neuronode_bytes_sent_total",
    "neuronode_bytes_received_total", "neuronode_sync_seconds", "neuronode_round_contributors",
    "neuronode_peers_alive", "neuronode_utilization", "neuronode_refusals_total",
    "neuronode_local_workers", "neuronode_rank_tokens_per_second",
}
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


# ---- helpers -------------------------------------------------------------------------------

def health(address: str, service: str = "") -> int:
    """The standard gRPC health status of one service on a node."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status)


def alive_peer_addresses(node: Node) -> set[str]:
    return {p["address"] for p in node.status(live=True)["peers"] if p["alive"]}


def stop_all(nodes: list[Node], *, timeout_s: float) -> dict[str, tuple[int, float]]:
    """SIGTERM every node at once; each node's exit status and seconds to exit."""
    sent = time.monotonic()
    for node in nodes:
        assert node.proc is not None and node.proc.poll() is None, f"{node.name} died:\n{node.log()}"
        node.proc.send_signal(signal.SIGTERM)
    return {node.name: (node.wait(timeout_s), time.monotonic() - sent) for node in nodes}


@dataclass
class Scrape:
    """One parse of a /metrics page: family name -> samples (name, labels, value), and types."""

    families: dict[str, list[tuple[str, dict[str, str], float]]]
    types: dict[str, str]

    def value(self, sample: str, **labels: str) -> float:
        for samples in self.families.values():
            for name, lab, value in samples:
                if name == sample and lab == labels:
                    return value
        raise KeyError(f"no sample {sample}{labels or ''}")

    def sample_names(self) -> set[str]:
        return {name for samples in self.families.values() for name, _, _ in samples}


def scrape(url: str) -> Scrape:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    parsed = list(text_string_to_metric_families(text))
    return Scrape(families={f.name: [(s.name, dict(s.labels), float(s.value)) for s in f.samples]
                            for f in parsed},
                  types={f.name: f.type for f in parsed})


def exposed_names(s: Scrape) -> set[str]:
    """Names as exposed: counters with their `_total` (the parser strips it from family names)."""
    return {f"{name}_total" if kind == "counter" else name for name, kind in s.types.items()}


def run_on_pty(cmd: list[str], *, stream: str, timeout_s: float, stderr_path: Path | None = None
               ) -> tuple[int, str]:
    """Run `cmd` with `stream` ('stdout' or 'stderr') on a pseudo-terminal; return what the
    terminal received (bytes as written, plus the line discipline's \\n -> \\r\\n)."""
    master, slave = pty.openpty()
    spare = open(stderr_path or os.devnull, "wb")  # noqa: SIM115 - closed below
    streams: dict[str, Any] = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": spare}
    streams[stream] = slave
    proc = subprocess.Popen(cmd, env=ENV, **streams)
    os.close(slave)
    spare.close()
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if time.monotonic() > deadline:
                raise AssertionError(f"{cmd} still running after {timeout_s:.0f}s; got {b''.join(chunks)!r}")
            ready, _, _ = select.select([master], [], [], 0.5)
            if not ready:
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every slave descriptor is closed, i.e. the process ended
                break
            if not data:
                break
            chunks.append(data)
        rc = proc.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        os.close(master)
    return rc, b"".join(chunks).decode(errors="replace")


def start_cmd(data_dir: Path, *args: str) -> list[str]:
    return neuronode_cmd("start", "--data-dir", str(data_dir), "--listen", "127.0.0.1:0",
                         *NODE_DEFAULTS, *LIGHT, *args)


# ---- 1. gRPC health ------------------------------------------------------------------------

@pytest.mark.timeout(240)
def test_health_not_serving_until_joined_then_serving(tmp_path: Path) -> None:
    """B bootstraps from a port where nothing listens yet: it answers NOT_SERVING while it
    waits for first contact (up to 10 s), then SERVING. A starts meanwhile and, having no
    peers, serves at once. A's start-up plus B's redial backoff often outlast B's wait, so B
    may turn SERVING by its timeout rather than by contact; either way it then joins A."""
    train = ("--inner-steps", "5", "--rounds", "0", *LIGHT)
    a = Node(tmp_path, "a", *train)
    b = Node(tmp_path, "b", *train, "--peers", a.address)
    nodes = [a, b]
    try:
        b.start()
        poll("b to answer health checks", lambda: health(b.address) == NOT_SERVING, timeout_s=120)
        for service in SERVICES:
            assert health(b.address, service) == NOT_SERVING, service
        a.start()
        poll("a (no peers) to be SERVING", lambda: health(a.address) == SERVING, timeout_s=120)
        poll("b to be SERVING", lambda: health(b.address) == SERVING, timeout_s=60)
        for node in nodes:
            for service in SERVICES:
                assert health(node.address, service) == SERVING, (node.name, service)
        # Whether B saw A before its contact timeout or after, it ends up in A's swarm.
        poll("b to see a alive", lambda: a.address in alive_peer_addresses(b), timeout_s=60)
        poll("a to see b alive", lambda: b.address in alive_peer_addresses(a), timeout_s=60)
        exits = stop_all(nodes, timeout_s=60)
        assert all(rc == 0 for rc, _ in exits.values()), (exits, a.log(), b.log())
    finally:
        for node in nodes:
            node.kill()


# ---- 2. Prometheus metrics -----------------------------------------------------------------

@pytest.mark.timeout(360)
def test_metrics_scraped_over_http_while_training(tmp_path: Path) -> None:
    train = ("--inner-steps", "5", "--rounds", "0", *LIGHT)
    a_port, b_port = free_port(), free_port()
    a = Node(tmp_path, "a", *train, "--metrics-port", str(a_port))
    b = Node(tmp_path, "b", *train, "--metrics-port", str(b_port), "--peers", a.address)
    a_url, b_url = f"http://127.0.0.1:{a_port}/metrics", f"http://127.0.0.1:{b_port}/metrics"
    nodes = [a, b]
    try:
        a.start()
        b.start()
        b_id = poll("b's node id", lambda: (b.data_dir / "node_id").read_text().strip(), timeout_s=60)
        a_id = poll("a's node id", lambda: (a.data_dir / "node_id").read_text().strip(), timeout_s=60)

        def a_after_round_with_b(min_rounds: float, min_sent: float) -> Scrape | None:
            s = scrape(a_url)
            if s.value("neuronode_rounds_total") < min_rounds:
                return None
            if s.value("neuronode_bytes_sent_total", peer=b_id) <= min_sent:
                return None
            # B may join late and catch up first; then its contributions reach A too.
            return s if s.value("neuronode_bytes_received_total", peer=b_id) > 0 else None

        first = poll("a to finish a round with b", lambda: a_after_round_with_b(1, 0), timeout_s=240)
        rounds1 = first.value("neuronode_rounds_total")
        sent1 = first.value("neuronode_bytes_sent_total", peer=b_id)
        second = poll("a to finish another round with b",
                      lambda: a_after_round_with_b(rounds1 + 1, sent1), timeout_s=180)

        assert exposed_names(second) >= METRIC_NAMES, sorted(METRIC_NAMES - exposed_names(second))
        assert second.value("neuronode_rounds_total") > rounds1
        assert second.value("neuronode_bytes_sent_total", peer=b_id) > sent1
        assert second.value("neuronode_inner_steps_total") >= 5 * second.value("neuronode_rounds_total")
        assert second.value("neuronode_peers_alive") >= 1
        assert second.value("neuronode_sync_seconds_count") > 0
        assert second.value("neuronode_round_contributors") >= 1
        assert second.value("neuronode_tokens_per_second") > 0
        assert second.value("neuronode_local_workers") == 1  # one process: its rate is the node's
        assert second.value("neuronode_rank_tokens_per_second", rank="0") == second.value("neuronode_tokens_per_second")
        assert second.value("neuronode_val_loss") > 0
        assert 0 < second.value("neuronode_utilization") <= 1
        # B's endpoint too, keyed by A's id.
        assert scrape(b_url).value("neuronode_bytes_sent_total", peer=a_id) > 0

        # The server binds the --listen host (127.0.0.1), not every address: 127.0.0.2 is
        # loopback too, but nothing answers there.
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.2", a_port), timeout=2).close()

        exits = stop_all(nodes, timeout_s=60)
        assert all(rc == 0 for rc, _ in exits.values()), (exits, a.log(), b.log())
        # Prompt: a step boundary, a short drain, the server's grace, the metrics server closed.
        assert all(seconds < 30 for _, seconds in exits.values()), exits
        with pytest.raises(OSError):
            scrape(a_url)
    finally:
        for node in nodes:
            node.kill()


# ---- 3 and 4. JSON logs and `neuronode status` ---------------------------------------------

@dataclass
class FinishedRun:
    data_dir: Path
    rc: int
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> FinishedRun:
    """One short single-node run with JSON logs; its data dir serves the status tests."""
    data_dir = tmp_path_factory.mktemp("json-run") / "node"
    out = subprocess.run(start_cmd(data_dir, "--rounds", "1", "--inner-steps", "3", "--log-format", "json"),
                         capture_output=True, text=True, env=ENV, timeout=150, check=False)
    return FinishedRun(data_dir, out.returncode, out.stdout, out.stderr)


@pytest.mark.timeout(200)
def test_json_log_format_every_line_is_an_object(finished_run: FinishedRun) -> None:
    assert finished_run.rc == 0, finished_run.stderr
    lines = finished_run.stderr.splitlines()
    assert lines, "no log output"
    entries = []
    for line in lines:
        entry = json.loads(line)  # a line that is not JSON fails here, naming itself
        assert isinstance(entry, dict), line
        assert {"ts", "level", "logger", "msg"} <= entry.keys(), line
        assert isinstance(entry["ts"], float) and entry["level"] in {"debug", "info", "warning", "error"}
        entries.append(entry)
    messages = [e["msg"] for e in entries]
    assert any(m.startswith("round 1 done:") for m in messages), messages
    assert any(m.startswith("stopped at round 1") for m in messages), messages
    # Structured events: the facts of a line as fields, for scripts and tests.
    done = [e for e in entries if e.get("event") == "round_done"]
    assert [(e["round_id"], e["round"], len(e["contributors"])) for e in done] == [(0, 1, 1)], done
    assert len(done[0]["param_digest"]) == 64 and done[0]["val_loss"] > 0
    assert [e["round_id"] for e in entries if e.get("event") == "stopped"] == [1]
    assert finished_run.stdout == ""


@pytest.mark.timeout(200)
def test_status_json_when_piped_table_on_a_tty(finished_run: FinishedRun, tmp_path: Path) -> None:
    assert finished_run.rc == 0, finished_run.stderr
    cmd = neuronode_cmd("status", "--data-dir", str(finished_run.data_dir))
    piped = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=60, check=True)
    report = json.loads(piped.stdout)
    assert report["round"] == 1 and len(report["param_digest"]) == 64

    rc, table = run_on_pty(cmd, stream="stdout", timeout_s=60, stderr_path=tmp_path / "err")
    assert rc == 0, (tmp_path / "err").read_text()
    table = table.replace("\r\n", "\n")
    with pytest.raises(json.JSONDecodeError):
        json.loads(table)
    assert re.search(r"^param_digest\s+" + report["param_digest"] + r"$", table, re.M), table
    assert re.search(r"^round\s+1$", table, re.M), table
    assert re.search(r"^node_id\s+" + re.escape(report["node_id"]) + r"$", table, re.M), table

    rc, forced = run_on_pty([*cmd, "--json"], stream="stdout", timeout_s=60, stderr_path=tmp_path / "err")
    assert rc == 0, (tmp_path / "err").read_text()
    assert json.loads(forced.replace("\r\n", "\n")) == report


# ---- 5. The live line on a terminal --------------------------------------------------------

# One rewrite of the live line: clear, then round, step, loss, throughput; the next thing on
# the terminal is another carriage return (a rewrite or a clear), never a log line or newline.
PROGRESS = re.compile(r"\r\x1b\[2K(round 1/1 [^\r\n]*?step (\d+)/5 loss [0-9.]+ [^\r\n]*?[0-9,]+ tok/s"
                      r"[^\r\n]*)(?=\r(?!\n))")


@pytest.mark.timeout(200)
def test_live_progress_line_on_a_tty(tmp_path: Path) -> None:
    cmd = start_cmd(tmp_path / "node", "--rounds", "1", "--inner-steps", "5", "--log-format", "text")
    rc, screen = run_on_pty(cmd, stream="stderr", timeout_s=150)
    assert rc == 0, screen
    steps = [int(m.group(2)) for m in PROGRESS.finditer(screen)]
    # Every step rewrites the line today; a throttled line may skip some, but never goes back.
    assert steps and steps == sorted(set(steps)), repr(screen)
    # The line is cleared before the round's log line, so logs never trail a progress line.
    assert re.search(r"\r\x1b\[2K\d\d:\d\d:\d\d INFO neuronode\.node\.rounds: round 1 done:", screen), repr(screen)
