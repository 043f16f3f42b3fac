"""Config precedence, validation and the CLI's one-line errors (exit status 2)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import neuronode_cmd, run_neuronode

from neuronode.cli import main
from neuronode.config import NodeConfig, flag_name
from neuronode.config_sources import build_config
from neuronode.errors import ConfigError


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(list(args))
    return code, capsys.readouterr().err


BAD_FLAGS = [
    (["--inner-steps", "-3"], "--inner-steps"),
    (["--inner-steps", "0"], "--inner-steps"),
    (["--rounds", "-1"], "--rounds"),
    (["--inner-lr", "0"], "--inner-lr"),
    (["--inner-lr", "-1e-3"], "--inner-lr"),
    (["--outer-lr", "0"], "--outer-lr"),
    (["--listen", "localhost"], "--listen"),
    (["--listen", "127.0.0.1:70000"], "--listen"),
    (["--advertise", "a b:1"], "--advertise"),
    (["--peers", "127.0.0.1:1,nope"], "--peers"),
    (["--device", "tpu"], "--device"),
    (["--codec", "fp8"], "--codec"),
    (["--inner-steps", "ten"], "--inner-steps"),
    (["--no-such-flag"], "unrecognized"),
    (["--d-model", "100", "--n-heads", "3"], "--d-model"),
    (["--task-option", "novalue"], "--task-option"),
    (["--local-workers", "2"], "--max-local-workers 1"),  # the swarm's setting admits one process
    (["--local-workers", "0"], "--local-workers"),
    (["--max-restarts", "1"], "--max-restarts"),  # restarts are for members of several processes
    (["--sparse-bits", "3"], "--sparse-bits"),
    (["--sparse-k", "0"], "--sparse-k"),
    (["--sparse-k", "2048"], "--sparse-k"),
    (["--sparse-block", "32"], "--sparse-block"),
    (["--sparse-k", "128", "--sparse-block", "64"], "--sparse-k 128 must be at most --sparse-block 64"),
    (["--sparse-decay", "0"], "--sparse-decay"),
    (["--sparse-decay", "1.5"], "--sparse-decay"),
    (["--codec", "sparse", "--averaging", "reduce-scatter"], "union of the members' kept entries"),
]


@pytest.mark.parametrize(("argv", "names"), BAD_FLAGS)
def test_bad_flag_exits_2_with_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], names: str) -> None:
    code, err = run_cli(capsys, "start", *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert names in lines[0]
    assert "Traceback" not in err


def test_unknown_task_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, err = run_cli(capsys, "start", "--task", "no_such_module_xyz:make", "--data-dir", str(tmp_path))
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "--task" in err


def test_unknown_builtin_task_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, err = run_cli(capsys, "start", "--task", "imagenet", "--data-dir", str(tmp_path))
    assert code == 2 and "--task" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("environ", "flags", "needle"), [
    ({"WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3"}, ["--max-local-workers", "2"], "--nproc-per-node 3"),
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, ["--max-local-workers", "4", "--local-workers", "4"], "torchrun started 2"),
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, ["--max-local-workers", "4"], "--nnodes 1"),
])
def test_a_torchrun_member_the_swarm_does_not_admit_exits_2(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        environ: dict[str, str], flags: list[str], needle: str) -> None:
    """torchrun's processes are one member: too many for --max-local-workers, another count than
    --local-workers, or several machines, each one line before any process group is made."""
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", **environ}.items():
        monkeypatch.setenv(key, value)
    code, err = run_cli(capsys, "start", "--data-dir", str(tmp_path), *flags)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_unwritable_data_dir_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    code, err = run_cli(capsys, "start", "--data-dir", str(blocker / "sub"))
    assert code == 2
    assert "--data-dir" in err and len(err.strip().splitlines()) == 1


def test_bad_env_and_config_file(capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEURONODE_INNER_STEPS", "-5")
    code, err = run_cli(capsys, "start")
    assert code == 2 and "--inner-steps" in err
    monkeypatch.delenv("NEURONODE_INNER_STEPS")
    bad = tmp_path / "node.toml"
    bad.write_text("inner_stepz = 3\n")
    code, err = run_cli(capsys, "start", "--config", str(bad))
    assert code == 2 and "unknown key" in err
    code, err = run_cli(capsys, "start", "--config", str(tmp_path / "missing.toml"))
    assert code == 2 and "does not exist" in err
    bad.write_text("inner_steps = [\n")
    code, err = run_cli(capsys, "start", "--config", str(bad))
    assert code == 2 and len(err.strip().splitlines()) == 1


def test_precedence_flag_env_file_default(tmp_path: Path) -> None:
    toml = tmp_path / "node.toml"
    toml.write_text('inner-steps = 7\nouter_lr = 0.5\nswarm-id = "from-file"\npeers = ["127.0.0.1:9"]\n')
    env = {"NEURONODE_OUTER_LR": "0.6", "NEURONODE_SWARM_ID": "from-env"}
    cfg = build_config({"swarm_id": "from-flag"}, config_file=str(toml), environ=env)
    assert cfg.swarm_id == "from-flag"  # flag beats env and file
    assert cfg.outer_lr == 0.6  # env beats file
    assert cfg.inner_steps == 7  # file beats default
    assert cfg.peers == ("127.0.0.1:9",)
    assert cfg.rounds == NodeConfig().rounds  # default
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rounds = 3  # type: ignore[misc]


def test_config_validates_directly() -> None:
    with pytest.raises(ConfigError, match="--sync-timeout"):
        NodeConfig(sync_timeout=0)
    assert NodeConfig(listen="0.0.0.0:7000").advertise_address == ""  # learned from peers once running
    assert NodeConfig(listen="[::1]:7000").advertise_address == "[::1]:7000"
    assert NodeConfig(advertise="example.org:1").advertise_address == "example.org:1"


def test_help_lists_every_flag_with_default(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["start", "--help"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 0
        out = capsys.readouterr().out
        for f in dataclasses.fields(NodeConfig):
            assert flag_name(f.name) in out, f"{flag_name(f.name)} missing from {argv}"
        assert out.count("(default:") >= len(dataclasses.fields(NodeConfig))


def test_console_script_entry_point_one_line() -> None:
    """The real executable path (python -m) gives one line and exit 2, no traceback."""
    out = run_neuronode("start", "--inner-steps", "-1")
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr


def test_status_errors_are_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, err = run_cli(capsys, "status", "--data-dir", str(tmp_path / "nope"))
    assert code == 1 and len(err.strip().splitlines()) == 1
    code, err = run_cli(capsys, "status", "--peer", "bad-address")
    assert code == 2 and "--peer" in err


def test_status_into_a_closed_pipe_exits_quietly(tmp_path: Path) -> None:
    """`neuronode status | head`: the reader is gone before we write; no traceback."""
    (tmp_path / "node_id").write_text("n1\n")
    read, write = os.pipe()
    os.close(read)
    try:
        out = subprocess.run(neuronode_cmd("status", "--data-dir", str(tmp_path), "--json"), stdout=write,
                             stderr=subprocess.PIPE, text=True, timeout=60, check=False)
    finally:
        os.close(write)
    assert out.returncode == 0 and out.stderr == "", out.stderr


def test_status_of_a_data_dir_reads_the_checkpoint_without_torch(tmp_path: Path) -> None:
    """Scripts poll `status --data-dir`: it reads the checkpoint's meta only, without importing
    torch (seconds per call on a busy machine)."""
    from neuronode.node import checkpoint

    checkpoint.save(tmp_path, 3, {"node_id": "n1", "round": 3}, {"w": [1.0]})
    code = ("import sys\nfrom neuronode.cli import main\n"
            f"assert main(['status', '--data-dir', {str(tmp_path)!r}, '--json']) == 0\n"
            "assert 'torch' not in sys.modules, 'status imported torch'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert '"round": 3' in out.stdout


def test_the_outer_step_defaults_to_the_codecs() -> None:
    """Nesterov (0.7, 0.9) for the dense codecs, plain SGD with a larger step for sparse (its
    error feedback acts as momentum: docs/benchmarks.md); a given value always wins."""
    assert NodeConfig().outer() == (0.7, 0.9)
    assert NodeConfig(codec="int4").outer() == (0.7, 0.9)
    assert NodeConfig(codec="sparse").outer() == (3.0, 0.0)
    assert NodeConfig(codec="sparse", outer_lr=0.5).outer() == (0.5, 0.0)
    assert NodeConfig(codec="sparse", outer_momentum=0.9).outer() == (3.0, 0.9)
    assert NodeConfig(outer_lr=1.0, outer_momentum=0.0).outer() == (1.0, 0.0)


def test_relay_cap_defaults_to_half_the_upload_cap() -> None:
    assert NodeConfig(max_upload_mbps=20).relay_mbps() == 10
    assert NodeConfig().relay_mbps() == 0  # no upload cap: no relay cap of its own
    assert NodeConfig(max_upload_mbps=20, max_relay_mbps=5).relay_mbps() == 5
    assert NodeConfig(max_upload_mbps=20, max_relay_mbps=0).relay_mbps() == 0
    with pytest.raises(ConfigError, match="--max-relay-mbps"):
        NodeConfig(max_relay_mbps=-2)
