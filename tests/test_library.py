"""neuronode.Swarm in a process of its own: a model and an optimizer of one's own, their
checkpoints in the daemon's files, and bad use ending in an error that says what to do (never a
hang). Members run in this process, each node on its own thread; small models, few steps."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import neuronode
from neuronode.diloco import StateMismatchError
from neuronode.errors import ConfigError
from neuronode.library import SwarmError
from neuronode.node import checkpoint

QUIET = {"listen": "127.0.0.1:0", "heartbeat_s": 0.2, "sync_timeout": 20.0}


def net(seed: int = 0, hidden: int = 16) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def batches(seed: int) -> Any:
    gen = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(8, 4, generator=gen)
        yield x, x.sum(1, keepdim=True)


def train(swarm: neuronode.Swarm, model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    data = batches(seed)
    for _ in range(steps):
        x, y = next(data)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        swarm.step(samples=8, loss=loss.item())
        if swarm.finished:
            break


@pytest.mark.timeout(60)
def test_a_member_alone_trains_rounds_and_its_data_dir_works_for_status_export_and_resume(tmp_path: Path) -> None:
    """Rounds after inner_steps steps; the checkpoint holds the model, the inner optimizer's
    state, the outer momentum and the error feedback; `neuronode status --data-dir` and
    `neuronode export` read it; a new Swarm on the data dir resumes all of it."""
    from neuronode.node.export import export
    from neuronode.node.status import from_data_dir

    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    options = dict(QUIET, data_dir=str(tmp_path / "run"), inner_steps=4, codec="sparse", sparse_block=64,
                   sparse_k=4, outer_momentum=0.5)
    with neuronode.Swarm(model, optimizer, rounds=3, **options) as swarm:
        assert swarm.round == 0
        train(swarm, model, optimizer, steps=100)
        assert swarm.finished and swarm.round == 3
    status = from_data_dir(str(tmp_path / "run"))
    assert status["round"] == 3 and status["param_digest"] == swarm.param_digest and status["task"] == "library"
    loaded = checkpoint.load_latest(tmp_path / "run")
    assert loaded is not None
    engine = loaded.state["engine"]
    assert engine["inner_optimizer"]["state"][0]["exp_avg"].abs().sum() > 0  # AdamW's moments
    assert any(s.get("momentum_buffer") is not None for s in engine["outer_optimizer"]["state"].values())
    assert loaded.state["feedback"]["residual"].abs().sum() > 0  # the sparse codec's error feedback
    from safetensors.torch import load_file

    result = export(str(tmp_path / "run"), str(tmp_path / "out"), say=lambda _: None)
    assert result["param_digest"] == swarm.param_digest
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(exported) == {name for name, _ in model.named_parameters()}
    for name, param in model.named_parameters():  # after the last outer step the model holds θ_g
        assert torch.equal(exported[name], param.detach())

    fresh, fresh_optimizer = net(), None
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    again = neuronode.Swarm(fresh, fresh_optimizer, rounds=4, **options)
    try:
        assert again.round == 3 and again.param_digest == swarm.param_digest
        assert torch.equal(fresh_optimizer.state_dict()["state"][0]["exp_avg"],
                           engine["inner_optimizer"]["state"][0]["exp_avg"])
        train(again, fresh, fresh_optimizer, steps=100)
        assert again.round == 4
    finally:
        again.close()


@pytest.mark.timeout(60)
def test_overlap_runs_the_exchange_behind_the_next_round_and_ends_on_the_global_parameters(tmp_path: Path) -> None:
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    swarm = neuronode.Swarm(model, optimizer, data_dir=str(tmp_path), inner_steps=3, rounds=3, overlap=True, **QUIET)
    train(swarm, model, optimizer, steps=100)
    swarm.close()
    assert swarm.status()["round"] == 3 and swarm.status()["phase"] == "stopped"
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    loaded = checkpoint.load_latest(tmp_path)
    assert loaded is not None
    assert torch.equal(flat, torch.cat([g.reshape(-1) for g in loaded.state["engine"]["global_params"]]))


@pytest.mark.timeout(60)
def test_step_after_close_is_an_error(tmp_path: Path) -> None:
    model = net()
    optimizer = torch.optim.AdamW(model.parameters())
    swarm = neuronode.Swarm(model, optimizer, data_dir=str(tmp_path), inner_steps=5, **QUIET)
    train(swarm, model, optimizer, steps=2)
    swarm.close()
    swarm.close()  # a second close does nothing
    with pytest.raises(SwarmError, match=r"step\(\) after close\(\)"):
        swarm.step()


@pytest.mark.timeout(60)
def test_an_optimizer_over_other_parameters_is_refused(tmp_path: Path) -> None:
    model, other = net(), net()
    with pytest.raises(StateMismatchError, match="not parameters of the model"):
        neuronode.Swarm(model, torch.optim.AdamW(other.parameters()), data_dir=str(tmp_path), **QUIET)


@pytest.mark.parametrize(("options", "message"), [
    ({"inner_step": 5}, "unknown keyword inner_step; did you mean inner_steps?"),
    ({"inner_lr": 1e-3}, "inner_lr sets neuronode start's own model or trainer"),
    ({"inner_steps": 0}, "--inner-steps must be a positive integer (got 0)"),
    ({"peers": ["nonsense"]}, "--peers: 'nonsense' is not HOST:PORT"),
    ({"codec": "sparse", "averaging": "reduce-scatter"}, "--codec sparse needs --averaging all-to-all"),
])
def test_settings_are_checked_as_the_flags_are(tmp_path: Path, options: dict[str, Any], message: str) -> None:
    model = net()
    with pytest.raises(ConfigError) as caught:
        neuronode.Swarm(model, torch.optim.AdamW(model.parameters()), data_dir=str(tmp_path), **options)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def refused_joiner(tmp_path: Path, model: nn.Module) -> str:
    """Start a member, then `model`'s member with it as bootstrap peer: the second one's error."""
    first_model = net()
    first = neuronode.Swarm(first_model, torch.optim.AdamW(first_model.parameters()), data_dir=str(tmp_path / "a"),
                            **QUIET)
    try:
        with pytest.raises(ConfigError) as caught:
            neuronode.Swarm(model, torch.optim.AdamW(model.parameters()), data_dir=str(tmp_path / "b"),
                            peers=[first.address], **QUIET)
    finally:
        first.close()
    return str(caught.value)


@pytest.mark.timeout(60)
def test_a_model_with_other_shapes_is_refused_saying_so(tmp_path: Path) -> None:
    message = refused_joiner(tmp_path, net(hidden=8))
    assert "every bootstrap peer refused this node" in message
    assert "every member of a swarm needs the same parameter shapes" in message


@pytest.mark.timeout(60)
def test_a_member_started_from_other_initial_weights_is_refused_saying_how_to_fix_it(tmp_path: Path) -> None:
    message = refused_joiner(tmp_path, net(seed=1))
    assert "every member of a swarm needs the same initial weights" in message
    assert "from the same seed or the same saved weights" in message


@pytest.mark.timeout(60)
def test_the_node_runs_its_model_work_on_the_loops_thread(tmp_path: Path) -> None:
    """The pseudo-gradient, the outer step and checkpoints of the model run on the thread that
    steps it, never beside it."""
    model = net()
    optimizer = torch.optim.AdamW(model.parameters())
    seen: set[str] = set()
    real = optimizer.state_dict

    def state_dict() -> dict[str, Any]:
        seen.add(threading.current_thread().name)
        return real()

    optimizer.state_dict = state_dict  # type: ignore[method-assign]
    swarm = neuronode.Swarm(model, optimizer, data_dir=str(tmp_path), inner_steps=2, rounds=2, **QUIET)
    train(swarm, model, optimizer, steps=10)
    swarm.close()
    assert seen == {threading.current_thread().name}


@pytest.mark.timeout(60)
def test_the_status_page_and_metrics_serve_a_library_member(tmp_path: Path) -> None:
    import json
    import urllib.request

    from helpers import free_port

    model = net()
    optimizer = torch.optim.AdamW(model.parameters())
    port = free_port()
    with neuronode.Swarm(model, optimizer, data_dir=str(tmp_path), inner_steps=2, metrics_port=port, **QUIET) as swarm:
        train(swarm, model, optimizer, steps=4)
        page = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=10).read())
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert page["round"] == 2 and page["param_digest"] == swarm.param_digest
    assert "neuronode_rounds_total 2.0" in metrics and "neuronode_inner_steps_total 4.0" in metrics, metrics[:2000]
