"""Checkpoint files without pickle: JSON rules, markers, torn and tampered directories, and the
plain-optimizer state round trip (the ZeRO paths run in the resume tests' child processes)."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from pipeline.training.checkpoint import (
    MARKER,
    Checkpoint,
    checkpoint_name,
    complete_checkpoints,
    from_json_value,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
    to_json_value,
)
from pipeline.training.engine_state import (
    EngineState,
    UnsupportedStateError,
    capture,
    restore,
)


def test_json_round_trips_tuples_and_non_finite_floats_and_refuses_objects():
    value = {"betas": (0.9, 0.999), "lr": 1e-4, "x": [None, True, "s", float("inf")]}
    back = from_json_value(json.loads(json.dumps(to_json_value(value))))
    assert back == value and isinstance(back["betas"], tuple)
    with pytest.raises(UnsupportedStateError, match=r"state\.lr: a Tensor"):
        to_json_value({"lr": torch.tensor(1.0)})
    with pytest.raises(UnsupportedStateError, match="object"):
        to_json_value([object()])


def toy_state(step: int) -> Checkpoint:
    g = torch.Generator().manual_seed(step)
    params = {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)}
    moments = {"exp_avg": {k: v * 0.1 for k, v in params.items()},
               "exp_avg_sq": {k: v * v for k, v in params.items()}}
    tensors, python_state = rng_state()
    return Checkpoint(step=step, rng=tensors, python_rng=python_state,
                      engine=EngineState(params, moments, step, [{"lr": 0.1,
                                                                  "betas": (0.9, 0.99)}]),
                      extra={"position": {"epoch": 0, "micro_batch": step}})


def save(root, step, keep=5):
    return save_checkpoint(root, toy_state(step), rank=0, barrier=lambda: None, keep=keep)


def test_save_then_load_round_trips_everything(tmp_path):
    path = save(tmp_path, 4)
    assert (path / MARKER).is_file() and path.name == checkpoint_name(4)
    got = load_checkpoint(path, rank=0)
    want = toy_state(4)
    assert got.step == 4 and got.extra == want.extra
    assert got.engine.param_groups == [{"lr": 0.1, "betas": (0.9, 0.99)}]
    for k in ("w", "b"):
        assert torch.equal(got.engine.params[k], want.engine.params[k])
        assert torch.equal(got.engine.moments["exp_avg_sq"][k],
                           want.engine.moments["exp_avg_sq"][k])


def test_rng_states_survive_json_and_safetensors(tmp_path):
    random.seed(1)
    torch.manual_seed(1)
    tensors, python_state = rng_state()
    expected = (random.random(), torch.rand(3))
    random.random(), torch.rand(3)  # move on
    path = save_checkpoint(tmp_path, Checkpoint(step=1, engine=toy_state(1).engine, extra={},
                                                 rng=tensors, python_rng=python_state),
                           rank=0, barrier=lambda: None)
    got = load_checkpoint(path, rank=0)
    set_rng_state(got.rng, got.python_rng)
    again = (random.random(), torch.rand(3))
    assert again[0] == expected[0] and torch.equal(again[1], expected[1])
    with pytest.raises(ValueError, match="no RNG state for rank 1"):
        load_checkpoint(path, rank=1)


def test_torn_and_tampered_checkpoints_are_skipped_and_old_ones_pruned(tmp_path):
    for step in (2, 4, 6, 8):
        save(tmp_path, step, keep=3)
    assert [p.name for p in complete_checkpoints(tmp_path)] == [
        checkpoint_name(s) for s in (4, 6, 8)]
    (tmp_path / checkpoint_name(8) / MARKER).unlink()  # killed before the marker
    (tmp_path / f".{checkpoint_name(10)}.tmp").mkdir()  # killed while writing
    assert latest_checkpoint(tmp_path).name == checkpoint_name(6)
    victim = tmp_path / checkpoint_name(6) / "model.safetensors"
    victim.write_bytes(victim.read_bytes()[:-1] + b"\x00")  # one byte changed after marking
    assert latest_checkpoint(tmp_path).name == checkpoint_name(4)
    save(tmp_path, 8)  # the torn step-8 directory is replaced, not trusted
    assert latest_checkpoint(tmp_path).name == checkpoint_name(8)


def trained(seed: int, steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.9))
    for i in range(steps):
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(i))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        opt.param_groups[0]["lr"] *= 0.9  # a scheduler moved it
    return model, opt


def test_plain_optimizer_state_round_trips_into_a_fresh_model():
    model, opt = trained(0, 5)
    state = capture(SimpleNamespace(optimizer=opt), list(model.named_parameters()))
    assert state.optimizer_step == 5 and set(state.moments) == {"exp_avg", "exp_avg_sq"}
    fresh, fresh_opt = trained(1, 0)
    restore(SimpleNamespace(optimizer=fresh_opt), list(fresh.named_parameters()), state)
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    for (a, b) in ((model, opt), (fresh, fresh_opt)):
        for i in range(5, 8):
            x = torch.randn(16, 4, generator=torch.Generator().manual_seed(i))
            a(x).pow(2).mean().backward()
            b.step()
            b.zero_grad()
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q)


def test_optimizers_the_resume_does_not_cover_are_refused():
    with pytest.raises(UnsupportedStateError, match="FP16_Optimizer"):
        capture(SimpleNamespace(optimizer=type("FP16_Optimizer", (), {})()), [])
    model, opt = trained(0, 1)
    first = next(iter(opt.state.values()))
    first["odd"] = "not a tensor"
    with pytest.raises(UnsupportedStateError, match="'odd'"):
        capture(SimpleNamespace(optimizer=opt), list(model.named_parameters()))
