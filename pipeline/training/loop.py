"""The training loop of one process (one rank): DeepSpeed, TTT loss, checkpoints, export.

:func:`train` runs inside ``python -m pipeline.training.worker`` (1 process) or under torchrun /
the DeepSpeed launcher (N processes); every rank runs the same code on its share of each
global batch (:mod:`pipeline.training.data`). It reads as four parts: :func:`set_up` (process
group, drafter, data, optimizer, engine), :func:`resume` (the newest checkpoint),
:func:`train_step` (one optimizer step) and :func:`export` (the drafter and the result).

Invariants:

- Optimisation: torch AdamW over ``model.trainable_parameters()`` (the frozen embedding is a
  buffer), a LambdaLR warmup + cosine stepped by the engine, gradient clipping by DeepSpeed,
  the drafter algorithm's objective (EAGLE-3's TTT loss, :func:`pipeline.eagle3.ttt.ttt_loss`;
  DFlash's block loss, :func:`pipeline.dflash.objective.block_loss`).
- Determinism: seeded model init and data order, fixed threads; a run resumed from any
  complete checkpoint ends with bit-identical weights to an uninterrupted one (tested with
  SIGKILL), because the checkpoint holds model, optimizer, scheduler, step, data position,
  RNG and the metric history.
- Checkpoints every ``checkpoint_every`` optimizer steps and at the end; the export happens
  after the final checkpoint, so a run killed during export resumes straight into it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.algorithms import algorithm, trained_layers
from pipeline.capture.window import WindowError, load_target, read_window, shard_geometry
from pipeline.records import from_dict, to_dict, to_json
from pipeline.storage import Storage
from pipeline.training import checkpoint as ckpt
from pipeline.training.config import (
    TrainConfig,
    deepspeed_config,
    lr_factor,
    total_steps,
    warmup_steps,
)
from pipeline.training.curve import metrics_line
from pipeline.training.data import Position, WindowReader
from pipeline.training.distributed import DistContext, barrier, init_distributed
from pipeline.training.engine_state import capture, full_fp32_params, restore
from pipeline.training.metrics import MetricSums, aggregate, all_reduce
from pipeline.training.spec import TrainResult, TrainSpec
from pipeline.training.warmstart import apply_warm_start
from pipeline.vocab.stage import load_mapping

log = logging.getLogger(__name__)
RESULT_NAME = "result.json"
_EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16,
                  "float32": torch.float32}


def layer_columns(captured: tuple[int, ...], used: tuple[int, ...], hidden: int
                  ) -> torch.Tensor | None:
    """The aux columns of the ``used`` layers among the ``captured`` ones (each ``hidden``
    wide), in ``used`` order; None when they are all of them in order."""
    if used == captured:
        return None
    return torch.cat([torch.arange(hidden) + captured.index(i) * hidden for i in used])


def build_drafter(spec: TrainSpec, storage: Storage) -> tuple[nn.Module, Any, dict]:
    """The drafter (seeded init, vocab installed), the teacher weights, and the shards."""
    target = load_target(storage, spec.step)
    if target.sha256 != spec.policy_sha256:
        raise WindowError(f"{target.uri} changed since the run was planned")
    manifests = read_window(storage, spec.window_steps)
    hidden, captured = shard_geometry(manifests)
    mapping = load_mapping(storage, spec.vocab_key)
    trained = algorithm(spec.config.drafter_algorithm)
    aux_ids = trained_layers(trained.name, captured, target.config)
    config = trained.new_config(target.config, draft_vocab_size=mapping.draft_vocab_size,
                                aux_layer_ids=aux_ids, shape=spec.config.drafter_shape,
                                train=spec.config)
    width = getattr(config, "target_hidden_size", config.hidden_size)
    if hidden != width or mapping.target_vocab_size != config.vocab_size:
        raise WindowError(f"shards (H={hidden}) or vocab mapping (V={mapping.target_vocab_size})"
                          f" do not fit the policy (H={width}, V={config.vocab_size})")
    torch.manual_seed(spec.config.seed)
    model = trained.build(config, target.embed, head=target.lm_head, d2t=mapping.d2t,
                          t2d=mapping.t2d)
    return model, target, manifests


@dataclass
class Run:
    """One process's training run: what :func:`set_up` builds, :func:`resume` restores and
    :func:`train_step` advances."""

    spec: TrainSpec
    ctx: DistContext
    model: nn.Module  # the drafter algorithm's model
    target: Any  # the teacher (pipeline.capture.window.Target)
    reader: WindowReader
    engine: Any  # DeepSpeed's engine around the algorithm's objective(model)
    depth: int  # the objective's metric slots (TTT depth, DFlash's block - 1)
    scheduler: Any
    named: list[tuple[str, nn.Parameter]]  # the trainable parameters, by name
    per_epoch: int
    total: int
    warm: dict[str, Any]  # the warm start's record
    step: int = 0
    position: Position = field(default_factory=Position)
    history: list[dict[str, Any]] = field(default_factory=list)
    resumed: int | None = None  # the checkpoint's step, when resumed
    tokens_seen: int = 0
    columns: torch.Tensor | None = None  # the aux columns the drafter reads (None: all)

    @property
    def config(self) -> TrainConfig:
        return self.spec.config

    @property
    def identity(self) -> dict[str, Any]:
        """What a checkpoint must belong to for this run to resume from it."""
        return {"fingerprint": self.spec.fingerprint(), "world_size": self.config.world_size}

    @property
    def checkpoints(self) -> Path:
        return Path(self.spec.work_dir) / "checkpoints"


def set_up(spec: TrainSpec, storage: Storage) -> Run:
    """The process group, the seeded drafter (warm-started), the window's reader, AdamW with
    the warmup + cosine schedule, and DeepSpeed's engine around the TTT loss."""
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

    objective = algorithm(cfg.drafter_algorithm).objective(model, cfg)
    engine, _, _, scheduler = deepspeed.initialize(
        model=objective, optimizer=optimizer, lr_scheduler=scheduler,
        config=deepspeed_config(cfg))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    hidden, captured = shard_geometry(manifests)
    return Run(spec, ctx, model, target, reader, engine, objective.depth, scheduler, named,
               per_epoch, total, warm,
               columns=layer_columns(captured, tuple(model.config.aux_layer_ids), hidden))


