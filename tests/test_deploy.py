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
from neuronode.config import NodeConfig, parse_hostport
from neuronode.config_sources import build_config

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DOCKERIGNORE = ROOT / "deploy" / "Dockerfile.dockerignore"
PROMETHEUS_DOCKERFILE = ROOT / "deploy" / "prometheus.Dockerfile"
COMPOSE_CHECK = ROOT / "scripts" / "compose_check.sh"
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


def interpolate(text: str, environ: dict[str, str]) -> str:
    """Compose's variable substitution: ${VAR}, ${VAR:-default} (unset or empty: the default)."""
    def value(m: re.Match[str]) -> str:
        name, default = m.group(1), m.group(3)
        if default is not None:
            return environ.get(name) or default
        assert name in environ, f"${{{name}}} has no default"
        return environ[name]
    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(:-([^}]*))?\}", value, text)


def load_compose(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """docker-compose.yml as compose reads it with the variables of `environ` (default: none set)."""
    return dict(yaml.safe_load(interpolate(COMPOSE.read_text(), environ or {})))


def node_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Services built from deploy/Dockerfile: the neuronode nodes."""
    return {name: svc for name, svc in compose["services"].items()
            if (svc.get("build") or {}).get("dockerfile") == "deploy/Dockerfile"}


def environment(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def compose_configs(environ: dict[str, str] | None = None) -> dict[str, NodeConfig]:
    out = {}
    for name, svc in node_services(load_compose(environ)).items():
        command = [str(a) for a in svc["command"]]
        assert command[0] == "start", f"{name}: command must start with 'start'"
        out[name] = parse_start(command[1:], environment(svc))
    return out


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) pairs, continuation lines joined, comments dropped."""
    joined, out = "", []
    for line in path.read_text().splitlines():
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


def final_stage(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """The instructions of the image's last stage, from its FROM on."""
    instructions = dockerfile_instructions(path)
    last = max(n for n, (i, _) in enumerate(instructions) if i == "FROM")
    return instructions[last:]


def image_env() -> dict[str, str]:
    """This environment with the final stage's ENV ($VAR references expanded), no NEURONODE_*."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEURONODE_")}
    for instruction, rest in final_stage():
        if instruction == "ENV":
            for item in shlex.split(rest):
                name, value = item.split("=", 1)
                env[name] = re.sub(r"\$(\w+)", lambda m: env.get(m.group(1), ""), value)
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


# What scripts/compose_check.sh sets to run a short swarm (its compose() function).
SHORT = {"NEURONODE_ROUNDS": "6", "NEURONODE_INNER_STEPS": "5", "NEURONODE_RESTART": "on-failure",
         "NEURONODE_HEALTH_INTERVAL": "5s", "NEURONODE_HEALTH_TIMEOUT": "60s", "NEURONODE_STOP_GRACE": "120s",
         "NEURONODE_BASE_IMAGE": "neuronode-base:bookworm"}


def test_compose_settings_from_the_environment_reach_every_node() -> None:
    """Rounds and inner steps come from the environment (defaults: run until stopped, H=50)."""
    for name, cfg in compose_configs().items():
        assert (cfg.rounds, cfg.inner_steps) == (0, 50), name
    for name, cfg in compose_configs(SHORT).items():
        assert (cfg.rounds, cfg.inner_steps) == (6, 5), name
    default, short = node_services(load_compose()), node_services(load_compose(SHORT))
    for name in default:
        assert default[name]["restart"] == "unless-stopped", name
        assert short[name]["restart"] == "on-failure", f"{name}: a node done with its rounds must stay down"
        assert default[name]["build"]["args"]["BASE_IMAGE"] == "python:3.11-slim", name
        assert short[name]["build"]["args"]["BASE_IMAGE"] == "neuronode-base:bookworm", name
        assert short[name]["healthcheck"] == {"interval": "5s", "timeout": "60s"}, name
        assert default[name]["stop_grace_period"] == "30s", name  # = the unit's TimeoutStopSec
    prometheus = load_compose(SHORT)["services"]["prometheus"]["build"]
    assert prometheus["args"]["BASE_IMAGE"] == "neuronode-base:bookworm", "one base for every image"


def test_compose_header_names_every_variable_it_reads() -> None:
    text = COMPOSE.read_text()
    header = text[:text.index("\nx-node")]
    used = set(re.findall(r"\$\{(\w+)", text))
    named = set(re.findall(r"NEURONODE_\w+", header))
    named |= {f"NEURONODE_PAGE_PORT_{x}" for x in "ABCD"} if "NEURONODE_PAGE_PORT_A..D" in header else set()
    assert used <= named, f"not described in the header of docker-compose.yml: {sorted(used - named)}"


def test_compose_check_script_matches_the_compose_file() -> None:
    """scripts/compose_check.sh runs the services and images docker-compose.yml names."""
    script = COMPOSE_CHECK.read_text()
    assert subprocess.run(["bash", "-n", str(COMPOSE_CHECK)], check=False).returncode == 0
    compose = load_compose()
    nodes = sorted(node_services(compose))
    assert re.search(r"^NODES=\((.*)\)$", script, re.M).group(1).split() == nodes  # type: ignore[union-attr]
    images = dict(re.findall(r"^(NODE_IMAGE|PROMETHEUS_IMAGE)=(\S+)", script, re.M))
    assert {compose["services"][n]["image"] for n in nodes} == {images["NODE_IMAGE"]}
    assert compose["services"]["prometheus"]["image"] == images["PROMETHEUS_IMAGE"]
    settings = re.search(r"^compose\(\) \{.*?^\}", script, re.M | re.S).group(0)  # type: ignore[union-attr]
    for name, value in SHORT.items():
        fixed = name not in ("NEURONODE_ROUNDS", "NEURONODE_INNER_STEPS", "NEURONODE_BASE_IMAGE")
        assert f"{name}={value if fixed else '$'}" in settings, name


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


def test_grafana_files_are_valid_provisioning_and_dashboard() -> None:
    """What Grafana checks when it loads them (the compose check cannot pull Grafana here; it
    runs every panel's query on its real Prometheus instead)."""
    for path in (GRAFANA / "provisioning").rglob("*.yml"):
        assert yaml.safe_load(path.read_text())["apiVersion"] == 1, path
    (source,) = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert (source["type"], source["access"]) == ("prometheus", "proxy")
    (provider,) = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "neuronode.yml").read_text())["providers"]
    assert provider["type"] == "file"
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    ids, cells = set(), set()
    for panel in dashboard["panels"]:
        assert panel["id"] not in ids, f"panel id {panel['id']} twice"
        ids.add(panel["id"])
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, panel["title"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            used = set(re.findall(r"\$(\w+)", target["expr"])) - {"__rate_interval", "__interval"}
            assert used <= variables, f"{panel['title']}: undefined variables {used - variables}"


# --- deploy/Dockerfile -------------------------------------------------------------------------

def test_dockerfile_image_shape() -> None:
    instructions = dockerfile_instructions()
    args = [rest for i, rest in instructions if i == "ARG"]
    assert "BASE_IMAGE=python:3.11-slim" in args
    assert any(a.startswith("TORCH_SPEC=") for a in args)
    assert instructions[-1][0] in ("CMD", "ENTRYPOINT")
    tail = final_stage()
    assert tail[0] == ("FROM", "${BASE_IMAGE}")
    assert ("USER", "neuronode") in tail
    assert ("VOLUME", "/data") in tail
    assert {"7420", "9400"} <= {p for i, r in tail if i == "EXPOSE" for p in r.split()}
    assert dockerfile_json("ENTRYPOINT") == ["neuronode"]
    assert dockerfile_json("CMD") == ["start", "--data-dir", "/data", "--listen", "0.0.0.0:7420", "--open"]
    cfg = parse_start(dockerfile_json("CMD")[1:])
    health = dockerfile_json("HEALTHCHECK")
    assert health == ["neuronode", "status", "--peer", f"127.0.0.1:{cfg.listen.rsplit(':', 1)[1]}", "--json"]


def test_dockerfile_builds_without_a_registry() -> None:
    """Every stage starts from BASE_IMAGE (no image hard-coded, no `# syntax=` frontend to pull)."""
    for path in (DOCKERFILE, PROMETHEUS_DOCKERFILE):
        assert not re.search(r"^#\s*syntax\s*=", path.read_text(), re.M | re.I), f"{path.name}: pulls a frontend"
        froms = [rest.split()[0] for i, rest in dockerfile_instructions(path) if i == "FROM"]
        assert froms and all(f == "${BASE_IMAGE}" for f in froms), f"{path.name}: FROM {froms}"
        assert "BASE_IMAGE=python:3.11-slim" in [r for i, r in dockerfile_instructions(path) if i == "ARG"]


def test_dockerfile_build_settings_stay_in_the_build_stage() -> None:
    """pip's settings and the CA bundle (a secret) reach the build stage only; the node image
    copies the finished virtual environment, so neither its layers nor its history hold them."""
    instructions = dockerfile_instructions()
    tail = final_stage()
    build = instructions[:len(instructions) - len(tail)]
    args = {r.split("=")[0] for i, r in build if i == "ARG"}
    assert {"TORCH_SPEC", "TORCH_INDEX_URL", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS",
            "PIP_TRUSTED_HOST"} <= args
    pip_runs = [r for i, r in build if i == "RUN" and "pip install" in r]
    assert pip_runs and all("--mount=type=secret,id=pip_cert" in r for r in pip_runs)
    assert not [r for i, r in tail if i == "ARG"], "the node stage takes no build argument"
    assert not [r for i, r in tail if "--mount" in r or "PIP_" in r or "pip " in r]
    copies = [r for i, r in tail if i == "COPY"]
    assert copies == ["--from=build /opt/neuronode /opt/neuronode"]


def test_prometheus_image_is_debians_package_on_the_node_base() -> None:
    instructions = dockerfile_instructions(PROMETHEUS_DOCKERFILE)
    run = " ".join(r for i, r in instructions if i == "RUN")
    assert "apt-get install" in run and "prometheus" in run
    entry = json.loads([r for i, r in instructions if i == "ENTRYPOINT"][-1])
    cmd = json.loads([r for i, r in instructions if i == "CMD"][-1])
    assert entry == ["/usr/bin/prometheus"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in cmd
    service = load_compose()["services"]["prometheus"]
    assert "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in service["volumes"]
    assert (ROOT / service["build"]["context"] / service["build"]["dockerfile"]) == PROMETHEUS_DOCKERFILE
    assert any(str(p).endswith(":9090") for p in service["ports"])


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


def shell_blocks(doc: str, section: str) -> list[str]:
    """The ```sh blocks of a section of docs/volunteer.md, continuation lines joined."""
    body = doc[doc.index(section):]
    body = body[:body.index("\n## ", 1)] if "\n## " in body[1:] else body
    return [line for block in re.findall(r"```sh\n(.*?)```", body, re.S)
            for line in block.replace("\\\n", " ").splitlines()]


def test_volunteer_compose_quick_start_is_what_the_check_runs() -> None:
    """Every `docker compose` subcommand of the quick start is one scripts/compose_check.sh runs,
    and every build argument the offline path passes is one the Dockerfile it builds declares."""
    doc = VOLUNTEER.read_text()
    checked = set(re.findall(r"\bcompose (up|stop|exec|logs|run|down|port|ps)\b", COMPOSE_CHECK.read_text()))
    lines = shell_blocks(doc, "## Quick start with docker compose")
    used = {m.group(1) for line in lines if (m := re.search(r"docker compose (?:--profile \w+ )?(\w+)", line))}
    assert used and used <= checked, f"not run by compose_check.sh: {used - checked}"
    for line in lines:
        for dockerfile in re.findall(r"docker build -f (\S+)", line):
            declared = {r.split("=")[0] for i, r in dockerfile_instructions(ROOT / dockerfile) if i == "ARG"}
            passed = set(re.findall(r"--build-arg (\w+)=", line))
            assert passed <= declared, f"{dockerfile} does not declare {passed - declared}"
            secrets = set(re.findall(r"--secret id=(\w+)", line))
            assert all(f"id={s}" in (ROOT / dockerfile).read_text() for s in secrets), secrets
    assert (ROOT / "scripts" / "debian_base.sh").exists() and "scripts/debian_base.sh" in doc


def test_volunteer_doc_names_real_commands() -> None:
    doc = VOLUNTEER.read_text()
    for needle in ("neuronode status --peer 127.0.0.1:7420", "docker compose up --build",
                   "docker compose logs -f node-a", "docker compose --profile monitoring up",
                   "http://localhost:3000", "systemctl stop neuronode", "--advertise",
                   "payload_bytes_per_param", "wire_bytes_per_param"):
        assert needle in doc, needle
