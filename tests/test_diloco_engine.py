"""The DiLoCo engine, pinned against torch's own optimisers."""

from __future__ import annotations

import ast
import io
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import neuronode.diloco
from neuronode.diloco import DiLoCo, InnerConfig, OuterConfig, StateMismatchError

Batch = tuple[Tensor, Tensor]
INNER = InnerConfig(lr=1e-2, warmup_steps=3, total_steps=40, min_lr_ratio=0.1, grad_clip=1.0)
STEPS_PER_ROUND = 3


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # The test machine is shared; one thread also keeps float reductions in a fixed order.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def make_model(seed: int = 0, *, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 4))


def make_engine(seed: int = 0, outer: OuterConfig | None = None, **model_kw: float) -> DiLoCo:
    return DiLoCo(make_model(seed, **model_kw), inner=INNER, outer=outer or OuterConfig())


def batches(seed: int) -> Iterator[Batch]:
    gen = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randn(6, 8, generator=gen), torch.randint(0, 4, (6,), generator=gen)


def loss_fn(model: nn.Module, batch: Batch) -> Tensor:
    inputs, targets = batch
    return F.cross_entropy(model(inputs), targets)


def flat_model(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def run_inner(engine: DiLoCo, data: Iterator[Batch], steps: int = STEPS_PER_ROUND) -> list[float]:
    return [engine.inner_step([next(data)], loss_fn) for _ in range(steps)]


# ------------------------------------------------------------------ outer step vs torch


def test_outer_step_bit_equal_to_torch_sgd_nesterov() -> None:
    engine = make_engine()
    reference = [g.clone() for g in engine.global_params]
    reference_sgd = torch.optim.SGD(reference, lr=0.7, momentum=0.9, nesterov=True)
    data = batches(1)
    for _ in range(5):
        start = engine.flat_global()
        run_inner(engine, data)
        delta = engine.pseudo_gradient()
        assert torch.equal(delta, start - flat_model(engine.model))  # Δ = start − local
        for p, part in zip(
            reference, torch.split(delta, [p.numel() for p in reference]), strict=True
        ):
            p.grad = part.reshape(p.shape).clone()
        reference_sgd.step()
        engine.outer_step(delta)
        for g, p in zip(engine.global_params, reference, strict=True):
            assert torch.equal(g, p)
        assert torch.equal(flat_model(engine.model), engine.flat_global())
    assert engine.round == 5


def test_outer_step_starts_from_round_start_not_local_weights() -> None:
    engine = make_engine()
    start = [g.clone() for g in engine.global_params]
    run_inner(engine, batches(2))
    local = flat_model(engine.model)
    # A "peer average" that differs from this replica's own Δ.
    avg = engine.pseudo_gradient() * 0.5 + 1e-3
    fresh = torch.optim.SGD(start, lr=0.7, momentum=0.9, nesterov=True)
    for p, part in zip(start, torch.split(avg, [p.numel() for p in start]), strict=True):
        p.grad = part.reshape(p.shape).clone()
    fresh.step()
    engine.outer_step(avg)
    expected = torch.cat([p.reshape(-1) for p in start])
    assert torch.equal(engine.flat_global(), expected)
    assert torch.equal(flat_model(engine.model), expected)
    assert not torch.allclose(expected, local - 0.7 * 1.9 * avg)  # what "from local" would give


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_look_ahead_starts_where_the_outer_step_would_land(momentum: float) -> None:
    """--overlap's lookahead: working weights go where torch's SGD would move θ_g for this Δ;
    θ_g and the momentum stay; Δ is measured from the shifted start; outer_step clears it."""
    engine = make_engine(outer=OuterConfig(momentum=momentum))
    data = batches(3)
    run_inner(engine, data)
    engine.outer_step(engine.pseudo_gradient())  # a momentum buffer to take into account
    run_inner(engine, data)
    delta = engine.pseudo_gradient()
    global_before, momentum_before = engine.flat_global(), engine.flat_momentum()
    twin = make_engine(outer=OuterConfig(momentum=momentum))
    twin.load_flat_global(global_before)
    twin.load_flat_momentum(momentum_before)
    twin.outer_step(delta)  # what the step would do if the average equalled our Δ
    engine.look_ahead(delta)
    assert torch.equal(engine.flat_global(), global_before)
    assert momentum_before is None or torch.equal(engine.flat_momentum(), momentum_before)
    assert torch.allclose(flat_model(engine.model), twin.flat_global(), rtol=0, atol=1e-6)
    assert not torch.allclose(flat_model(engine.model), global_before)
    assert engine.pseudo_gradient().abs().max() < 1e-6  # no inner step yet: nothing learned
    start = flat_model(engine.model)
    run_inner(engine, data)
    assert torch.allclose(engine.pseudo_gradient(), start - flat_model(engine.model), atol=1e-6)
    state = engine.state_dict()  # a restart mid-round keeps the shifted start
    restored = make_engine(outer=OuterConfig(momentum=momentum))
    restored.load_state_dict(state)
    assert torch.equal(restored.pseudo_gradient(), engine.pseudo_gradient())
    engine.outer_step(engine.pseudo_gradient())
    assert engine.start_offset is None
    assert torch.equal(flat_model(engine.model), engine.flat_global())


def test_outer_step_does_not_modify_caller_vector_and_checks_length() -> None:
    engine = make_engine()
    run_inner(engine, batches(3), steps=1)
    delta = engine.pseudo_gradient()
    kept = delta.clone()
    engine.outer_step(delta)
    engine.outer_step(delta)  # second step: momentum buffer exists, Nesterov add happens
    assert torch.equal(delta, kept)
    assert all(g.grad is None for g in engine.global_params)
    with pytest.raises(StateMismatchError):
        engine.outer_step(delta[:-1])
    with pytest.raises(StateMismatchError):
        engine.outer_step(delta.double())


def test_lr1_no_momentum_equals_plain_adamw_training() -> None:
    outer = OuterConfig(lr=1.0, momentum=0.0)  # nesterov=True default is dropped, not an error
    assert not outer.effective_nesterov
    engine = make_engine(outer=outer)
    plain = make_model(0)
    adamw = torch.optim.AdamW(
        plain.parameters(), lr=INNER.lr, betas=INNER.betas, weight_decay=INNER.weight_decay
    )
    data_engine, data_plain = batches(4), batches(4)
    step = 0
    for _ in range(4):
        run_inner(engine, data_engine)
        for _ in range(STEPS_PER_ROUND):
            adamw.zero_grad()
            loss_fn(plain, next(data_plain)).backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), INNER.grad_clip)
            for group in adamw.param_groups:
                group["lr"] = INNER.lr_at(step)
            adamw.step()
            step += 1
        engine.outer_step(engine.pseudo_gradient())
        torch.testing.assert_close(flat_model(engine.model), flat_model(plain), rtol=0, atol=1e-6)


