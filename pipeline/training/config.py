"""Training hyper-parameters (:class:`TrainConfig`) and the DeepSpeed config built from them.

Invariants:

- One source of truth: the Dagster run config and the trainer resource convert to a
  :class:`TrainConfig`; the DeepSpeed JSON is derived from it, never written by hand.
- Micro batches count samples, not tokens, so the number of optimizer steps per epoch is known
  from the manifests and ``world_size × micro_batch_size`` samples per micro step are the same
  global batch for any split (2 ranks × B = 1 rank × B with twice the accumulation).
- Learning rate: linear warmup over ``ceil(warmup_ratio · total_steps)`` steps to ``lr``, then
  cosine decay to ``min_lr`` at ``total_steps`` (:func:`lr_factor`).
- Supported precision: fp32 with ZeRO 0/1/2, bf16 with ZeRO 1/2 (bf16 under ZeRO 0 would use
  DeepSpeed's FP16_Optimizer wrapper, whose state :mod:`engine_state` does not cover). fp16
  (dynamic loss scaling) and ZeRO 3 are refused.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

from pipeline.algorithms import DEFAULT_ALGORITHM, algorithm
from pipeline.eagle3.config import DrafterShape
from pipeline.records import to_dict

Dtype = Literal["fp32", "bf16"]
Device = Literal["cpu", "cuda"]
ExportDtype = Literal["bfloat16", "float16", "float32"]  # of the exported SGLang weights
LauncherKind = Literal["auto", "python", "torchrun", "deepspeed"]  # pipeline.training.launch
DTYPES, DEVICES, EXPORT_DTYPES = get_args(Dtype), get_args(Device), get_args(ExportDtype)


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides what a training run computes (see the module docstring)."""

    # optimisation (EAGLE-3 / SpecForge defaults, DESIGN §4)
    lr: float = 1e-4
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    warmup_ratio: float = 0.015
    grad_clip: float = 0.5
    # TTT
    ttt_depth: int = 7
    ttt_decay: float = 0.8
    max_length: int = 2048  # longer samples are cut to their first max_length tokens
    # batching: one optimizer step = world_size × grad_accum micro batches
    micro_batch_size: int = 4  # samples per micro batch per rank
    grad_accum: int = 1
    epochs: int = 1
    max_steps: int = 0  # > 0: exactly this many optimizer steps (epochs ignored, data cycles)
    shuffle_buffer: int = 256  # samples held at once by the reader (whole row groups)
    seed: int = 0
    # execution (the trainer resource overrides these)
    zero_stage: int = 2  # EAGLE uses ZeRO-2; works on CPU + gloo
    dtype: Dtype = "fp32"
    world_size: int = 1
    device: Device = "cpu"
    threads: int = 0  # torch intra-op threads per rank; 0 = torch's default
    # bookkeeping
    checkpoint_every: int = 50  # optimizer steps; a final checkpoint is always written
    keep_checkpoints: int = 2
    log_every: int = 10
    export_dtype: ExportDtype = "bfloat16"
    # the drafter's widths (0: derived from the target, see pipeline.eagle3.config)
    drafter_hidden_size: int = 0
    drafter_intermediate_size: int = 0
    drafter_heads: int = 0
    drafter_kv_heads: int = 0
    drafter_head_dim: int = 0
    # the drafter algorithm trained (pipeline.algorithms): eagle3, eagle3.1 or dflash
    drafter_algorithm: str = DEFAULT_ALGORITHM
    # DFlash (read only when drafter_algorithm is dflash; see pipeline.dflash)
    dflash_layers: int = 5  # draft decoder layers
    dflash_block_size: int = 8  # the anchor and block_size - 1 draft tokens
    dflash_anchors: int = 64  # blocks trained per sample, at most
    dflash_gamma: float = 0.0  # loss decay over the block; 0: by block size (8: 4, 16: 7)
    dflash_mask_token_id: int = -1  # -1: the target's mask_token_id, else its last row
    dflash_kd: bool = False  # distil the target's distributions instead of its tokens

    @property
    def drafter_shape(self) -> DrafterShape:
        return DrafterShape(self.drafter_hidden_size, self.drafter_intermediate_size,
                            self.drafter_heads, self.drafter_kv_heads, self.drafter_head_dim)

    def __post_init__(self) -> None:
        _ = self.drafter_shape  # validates the widths
        algorithm(self.drafter_algorithm)  # an UnknownAlgorithmError names the choices
        positive = ("lr", "adam_eps", "ttt_depth", "max_length", "micro_batch_size",
                    "grad_accum", "epochs", "shuffle_buffer", "world_size", "checkpoint_every",
                    "keep_checkpoints", "log_every")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("min_lr", "weight_decay", "grad_clip", "max_steps", "threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr {self.min_lr} exceeds lr {self.lr}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.zero_stage not in (0, 1, 2):
            raise ValueError(f"zero_stage must be 0, 1 or 2, got {self.zero_stage} "
                             "(ZeRO-3 is not supported for a one-layer drafter)")
        if self.dtype == "bf16" and self.zero_stage == 0:
            raise ValueError("bf16 needs zero_stage 1 or 2 (the stage-0 bf16 wrapper's state "
                             "is not covered by Aerie's resume)")
        if self.dflash_layers < 1 or self.dflash_block_size < 2 or self.dflash_anchors < 1:
            raise ValueError(f"dflash_layers ({self.dflash_layers}) and dflash_anchors "
                             f"({self.dflash_anchors}) must be >= 1, dflash_block_size "
                             f"({self.dflash_block_size}) >= 2")
        if self.dflash_gamma < 0 or self.dflash_mask_token_id < -1:
            raise ValueError(f"dflash_gamma ({self.dflash_gamma}) must be >= 0 and "
                             f"dflash_mask_token_id ({self.dflash_mask_token_id}) >= -1")
        if self.export_dtype not in EXPORT_DTYPES:
            raise ValueError(f"export_dtype must be one of {EXPORT_DTYPES}, got "
                             f"{self.export_dtype!r}")

    @property
    def samples_per_step(self) -> int:
        """The global batch: samples consumed by one optimizer step over all ranks."""
        return self.micro_batch_size * self.grad_accum * self.world_size

    def fingerprint(self) -> str:
        """sha256 of the fields that change the trained weights (not logging cadence).
        Drafter widths left at 0 (derived from the target, which the spec fingerprints) and
        the default algorithm are left out, so runs planned before those fields existed keep
        their fingerprints; so are the settings of algorithms other than the one trained."""
        cosmetic = {"log_every", "keep_checkpoints", "checkpoint_every"}
        if self.drafter_algorithm != "dflash":
            cosmetic |= {k for k in to_dict(self) if k.startswith("dflash_")}
        payload = {k: v for k, v in sorted(to_dict(self).items()) if k not in cosmetic
                   and not (k.startswith("drafter_") and v in (0, DEFAULT_ALGORITHM))}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


# Hyper-parameters per target family where the library defaults (tuned for warm-started
# refreshes on real data) learn nothing: the demo drafter starts from scratch on a few
# thousand tokens per window. The refresh job's default run config (what the Launchpad shows
# and the sensors run) takes the preset of the configured family, AERIE_TARGET_FAMILY.
FAMILY_PRESETS: dict[str, dict[str, float | int]] = {
    "demo": {"lr": 1e-3, "epochs": 3, "micro_batch_size": 8},
}

def total_steps(config: TrainConfig, num_samples: int) -> tuple[int, int]:
    """``(steps_per_epoch, total_steps)`` for ``num_samples`` in the window.

    Each epoch drops its last partial global batch. Raises when the window cannot fill one.
    """
    per_epoch = num_samples // config.samples_per_step
    if per_epoch == 0:
        raise ValueError(f"the window has {num_samples} samples, fewer than one global batch "
                         f"of {config.samples_per_step} (micro_batch_size × grad_accum × "
                         "world_size)")
    return per_epoch, config.max_steps or per_epoch * config.epochs


def warmup_steps(config: TrainConfig, total: int) -> int:
    return math.ceil(config.warmup_ratio * total)


def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of ``lr`` for optimizer step ``step`` (0-based): warmup, then cosine."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def deepspeed_config(config: TrainConfig) -> dict[str, Any]:
    """The DeepSpeed JSON config of ``config`` (the optimizer and scheduler are passed as
    torch objects: no fused_adam JIT build, and their state stays plain torch state)."""
    zero: dict[str, Any] = {"stage": config.zero_stage}
    if config.zero_stage:
        zero.update(contiguous_gradients=True, overlap_comm=False,
                    reduce_bucket_size=int(5e7), allgather_bucket_size=int(5e7))
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": config.micro_batch_size,
        "gradient_accumulation_steps": config.grad_accum,
        "train_batch_size": config.samples_per_step,
        "gradient_clipping": config.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": config.dtype == "bf16"},
        "fp16": {"enabled": False},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": False,
    }
    if config.dtype == "bf16":
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg
