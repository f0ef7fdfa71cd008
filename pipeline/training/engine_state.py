"""Getting the full training state out of a DeepSpeed engine and back in, without pickle.

The state is kept in the unpartitioned layout of a plain torch AdamW, whatever the ZeRO stage
and world size: per trainable parameter name the fp32 master weight and the optimizer moments
(``exp_avg``, ``exp_avg_sq``, any other tensor of the parameter's shape), plus the shared step
count and the param groups' hyper-parameters (``lr``, ``initial_lr``, betas, …).

Two optimizer layouts are handled:

- *plain* (ZeRO 0, fp32): ``engine.optimizer`` is the torch AdamW; state is read directly.
- *partitioned* (ZeRO 1/2, fp32 or bf16; DeepSpeed's ZeRO optimizer or BF16_Optimizer): each
  rank owns a slice of one flat fp32 master per param group and the moments over it. Reading
  gathers full tensors with DeepSpeed's ``safe_get_full_fp32_param`` /
  ``safe_get_full_optimizer_state`` (collectives: every rank must call); restoring recreates
  the base optimizer's state over the flat partitions, re-links DeepSpeed's fragment views,
  writes each rank's slice with the ``safe_set_full_*`` calls and refreshes the model's
  (low-precision) weights from the masters (``update_lp_params``).

Anything else (fp16 loss scaling, ZeRO-3, offload) is refused with a clear error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

_SCALAR_KEYS = ("step",)


class UnsupportedStateError(TypeError):
    """The engine's optimizer (or a value in its state) cannot be saved without pickle."""


@dataclass(eq=False)
class EngineState:
    """Training state in the unpartitioned torch-AdamW layout (CPU tensors)."""

    params: dict[str, torch.Tensor]  # name -> fp32 master
    moments: dict[str, dict[str, torch.Tensor]]  # key ("exp_avg", …) -> name -> tensor
    optimizer_step: int  # AdamW's step count (0 before the first step)
    param_groups: list[dict[str, Any]] = field(default_factory=list)  # without "params"


def _kind(engine: Any) -> str:
    opt = engine.optimizer
    if isinstance(opt, torch.optim.Optimizer):
        return "plain"
    if hasattr(opt, "update_lp_params") and hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        return "partitioned"
    raise UnsupportedStateError(f"optimizer wrapper {type(opt).__name__} is not supported by "
                                "Aerie's resume (use fp32 with ZeRO 0/1/2 or bf16 with ZeRO 1/2)")


def _base(engine: Any) -> torch.optim.Optimizer:
    opt = engine.optimizer
    return opt if isinstance(opt, torch.optim.Optimizer) else opt.optimizer


def _group_values(base: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in base.param_groups]


def _step_of(state: dict[str, Any], where: str) -> int:
    step = state.get("step", 0)
    value = float(step.item() if torch.is_tensor(step) else step)
    if not value.is_integer() or math.isnan(value):
        raise UnsupportedStateError(f"{where}: non-integer optimizer step {value}")
    return int(value)


def _moment_keys(base: torch.optim.Optimizer) -> tuple[list[str], int]:
    """Tensor state keys shaped like their parameter, and the (common) step count."""
    keys: set[str] = set()
    steps: set[int] = set()
    for group in base.param_groups:
        for p in group["params"]:
            st = base.state.get(p)
            if not st:
                continue
            for k, v in st.items():
                if k in _SCALAR_KEYS:
                    continue
                if not (torch.is_tensor(v) and v.shape == p.shape):
                    raise UnsupportedStateError(f"optimizer state {k!r} of type "
                                                f"{type(v).__name__} is not supported")
                keys.add(k)
            steps.add(_step_of(st, "optimizer state"))
    if len(steps) > 1:
        raise UnsupportedStateError(f"parameters are at different optimizer steps {steps}")
    return sorted(keys), steps.pop() if steps else 0


def capture(engine: Any, named: list[tuple[str, nn.Parameter]]) -> EngineState:
    """The full state (collective under ZeRO 1/2: call on every rank)."""
    kind, base = _kind(engine), _base(engine)
    keys, step = _moment_keys(base)
    params: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {k: {} for k in keys}
    if kind == "plain":
        for name, p in named:
            params[name] = p.detach().float().cpu().clone()
            st = base.state.get(p, {})
            for k in keys:
                moments[k][name] = st[k].detach().float().cpu().clone()
    else:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        for name, p in named:
            params[name] = safe_get_full_fp32_param(p).detach().float().cpu().clone()
            for k in keys:
                value = safe_get_full_optimizer_state(p, k)
                moments[k][name] = value.detach().float().cpu().clone()
    return EngineState(params=params, moments=moments, optimizer_step=step,
                       param_groups=_group_values(base))


@torch.no_grad()
def restore(engine: Any, named: list[tuple[str, nn.Parameter]], state: EngineState) -> None:
    """Load ``state`` into ``engine`` (every rank; the layout must match ``named``)."""
    kind, base = _kind(engine), _base(engine)
    names = [n for n, _ in named]
    if sorted(names) != sorted(state.params):
        raise ValueError(f"checkpoint parameters {sorted(state.params)} do not match the "
                         f"model's {sorted(names)}")
    if len(state.param_groups) != len(base.param_groups):
        raise ValueError(f"checkpoint has {len(state.param_groups)} param groups, the "
                         f"optimizer {len(base.param_groups)}")
    step_value = torch.tensor(float(state.optimizer_step), dtype=torch.get_default_dtype())
    if kind == "plain":
        for name, p in named:
            p.copy_(state.params[name].to(p.device, p.dtype))
            if state.moments:
                base.state[p] = {"step": step_value.clone(), **{
                    k: v[name].to(p.device, p.dtype).clone() for k, v in state.moments.items()}}
    else:
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        opt = engine.optimizer
        for name, p in named:
            safe_set_full_fp32_param(p, state.params[name].to(p.device))
        if state.moments:
            for group in base.param_groups:
                for flat in group["params"]:
                    base.state[flat] = {"step": step_value.clone(), **{
                        k: torch.zeros_like(flat) for k in state.moments}}
            opt._hp_optimizer_states_linked = False  # re-point fragments at the new tensors
            opt._lazy_init_hp_params_optimizer_state()
            for name, p in named:
                for k, values in state.moments.items():
                    safe_set_full_optimizer_state(p, values[name].to(p.device), k)
        opt.update_lp_params()  # model weights (fp32 or bf16) from the restored masters
    for group, saved in zip(base.param_groups, state.param_groups, strict=True):
        group.update(saved)


def full_fp32_params(engine: Any, named: list[tuple[str, nn.Parameter]]
                     ) -> dict[str, torch.Tensor]:
    """fp32 master weights by name (collective under ZeRO 1/2)."""
    if _kind(engine) == "plain":
        return {n: p.detach().float().cpu().clone() for n, p in named}
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).detach().float().cpu().clone() for n, p in named}