def resume(run: Run) -> bool:
    """Restore ``run`` from its newest complete checkpoint, if any: weights, optimizer,
    scheduler, step, data position, metric history, warm-start record and RNG. A checkpoint
    of another run (fingerprint or world size) is refused."""
    latest = ckpt.latest_checkpoint(run.checkpoints)
    if latest is None:
        return False
    state = ckpt.load_checkpoint(latest, run.ctx.rank)
    if state.extra["identity"] != run.identity:
        raise RuntimeError(f"{latest} belongs to another run ({state.extra['identity']}, "
                           f"this one is {run.identity}); use a fresh work dir")
    restore(run.engine, run.named, state.engine)
    run.scheduler.load_state_dict(state.extra["scheduler"])
    run.step, run.resumed = state.step, state.step
    run.position = from_dict(Position, state.extra["position"])
    run.history = state.extra["history"]
    run.warm = state.extra["warm_start"]
    cfg = run.config
    run.engine.global_steps, run.engine.micro_steps = run.step, run.step * cfg.grad_accum
    run.engine.global_samples = run.step * cfg.samples_per_step
    ckpt.set_rng_state(state.rng, state.python_rng)
    log.info("resumed from %s (step %d of %d)", latest, run.step, run.total)
    return True


def train_step(run: Run, batches: Iterator[tuple[Any, list]], collate_batch) -> None:
    """One optimizer step: ``grad_accum`` micro-batches of this rank through the engine;
    the metrics summed over the ranks join the history."""
    cfg = run.config
    sums = MetricSums.zeros(run.depth)
    for _ in range(cfg.grad_accum):
        _, samples = next(batches)
        batch = collate_batch(samples)
        loss, metrics = run.engine(batch)
        run.engine.backward(loss)
        run.engine.step()
        sums.add(metrics, int(batch.real.sum()))
    run.step += 1
    run.position = Position(run.position.epoch,
                            run.position.micro_batch + cfg.world_size * cfg.grad_accum)
    total_sums = all_reduce(sums, run.ctx.device)
    run.tokens_seen += total_sums.tokens
    run.history.append({"step": run.step, "lr": run.scheduler.get_last_lr()[0],
                        "sums": total_sums.to_list()})


def export(run: Run, seconds: float) -> TrainResult | None:
    """Gather the fp32 weights (a collective), and on rank 0 save the drafter and write
    the run's result; None on the other ranks."""
    cfg, model = run.config, run.model
    params = full_fp32_params(run.engine, run.named)  # collective
    if run.ctx.rank != 0:
        return None
    algo = algorithm(cfg.drafter_algorithm)
    drafter = algo.fresh(model, run.target)
    trained = {n for n, _ in drafter.named_parameters()}
    if set(params) != trained:  # every parameter trained: none left at its fresh init
        raise RuntimeError(f"gathered parameters {sorted(set(params) ^ trained)} differ "
                           "from the drafter's")
    persistent = {k: v for k, v in drafter.state_dict().items() if k not in trained}
    drafter.load_state_dict({**persistent, **params}, strict=True)  # d2t, t2d, own embed
    algo.save(drafter, run.spec.out_dir, dtype=_EXPORT_DTYPES[cfg.export_dtype])
    history, per_epoch = run.history, run.per_epoch
    window = max(1, min(per_epoch, len(history) // 4))  # first vs last quarter
    samples_done = (run.step - (run.resumed or 0)) * cfg.samples_per_step
    result = TrainResult(
        fingerprint=run.spec.fingerprint(), steps=run.step, steps_per_epoch=per_epoch,
        epochs=run.step / per_epoch, samples=run.reader.num_samples,
        tokens_trained=run.tokens_seen, seconds=seconds,
        tokens_per_s=run.tokens_seen / seconds if seconds > 0 else 0.0,
        samples_per_s=samples_done / seconds if seconds > 0 else 0.0,
        resumed_from_step=run.resumed, world_size=cfg.world_size, zero_stage=cfg.zero_stage,
        dtype=cfg.dtype,
        final=aggregate(run.depth, (h["sums"] for h in history[-window:])).summary(),
        first=aggregate(run.depth, (h["sums"] for h in history[:window])).summary(),
        history=[_brief(h, run.depth) for h in history], warm_start=run.warm,
        drafter_config=algo.config_json(model.config), out_dir=str(run.spec.out_dir))
    ckpt.write_atomic(Path(run.spec.work_dir) / RESULT_NAME, to_json(result).encode())
    return result


def train(spec: TrainSpec, storage: Storage) -> TrainResult:
    """Train (or resume) the run described by ``spec``; rank 0 exports and writes the result."""
    run = set_up(spec, storage)
    cfg = run.config
    if not resume(run):
        log.info("training %d steps (%d per epoch) on %d samples, warm start: %s", run.total,
                 run.per_epoch, run.reader.num_samples, run.warm["reason"])
    collate = algorithm(cfg.drafter_algorithm).collate
    target = dataclasses.replace(run.target, lm_head=run.target.lm_head.to(run.ctx.device))

    def collate_batch(samples: list) -> Any:
        if run.columns is not None:  # the drafter reads some of the captured layers
            samples = [dataclasses.replace(s, aux_hidden=s.aux_hidden[:, run.columns])
                       for s in samples]
        return collate(samples, target=target, model=run.model, device=run.ctx.device)

    epoch_end = run.per_epoch * cfg.world_size * cfg.grad_accum  # micro-batches per epoch
    started = time.perf_counter()
    while run.step < run.total:
        batches = run.reader.iter_micro_batches(run.position, run.ctx.rank, cfg.world_size,
                                                stop=epoch_end)
        while run.step < run.total and run.position.micro_batch < epoch_end:
            train_step(run, batches, collate_batch)
            if run.ctx.rank == 0 and (run.step % cfg.log_every == 0 or run.step == run.total):
                _log_step(run)
            if run.step % cfg.checkpoint_every == 0 or run.step == run.total:
                _checkpoint(run)
        if run.position.micro_batch >= epoch_end:
            run.position = Position(run.position.epoch + 1, 0)
    result = export(run, time.perf_counter() - started)
    barrier()
    return result


def _log_step(run: Run) -> None:
    s = MetricSums.from_list(run.depth, run.history[-1]["sums"]).summary()
    log.info("step %d/%d lr %.3g loss %.4f acc/depth [%s] sim_accept %.3f", run.step,
             run.total, run.history[-1]["lr"], s["loss"],
             " ".join(f"{a:.3f}" for a in s["depth_accuracy"]), s["sim_accept_length"])
    log.info("%s", metrics_line(_brief(run.history[-1], run.depth)))


def _brief(h: dict[str, Any], depth: int) -> dict[str, Any]:
    s = MetricSums.from_list(depth, h["sums"]).summary()
    return {"step": h["step"], "lr": h["lr"], "loss": s["loss"],
            "accuracy": s["depth_accuracy"], "sim_accept_length": s["sim_accept_length"]}


def _checkpoint(run: Run) -> None:
    tensors, python_state = ckpt.rng_state()
    state = ckpt.Checkpoint(
        step=run.step, engine=capture(run.engine, run.named), rng=tensors,
        python_rng=python_state,
        extra={"scheduler": run.scheduler.state_dict(), "position": to_dict(run.position),
               "history": run.history, "warm_start": run.warm, "identity": run.identity})
    path = ckpt.save_checkpoint(run.checkpoints, state, rank=run.ctx.rank, barrier=barrier,
                                keep=run.config.keep_checkpoints)
    if path is not None:
        log.info("checkpoint %s", path)