# ------------------------------------------------------------------------ inner step


def test_inner_step_counters_schedule_and_samples() -> None:
    engine = make_engine()
    data = batches(5)
    engine.inner_step([next(data), next(data)], loss_fn)
    engine.inner_step([next(data)], loss_fn, samples=48)
    assert engine.inner_optimizer.param_groups[0]["lr"] == INNER.lr_at(1)
    assert (engine.inner_steps_total, engine.steps_this_round, engine.samples_this_round) == (
        2,
        2,
        50,
    )
    engine.outer_step(engine.pseudo_gradient())
    assert (engine.round, engine.steps_this_round, engine.samples_this_round) == (1, 0, 0)
    assert engine.inner_steps_total == 2  # the schedule keeps counting across rounds
    with pytest.raises(ValueError):
        engine.inner_step([], loss_fn)


def test_micro_batches_average_gradients() -> None:
    inputs, targets = next(batches(6))
    whole, split = make_engine(), make_engine()
    loss_whole = whole.inner_step([(inputs, targets)], loss_fn)
    loss_split = split.inner_step([(inputs[:3], targets[:3]), (inputs[3:], targets[3:])], loss_fn)
    assert loss_split == pytest.approx(loss_whole, rel=1e-6)
    torch.testing.assert_close(flat_model(split.model), flat_model(whole.model))


# ---------------------------------------------------------------- state and digests


def _noisy_round(engine: DiLoCo, data: Iterator[Batch]) -> list[float]:
    """A round whose data also draws from torch's, python's and numpy's global RNGs."""
    losses = []
    for _ in range(STEPS_PER_ROUND):
        inputs, targets = next(data)
        inputs = inputs + torch.randn_like(inputs) * random.random() * float(np.random.rand())
        losses.append(engine.inner_step([(inputs, targets)], loss_fn))
    engine.outer_step(engine.pseudo_gradient())
    return losses


def test_state_dict_round_trip_continues_bit_identically() -> None:
    torch.manual_seed(11), random.seed(11), np.random.seed(11)
    engine = make_engine(dropout=0.2)  # dropout makes the model itself consume torch RNG
    data = batches(7)
    _noisy_round(engine, data)
    _noisy_round(engine, data)
    engine.inner_step([next(data)], loss_fn)  # stop mid-round: steps_this_round matters too
    buffer = io.BytesIO()
    torch.save(engine.state_dict(), buffer)
    losses_a = _noisy_round(engine, data)
    digest_a = engine.param_digest()

    buffer.seek(0)
    resumed = make_engine(seed=99, dropout=0.2)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert (resumed.round, resumed.steps_this_round, resumed.inner_steps_total) == (2, 1, 7)
    data_b = batches(7)  # the data stream is the caller's to resume: skip what was used
    for _ in range(2 * STEPS_PER_ROUND + 1):
        next(data_b)
    losses_b = _noisy_round(resumed, data_b)
    assert losses_a == losses_b
    assert resumed.param_digest() == digest_a
    assert torch.equal(flat_model(resumed.model), flat_model(engine.model))


def test_load_state_dict_rejects_other_model_and_version() -> None:
    state = make_engine().state_dict()
    other = DiLoCo(nn.Linear(3, 2), inner=INNER, outer=OuterConfig())
    with pytest.raises(StateMismatchError, match="different model"):
        other.load_state_dict(state)
    with pytest.raises(StateMismatchError, match="version"):
        make_engine().load_state_dict({**state, "version": 999})


def test_load_state_dict_takes_hyperparameters_from_config() -> None:
    state = make_engine().state_dict()
    engine = make_engine(outer=OuterConfig(lr=0.3, momentum=0.5))
    engine.load_state_dict(state)
    group = engine.outer_optimizer.param_groups[0]
    assert (group["lr"], group["momentum"]) == (0.3, 0.5)


def test_param_digest_and_manifest() -> None:
    a, b = make_engine(seed=0), make_engine(seed=0)
    assert a.param_digest() == b.param_digest()
    assert a.param_digest() != make_engine(seed=1).param_digest()
    run_inner(a, batches(8), steps=1)
    assert a.param_digest() == b.param_digest()  # digest covers θ_g, not working weights
    a.outer_step(a.pseudo_gradient())
    assert a.param_digest() != b.param_digest()
    assert a.manifest() == [
        ("0.weight", (16, 8), "float32"),
        ("0.bias", (16,), "float32"),
        ("3.weight", (4, 16), "float32"),
        ("3.bias", (4,), "float32"),
    ]
    assert a.manifest_hash() == b.manifest_hash()
    assert (
        a.manifest_hash()
        != DiLoCo(nn.Linear(8, 4), inner=INNER, outer=OuterConfig()).manifest_hash()
    )


def test_state_transfer_via_flat_vectors_keeps_replicas_in_step() -> None:
    veteran, newcomer = make_engine(seed=0), make_engine(seed=5)
    data = batches(9)
    for _ in range(2):
        run_inner(veteran, data)
        veteran.outer_step(veteran.pseudo_gradient())
    assert newcomer.flat_momentum() is None
    newcomer.load_flat_global(veteran.flat_global())
    newcomer.load_flat_momentum(veteran.flat_momentum())
    assert newcomer.param_digest() == veteran.param_digest()
    assert torch.equal(flat_model(newcomer.model), veteran.flat_global())
    avg = torch.randn(veteran.num_elements) * 1e-2
    veteran.outer_step(avg)
    newcomer.outer_step(avg)
    assert newcomer.param_digest() == veteran.param_digest()
    newcomer.load_flat_momentum(None)
    assert newcomer.flat_momentum() is None
    with pytest.raises(StateMismatchError):
        newcomer.load_flat_global(torch.zeros(3))


# ---------------------------------------------------------------------- configs


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lr": 0.0},
        {"lr": -1.0},
        {"weight_decay": -0.1},
        {"betas": (0.9, 1.0)},
        {"total_steps": 0},
        {"warmup_steps": -1},
        {"warmup_steps": 41},
        {"min_lr_ratio": 1.1},
        {"grad_clip": -1.0},
        {"grad_accum": 0},
    ],
)
def test_inner_config_rejects_bad_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        InnerConfig(**{"total_steps": 40, **kwargs})  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs", [{"lr": 0.0}, {"momentum": -0.1}, {"momentum": 1.0}])
def test_outer_config_rejects_bad_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        OuterConfig(**kwargs)  # type: ignore[arg-type]


def test_model_without_parameters_is_rejected() -> None:
    with pytest.raises(ValueError):
        DiLoCo(nn.ReLU(), inner=INNER, outer=OuterConfig())


# ------------------------------------------------------------------- boundaries


def test_diloco_package_imports_nothing_networked() -> None:
    forbidden = ("asyncio", "grpc", "socket", "neuronode.swarm", "neuronode.node")
    package = Path(neuronode.diloco.__file__).parent
    for source in package.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            bad = [n for n in names if n.split(".")[0] in forbidden or n.startswith(forbidden)]
            assert not bad, f"{source.name} imports {bad}"


# ------------------------------------------------------------- GPU (where present)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("outer_device", ["cpu", "cuda"])
def test_cuda_model_matches_torch_sgd_and_round_trips(outer_device: str) -> None:
    engine = DiLoCo(
        make_model(0).cuda(), inner=INNER, outer=OuterConfig(), outer_device=outer_device
    )
    reference = [g.clone() for g in engine.global_params]
    reference_sgd = torch.optim.SGD(reference, lr=0.7, momentum=0.9, nesterov=True)
    data = batches(1)
    for _ in range(3):
        for _ in range(STEPS_PER_ROUND):
            inputs, targets = next(data)
            engine.inner_step([(inputs.cuda(), targets.cuda())], loss_fn)
        delta = engine.pseudo_gradient()
        assert delta.device.type == "cpu"
        parts = torch.split(delta, [p.numel() for p in reference])
        for p, part in zip(reference, parts, strict=True):
            p.grad = part.reshape(p.shape).to(outer_device, copy=True)
        reference_sgd.step()
        given = delta.to(outer_device)  # on CUDA this aliases what SGD's foreach path touches
        kept = given.clone()
        engine.outer_step(given)
        assert torch.equal(given, kept)
        for g, p in zip(engine.global_params, reference, strict=True):
            assert torch.equal(g, p)
        assert torch.equal(flat_model(engine.model).cpu(), engine.flat_global())

    buffer = io.BytesIO()
    torch.save(engine.state_dict(), buffer)
    buffer.seek(0)
    resumed = DiLoCo(
        make_model(5).cuda(), inner=INNER, outer=OuterConfig(), outer_device=outer_device
    )
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert resumed.param_digest() == engine.param_digest()
    inputs, targets = next(data)
    batch = (inputs.cuda(), targets.cuda())
    assert resumed.inner_step([batch], loss_fn) == engine.inner_step([batch], loss_fn)
    assert torch.equal(flat_model(resumed.model), flat_model(engine.model))
