"""Deployment files stay runnable: compose, Dockerfile, systemd unit, Prometheus, Grafana, docs.

No Docker engine and no network: every node command in docker-compose.yml, the image's
ENTRYPOINT + CMD and the unit's ExecStart go through neuronode's real parser and config merge,
exactly as `neuronode.cli.run_start` does; the image's command and health check run as real
processes outside Docker.
"""

from __future__ import annotations

import configparser
import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import free_port, poll

from neuronode.cli import build_parser
from neuronode.codec import get_codec
from neuronode.config import NodeConfig, build_config, parse_hostport

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DOCKERIGNORE = ROOT / "deploy" / "Dockerfile.dockerignore"
UNIT = ROOT / "deploy" / "neuronode.service"
NODE_TOML = ROOT / "deploy" / "node.toml.example"
PROMETHEUS = ROOT / "deploy" / "prometheus.yml"
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "neuronode.json"
VOLUNTEER = ROOT / "docs" / "volunteer.md"

METRICS_PORT = 9400
METRICS = {
    "neuronode_rounds_total", "neuronode_inner_steps_total", "neuronode_loss", "neuronode_val_loss",
    "neuronode_tokens_per_second", "neuronode_bytes_sent_total", "neuronode_bytes_received_total",
    "neuronode_sync_seconds", "neuronode_round_contributors", "neuronode_peers_alive",
    "neuronode_utilization", "neuronode_refusals_total",
}
# Every node of a swarm must agree on these (README: swarm id, task, model size, seed).
SWARM_WIDE = ("swarm_id", "task", "task_option", "seq_len", "d_model", "n_layers", "n_heads", "seed")
FIELD_NAMES = {f.name for f in dataclasses.fields(NodeConfig)}


# --- helpers ----------------------------------------------------------------------------------

def parse_start(args: list[str], environ: dict[str, str] | None = None) -> NodeConfig:
    """`neuronode start ARGS` through the real parser and config merge, as cli.run_start does.

    An unknown flag raises the parser's UsageError ("unrecognized arguments: --flag").
    """
    ns = build_parser().parse_args(["start", *args])
    flags = {name: getattr(ns, name) for name in FIELD_NAMES}
    return build_config(flags, config_file=ns.config, environ=environ or {})


def load_compose() -> dict[str, Any]:
    return dict(yaml.safe_load(COMPOSE.read_text()))


def node_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Services built from deploy/Dockerfile: the neuronode nodes."""
    return {name: svc for name, svc in compose["services"].items()
            if (svc.get("build") or {}).get("dockerfile") == "deploy/Dockerfile"}


def environment(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def compose_configs() -> dict[str, NodeConfig]:
    out = {}
    for name, svc in node_services(load_compose()).items():
        command = [str(a) for a in svc["command"]]
        assert command[0] == "start", f"{name}: command must start with 'start'"
        out[name] = parse_start(command[1:], environment(svc))
    return out


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) pairs, continuation lines joined, comments dropped."""
    joined, out = "", []
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") and not joined:
            continue
        joined += line.rstrip("\\").strip() + " " if line.endswith("\\") else line.strip()
        if not line.endswith("\\"):
            if joined:
                word, _, rest = joined.partition(" ")
                out.append((word.upper(), rest.strip()))
            joined = ""
    return out


def dockerfile_json(instruction: str) -> list[str]:
    """The exec-form (JSON array) argument of the last ENTRYPOINT / CMD / HEALTHCHECK CMD."""
    rest = [r for i, r in dockerfile_instructions() if i == instruction][-1]
    if instruction == "HEALTHCHECK":
        rest = rest[rest.index(" CMD ") + len(" CMD "):]
    value = json.loads(rest)
    assert isinstance(value, list), f"{instruction} must use the exec (JSON array) form"
    return [str(v) for v in value]


def image_command(*extra: str) -> tuple[list[str], dict[str, str]]:
    """ENTRYPOINT + CMD + extra as a local argv, with the image's ENV (no NEURONODE_* leaks)."""
    argv = dockerfile_json("ENTRYPOINT") + dockerfile_json("CMD") + list(extra)
    return local_argv(argv), image_env()


def local_argv(argv: list[str]) -> list[str]:
    assert argv[0] == "neuronode"
    script = Path(sys.executable).parent / "neuronode"  # the console script pip installed
    head = [str(script)] if script.exists() else [sys.executable, "-m", "neuronode.cli"]
    return head + argv[1:]


def image_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEURONODE_")}
    for instruction, rest in dockerfile_instructions():
        if instruction == "ENV":
            env.update(dict(item.split("=", 1) for item in shlex.split(rest)))
    return env


# --- docker-compose.yml ------------------------------------------------------------------------

def test_compose_has_four_nodes_each_with_its_own_volume() -> None:
    compose = load_compose()
    nodes = node_services(compose)
    assert len(nodes) >= 4, sorted(compose["services"])
    volumes = {}
    for name, svc in nodes.items():
        data = [v for v in svc["volumes"] if str(v).endswith(":/data")]
        assert len(data) == 1, f"{name}: mount exactly one volume at /data"
        volume = str(data[0]).split(":")[0]
        assert volume in (compose.get("volumes") or {}), f"{name}: '{volume}' is not a named volume"
        volumes[name] = volume
    assert len(set(volumes.values())) == len(nodes), volumes


def test_compose_node_commands_are_accepted_by_neuronode_start() -> None:
    configs = compose_configs()
    assert configs
    for name, cfg in configs.items():
        _, listen_port = parse_hostport(cfg.listen, "--listen")
        assert cfg.data_dir == "/data", name
        assert cfg.advertise == f"{name}:{listen_port}", f"{name}: peers dial it by service name"
        assert cfg.threads == 1, f"{name}: several nodes share one machine"


def test_compose_one_bootstrap_and_the_others_join_it() -> None:
    configs = compose_configs()
    bootstrap = [name for name, cfg in configs.items() if not cfg.peers]
    assert len(bootstrap) == 1, f"exactly one node starts without --peers, not {bootstrap}"
    first = configs[bootstrap[0]]
    for name, cfg in configs.items():
        if name != bootstrap[0]:
            assert cfg.peers == (first.advertise,), name
        for field in SWARM_WIDE:
            assert getattr(cfg, field) == getattr(first, field), f"{name}: --{field} differs"


def compose_cli() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30, check=False)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


