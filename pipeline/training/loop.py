"""The training loop of one process (one rank): DeepSpeed, TTT loss, checkpoints, export.

:func:`train` runs inside ``python -m pipeline.training.worker`` (1 process) or under torchrun /
the DeepSpeed launcher (N processes); every rank runs the same code on its share of each
global batch (:mod:`pipeline.training.data`).

Invariants:

- Optimisation: torch AdamW over ``model.trainable_parameters()`` (the frozen embedding is a
  buffer), a LambdaLR warmup + cosine stepped by the engine, gradient clipping by DeepSpeed,
  the TTT loss of :func:`pipeline.eagle3.ttt.ttt_loss`.
- Determinism: seeded model init and data order, fixed threads; a run resumed from any
  complete checkpoint ends with bit-identical weights to an uninterrupted one (tested with
  SIGKILL), because the checkpoint holds model, optimizer, scheduler, step, data position,
  RNG and the metric history.
- Checkpoints every ``checkpoint_every`` optimizer steps and at the end; the export happens
  after the final checkpoint, so a run killed during export resumes straight into it.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.capture.window import WindowError, load_target, read_window, shard_geometry
from pipeline.eagle3.config import DrafterConfig
from pipeline.eagle3.export import save_drafter
from pipeline.eagle3.model import Eagle3Drafter
from pipeline.eagle3.ttt import TTTMetrics, ttt_loss
from pipeline.eagle3.ttt_batch import LogitHead, TTTBatch, collate
from pipeline.records import from_dict, to_dict, to_json
from pipeline.storage import Storage
from pipeline.training import checkpoint as ckpt
from pipeline.training.config import deepspeed_config, lr_factor, total_steps, warmup_steps
from pipeline.training.curve import metrics_line
from pipeline.training.data import Position, WindowReader
from pipeline.training.distributed import barrier, init_distributed
from pipeline.training.engine_state import capture, full_fp32_params, restore
from pipeline.training.metrics import MetricSums, aggregate, all_reduce
from pipeline.training.spec import TrainResult, TrainSpec
from pipeline.training.warmstart import apply_warm_start
from pipeline.vocab.stage import load_mapping

log = logging.getLogger(__name__)
RESULT_NAME = "result.json"
_EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16,
                  "float32": torch.float32}


class TTTObjective(nn.Module):
    """The drafter with its TTT loss as ``forward``, so DeepSpeed's engine runs the loss."""

    def __init__(self, drafter: Eagle3Drafter, depth: int, decay: float):
        super().__init__()
        self.drafter = drafter
        self.depth = depth
        self.decay = decay

    def forward(self, batch: TTTBatch) -> tuple[torch.Tensor, TTTMetrics]:
        return ttt_loss(self.drafter, batch, self.depth, decay=self.decay)


def build_drafter(spec: TrainSpec, storage: Storage) -> tuple[Eagle3Drafter, Any, dict]:
    """The drafter (seeded init, vocab installed), the teacher weights, and the shards."""
    target = load_target(storage, spec.step)
    if target.sha256 != spec.policy_sha256:
        raise WindowError(f"{target.uri} changed since the run was planned")
    manifests = read_window(storage, spec.window_steps)
    hidden, aux_ids = shard_geometry(manifests)
    mapping = load_mapping(storage, spec.vocab_key)
    config = DrafterConfig.from_target(target.config, draft_vocab_size=mapping.draft_vocab_size,
                                       aux_layer_ids=aux_ids, shape=spec.config.drafter_shape)
    if hidden != config.target_hidden_size or mapping.target_vocab_size != config.vocab_size:
        raise WindowError(f"shards (H={hidden}) or vocab mapping (V={mapping.target_vocab_size})"
                          f" do not fit the policy (H={config.target_hidden_size}, "
                          f"V={config.vocab_size})")
    torch.manual_seed(spec.config.seed)
    model = Eagle3Drafter(config, target.embed, d2t=mapping.d2t, t2d=mapping.t2d)
    return model, target, manifests