def test_compose_file_is_valid_for_docker_compose() -> None:
    cli = compose_cli()
    if cli is None:
        pytest.skip("neither docker-compose nor the docker compose plugin is installed")
    for profile in ([], ["--profile", "monitoring"]):
        out = subprocess.run([*cli, "-f", str(COMPOSE), *profile, "config", "-q"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 0, out.stderr


def test_monitoring_profile_scrapes_every_node() -> None:
    compose = load_compose()
    services = compose["services"]
    for name, port in (("prometheus", 9090), ("grafana", 3000)):
        assert services[name]["profiles"] == ["monitoring"], name
        assert any(str(p).startswith(f"{port}:") for p in services[name]["ports"]), name
        for mount in services[name]["volumes"]:
            assert (ROOT / mount.split(":")[0]).exists(), f"{name}: {mount} mounts a missing path"
    scrape = yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]
    targets = {t for job in scrape for sc in job["static_configs"] for t in sc["targets"]}
    nodes = node_services(compose)
    assert targets == {f"{name}:{METRICS_PORT}" for name in nodes}
    if "metrics_port" in FIELD_NAMES:  # once --metrics-port exists, every node must serve there
        for name, cfg in compose_configs().items():
            assert cfg.metrics_port == METRICS_PORT, name  # type: ignore[attr-defined]


def test_grafana_dashboard_shows_every_metric_from_the_provisioned_datasource() -> None:
    datasources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (source,) = datasources["datasources"]
    assert source["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "neuronode.yml").read_text())
    (provider,) = providers["providers"]
    grafana_mounts = load_compose()["services"]["grafana"]["volumes"]
    assert f"./deploy/grafana/dashboards:{provider['options']['path']}:ro" in grafana_mounts

    dashboard = json.loads(DASHBOARD.read_text())
    used = set()
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == source["uid"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == source["uid"], panel["title"]
            for metric in re.findall(r"neuronode_[a-z_]+", target["expr"]):
                used.add(re.sub(r"_(bucket|sum|count)$", "", metric))
    assert used == METRICS, f"unknown: {used - METRICS}, not shown: {METRICS - used}"


# --- deploy/Dockerfile -------------------------------------------------------------------------

def test_dockerfile_image_shape() -> None:
    instructions = dockerfile_instructions()
    args = [rest for i, rest in instructions if i == "ARG"]
    assert "BASE_IMAGE=python:3.11-slim" in args
    assert any(a.startswith("TORCH_SPEC=") for a in args)
    assert instructions[-1][0] in ("CMD", "ENTRYPOINT")
    final = max(n for n, (i, _) in enumerate(instructions) if i == "FROM")
    assert instructions[final][1] == "${BASE_IMAGE}"
    tail = instructions[final:]
    assert ("USER", "neuronode") in tail
    assert ("VOLUME", "/data") in tail
    assert {"7420", "9400"} <= {p for i, r in tail if i == "EXPOSE" for p in r.split()}
    assert dockerfile_json("ENTRYPOINT") == ["neuronode"]
    assert dockerfile_json("CMD") == ["start", "--data-dir", "/data", "--listen", "0.0.0.0:7420", "--open"]
    cfg = parse_start(dockerfile_json("CMD")[1:])
    health = dockerfile_json("HEALTHCHECK")
    assert health == ["neuronode", "status", "--peer", f"127.0.0.1:{cfg.listen.rsplit(':', 1)[1]}", "--json"]


def test_dockerignore_lets_every_copied_path_through() -> None:
    """The allow-list in Dockerfile.dockerignore keeps the context small; COPY must still work."""
    lines = [s.strip() for s in DOCKERIGNORE.read_text().splitlines()]
    patterns = [s for s in lines if s and not s.startswith("#")]
    assert patterns[0] == "*"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    for instruction, rest in dockerfile_instructions():
        if instruction == "COPY" and not rest.startswith("--from"):
            for source in rest.split()[:-1]:
                assert source.rstrip("/") in allowed, f"COPY {source} is excluded from the context"
                assert (ROOT / source).exists(), source


@pytest.mark.swarm
def test_image_command_runs_outside_docker(tmp_path: Path) -> None:
    data = tmp_path / "data"
    argv, env = image_command("--data-dir", str(data), "--rounds", "1", "--inner-steps", "2",
                              "--listen", "127.0.0.1:0", "--threads", "1")
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    (ckpt,) = (data / "checkpoints").glob("round-*.ckpt")
    # docs/volunteer.md sizes the disk at 24 bytes per parameter for lossy codecs (bf16 here).
    params = int(re.search(r"(\d+) parameters", out.stdout + out.stderr).group(1))  # type: ignore[union-attr]
    assert 24 <= ckpt.stat().st_size / params < 25, ckpt.stat().st_size / params


@pytest.mark.swarm
def test_healthcheck_fails_without_a_node_and_passes_with_one(tmp_path: Path) -> None:
    port = free_port()
    health = local_argv([a.replace("127.0.0.1:7420", f"127.0.0.1:{port}") for a in dockerfile_json("HEALTHCHECK")])
    began = time.monotonic()
    nobody = subprocess.run(health, env=image_env(), capture_output=True, timeout=30, check=False)
    assert nobody.returncode != 0
    assert time.monotonic() - began < 10, "must answer within the HEALTHCHECK --timeout"

    argv, env = image_command("--data-dir", str(tmp_path / "data"), "--listen", f"127.0.0.1:{port}",
                              "--inner-steps", "5", "--threads", "1")
    with open(tmp_path / "node.log", "wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        poll("the health check to pass", lambda: subprocess.run(
            health, env=image_env(), capture_output=True, timeout=30, check=False).returncode == 0,
            timeout_s=90, every_s=0.5)
        proc.send_signal(signal.SIGTERM)
        # docker-compose.yml stop_grace_period and the unit's TimeoutStopSec are 30 s.
        assert proc.wait(timeout=30) == 0, (tmp_path / "node.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


# --- systemd unit and example config -----------------------------------------------------------

def read_unit() -> configparser.ConfigParser:
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    unit.read_string(UNIT.read_text())
    return unit


def test_systemd_unit_directives() -> None:
    service = read_unit()["Service"]
    expected = {
        "User": "neuronode", "Restart": "on-failure", "KillSignal": "SIGTERM",
        "TimeoutStopSec": "30", "NoNewPrivileges": "true", "ProtectSystem": "strict",
        "ReadWritePaths": "/var/lib/neuronode", "PrivateTmp": "true", "StateDirectory": "neuronode",
    }
    assert {k: service.get(k) for k in expected} == expected
    assert read_unit()["Install"]["WantedBy"] == "multi-user.target"


def test_systemd_execstart_parses_with_the_example_config(tmp_path: Path) -> None:
    argv = shlex.split(read_unit()["Service"]["ExecStart"])
    assert argv[:3] == ["/usr/local/bin/neuronode", "start", "--config"]
    assert argv[3] == "/etc/neuronode/node.toml"
    local = tmp_path / "node.toml"
    local.write_text(NODE_TOML.read_text().replace('"/var/lib/neuronode"', json.dumps(str(tmp_path))))
    cfg = parse_start(["--config", str(local), *argv[4:]])
    assert cfg.data_dir == str(tmp_path)


def test_example_config_matches_the_unit() -> None:
    cfg = build_config({}, config_file=str(NODE_TOML), environ={})
    service = read_unit()["Service"]
    assert cfg.data_dir == service["ReadWritePaths"] == "/var/lib/" + service["StateDirectory"]
    assert cfg.peers and cfg.advertise and cfg.swarm_id != NodeConfig().swarm_id


# --- docs/volunteer.md -------------------------------------------------------------------------

SIZES = (("1M", 10**6), ("100M", 10**8), ("1B", 10**9))


def human_bytes(n: int) -> str:
    """Decimal units, three significant digits rounded half up: 562500 -> '563 kB'."""
    units = (("GB", 10**9), ("MB", 10**6), ("kB", 10**3))
    unit, scale = next(((u, s) for u, s in units if n >= s), ("B", 1))
    value = Decimal(n) / scale
    text = f"{value.quantize(Decimal(1).scaleb(value.adjusted() - 2), rounding=ROUND_HALF_UP):f}"
    return f"{text.rstrip('0').rstrip('.') if '.' in text else text} {unit}"


def bandwidth_rows() -> list[str]:
    """Bytes one node sends to each peer per round, from the codecs' exact payload sizes (the
    sparse codec's bound: its size varies, below that)."""
    rows = []
    for codec in ("fp32", "fp16", "bf16", "int8", "int4", "sparse"):
        c = get_codec(codec)
        per_param = c.payload_bytes(10**9) / 10**9
        cells = " | ".join(human_bytes(c.payload_bytes(p)) for _, p in SIZES)
        label, shown = (codec, f"{per_param:g}") if c.exact_size else (f"{codec}, at most", f"{per_param:.4f}")
        rows.append(f"| {label} | {shown} | {cells} |")
    return rows


def disk_rows(keep: int = 3) -> list[str]:
    """Checkpoint bytes: params, working copy, outer momentum, 2 AdamW moments (+ error feedback)."""
    rows = []
    for label, p in SIZES:
        exact, lossy = 20 * p, 24 * p
        rows.append(f"| {label} | {human_bytes(exact)} | {human_bytes(lossy)} | {human_bytes((keep + 1) * lossy)} |")
    return rows


def test_volunteer_doc_tables_match_the_codecs() -> None:
    doc = VOLUNTEER.read_text()
    for row in bandwidth_rows() + disk_rows():
        assert row in doc, f"docs/volunteer.md lacks the row\n{row}"
    assert NodeConfig().keep_checkpoints == 3


def test_volunteer_doc_names_real_commands() -> None:
    doc = VOLUNTEER.read_text()
    for needle in ("neuronode status --peer 127.0.0.1:7420", "docker compose up --build",
                   "docker compose logs -f node-a", "docker compose --profile monitoring up",
                   "http://localhost:3000", "systemctl stop neuronode", "--advertise",
                   "payload_bytes_per_param", "wire_bytes_per_param"):
        assert needle in doc, needle