def train(spec: TrainSpec, storage: Storage) -> TrainResult:
    """Train (or resume) the run described by ``spec``; rank 0 exports and writes the result."""
    cfg = spec.config
    ctx = init_distributed(cfg.device, cfg.world_size)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    random.seed(cfg.seed)
    model, target, manifests = build_drafter(spec, storage)
    warm = apply_warm_start(model, spec.warm_start_dir, spec.warm_start_source)
    reader = WindowReader(storage, manifests, micro_batch_size=cfg.micro_batch_size,
                          shuffle_buffer=cfg.shuffle_buffer, seed=cfg.seed,
                          max_length=cfg.max_length)
    per_epoch, total = total_steps(cfg, reader.num_samples)
    optimizer = torch.optim.AdamW(model.trainable_parameters(), lr=cfg.lr,
                                  betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                                  weight_decay=cfg.weight_decay)
    schedule = functools.partial(lr_factor, warmup=warmup_steps(cfg, total), total=total,
                                 min_ratio=cfg.min_lr / cfg.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    import deepspeed

    engine, _, _, scheduler = deepspeed.initialize(
        model=TTTObjective(model, cfg.ttt_depth, cfg.ttt_decay), optimizer=optimizer,
        lr_scheduler=scheduler, config=deepspeed_config(cfg))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    identity = {"fingerprint": spec.fingerprint(), "world_size": cfg.world_size}
    root = Path(spec.work_dir) / "checkpoints"
    step, position, history, resumed = 0, Position(), [], None
    latest = ckpt.latest_checkpoint(root)
    if latest is not None:
        state = ckpt.load_checkpoint(latest, ctx.rank)
        if state.extra["identity"] != identity:
            raise RuntimeError(f"{latest} belongs to another run ({state.extra['identity']}, "
                               f"this one is {identity}); use a fresh work dir")
        restore(engine, named, state.engine)
        scheduler.load_state_dict(state.extra["scheduler"])
        step, resumed = state.step, state.step
        position = from_dict(Position, state.extra["position"])
        history = state.extra["history"]
        warm = state.extra["warm_start"]
        engine.global_steps, engine.micro_steps = step, step * cfg.grad_accum
        engine.global_samples = step * cfg.samples_per_step
        ckpt.set_rng_state(state.rng, state.python_rng)
        log.info("resumed from %s (step %d of %d)", latest, step, total)
    else:
        log.info("training %d steps (%d per epoch) on %d samples, warm start: %s", total,
                 per_epoch, reader.num_samples, warm["reason"])
    lm_head, t2d = target.lm_head.to(ctx.device), model.t2d
    head = LogitHead.of(target.config)  # the target's soft-cap / scaling after the matmul
    per_step = cfg.world_size * cfg.grad_accum
    tokens_seen, started = 0, time.perf_counter()
    while step < total:
        batches = reader.iter_micro_batches(position, ctx.rank, cfg.world_size,
                                            stop=per_epoch * per_step)
        while step < total and position.micro_batch < per_epoch * per_step:
            sums = MetricSums.zeros(cfg.ttt_depth)
            for _ in range(cfg.grad_accum):
                _, samples = next(batches)
                batch = collate(samples, lm_head, t2d, device=ctx.device, head=head)
                loss, metrics = engine(batch)
                engine.backward(loss)
                engine.step()
                sums.add(metrics, int(batch.real.sum()))
            step += 1
            position = Position(position.epoch, position.micro_batch + per_step)
            total_sums = all_reduce(sums, ctx.device)
            tokens_seen += total_sums.tokens
            history.append({"step": step, "lr": scheduler.get_last_lr()[0],
                            "sums": total_sums.to_list()})
            if ctx.rank == 0 and (step % cfg.log_every == 0 or step == total):
                s = total_sums.summary()
                log.info("step %d/%d lr %.3g loss %.4f acc/depth [%s] sim_accept %.3f", step,
                         total, history[-1]["lr"], s["loss"],
                         " ".join(f"{a:.3f}" for a in s["depth_accuracy"]),
                         s["sim_accept_length"])
                log.info("%s", metrics_line(_brief(history[-1], cfg.ttt_depth)))
            if step % cfg.checkpoint_every == 0 or step == total:
                _checkpoint(root, engine, named, scheduler, step, position, history, warm,
                            identity, ctx.rank, cfg.keep_checkpoints)
        if position.micro_batch >= per_epoch * per_step:
            position = Position(position.epoch + 1, 0)
    seconds = time.perf_counter() - started
    samples_done = (step - (resumed or 0)) * cfg.samples_per_step
    params = full_fp32_params(engine, named)  # collective
    result = None
    if ctx.rank == 0:
        embed = model.embed_tokens.weight.cpu() if model.config.owns_embedding else target.embed
        export = Eagle3Drafter(model.config, embed, d2t=model.d2t.cpu(), t2d=model.t2d.cpu())
        trained = {n for n, _ in export.named_parameters()}
        if set(params) != trained:  # every parameter trained: none left at its fresh init
            raise RuntimeError(f"gathered parameters {sorted(set(params) ^ trained)} differ "
                               "from the drafter's")
        persistent = {k: v for k, v in export.state_dict().items() if k not in trained}
        export.load_state_dict({**persistent, **params}, strict=True)  # d2t, t2d, own embed
        save_drafter(export, model.config, spec.out_dir, overwrite=True,
                     dtype=_EXPORT_DTYPES[cfg.export_dtype])
        window = max(1, min(per_epoch, len(history) // 4))  # first vs last quarter
        result = TrainResult(
            fingerprint=spec.fingerprint(), steps=step, steps_per_epoch=per_epoch,
            epochs=step / per_epoch, samples=reader.num_samples, tokens_trained=tokens_seen,
            seconds=seconds, tokens_per_s=tokens_seen / seconds if seconds > 0 else 0.0,
            samples_per_s=samples_done / seconds if seconds > 0 else 0.0,
            resumed_from_step=resumed, world_size=cfg.world_size, zero_stage=cfg.zero_stage,
            dtype=cfg.dtype,
            final=aggregate(cfg.ttt_depth, (h["sums"] for h in history[-window:])).summary(),
            first=aggregate(cfg.ttt_depth, (h["sums"] for h in history[:window])).summary(),
            history=[_brief(h, cfg.ttt_depth) for h in history], warm_start=warm,
            drafter_config=model.config.to_sglang_config(), out_dir=str(spec.out_dir))
        ckpt.write_atomic(Path(spec.work_dir) / RESULT_NAME, to_json(result).encode())
    barrier()
    return result


def _brief(h: dict[str, Any], depth: int) -> dict[str, Any]:
    s = MetricSums.from_list(depth, h["sums"]).summary()
    return {"step": h["step"], "lr": h["lr"], "loss": s["loss"],
            "accuracy": s["depth_accuracy"], "sim_accept_length": s["sim_accept_length"]}


def _checkpoint(root: Path, engine: Any, named: list, scheduler: Any, step: int,
                position: Position, history: list, warm: dict, identity: dict, rank: int,
                keep: int) -> None:
    tensors, python_state = ckpt.rng_state()
    state = ckpt.Checkpoint(
        step=step, engine=capture(engine, named), rng=tensors, python_rng=python_state,
        extra={"scheduler": scheduler.state_dict(), "position": to_dict(position),
               "history": history, "warm_start": warm, "identity": identity})
    path = ckpt.save_checkpoint(root, state, rank=rank, barrier=barrier, keep=keep)
    if path is not None:
        log.info("checkpoint %s", path)
