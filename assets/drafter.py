"""``vocab_mapping`` and ``drafter_checkpoint``: a refresh step's draft vocab and drafter.

Partition = the refresh step s (``refresh_steps``); both assets read the window s-K+1..s of
RL steps from storage (the vocab stage decides K and the draft vocab size; training follows
its pointer), record it as ``window_steps``, and fail naming any step of the window that is
missing.
"""

from dagster import (
    AssetCheckSeverity,
    AssetExecutionContext,
    Config,
    MaterializeResult,
    MetadataValue,
    asset,
)
from pydantic import Field

from assets.charts import run_chart
from assets.checks import result, spec
from assets.details import details_table
from assets.partitions import refresh_steps, step_of
from assets.retry import SERVICE_RETRY, fail_fast_on_permanent_errors
from assets.versions import CODE_VERSIONS
from pipeline.algorithms import ALGORITHMS
from pipeline.checks import MIN_VOCAB_COVERAGE, training_loss, vocab_coverage
from pipeline.training.config import TrainConfig
from pipeline.vocab.config import DEFAULT_DRAFT_VOCAB_SIZE
from resources.mlflow import MlflowResource
from resources.refresh import RefreshPolicyResource
from resources.storage import StorageResource
from resources.trainer import TrainerResource

_T = TrainConfig()
WINDOW_NOTE = ("Partition: the refresh step s (refresh_steps). It reads the last K RL steps "
               "s-K+1..s of the data assets (metadata window_steps); Dagster draws the edge "
               "to the RL-step partition of the same key, the window's newest step.")


class VocabRunConfig(Config):
    """Run config of ``vocab_mapping``: the training window and the draft vocab size."""

    window: int | None = Field(default=None, description="train on RL steps s-window+1 .. s; "
                               "unset: the refresh resource's K (AERIE_REFRESH_WINDOW)")
    draft_vocab_size: int = Field(default=DEFAULT_DRAFT_VOCAB_SIZE,
                                  description="draft vocab size (capped by the target vocab)")
    min_coverage: float = Field(default=MIN_VOCAB_COVERAGE,
                                description="vocab_coverage check: least share of masked "
                                            "tokens the draft vocab must cover")


class DrafterRunConfig(Config):
    """Run config of ``drafter_checkpoint``: mirrors :class:`TrainConfig` minus the execution
    fields the trainer resource owns (world_size, zero_stage, dtype, device, threads)."""

    lr: float = Field(default=_T.lr, description="peak AdamW learning rate")
    min_lr: float = Field(default=_T.min_lr, description="learning rate at the end (cosine)")
    weight_decay: float = Field(default=_T.weight_decay, description="AdamW weight decay")
    adam_beta1: float = Field(default=_T.adam_beta1, description="AdamW beta1")
    adam_beta2: float = Field(default=_T.adam_beta2, description="AdamW beta2")
    adam_eps: float = Field(default=_T.adam_eps, description="AdamW eps")
    warmup_ratio: float = Field(default=_T.warmup_ratio, description="linear warmup share")
    grad_clip: float = Field(default=_T.grad_clip, description="max gradient norm")
    ttt_depth: int = Field(default=_T.ttt_depth, description="TTT draft steps")
    ttt_decay: float = Field(default=_T.ttt_decay, description="loss weight decay per step")
    max_length: int = Field(default=_T.max_length, description="tokens per sample (cut)")
    micro_batch_size: int = Field(default=_T.micro_batch_size,
                                  description="samples per micro batch per rank")
    grad_accum: int = Field(default=_T.grad_accum, description="micro batches per step per "
                                                               "rank")
    epochs: int = Field(default=_T.epochs, description="passes over the window")
    max_steps: int = Field(default=_T.max_steps, description="> 0: exactly this many steps")
    shuffle_buffer: int = Field(default=_T.shuffle_buffer,
                                description="samples the reader shuffles within")
    seed: int = Field(default=_T.seed, description="init and data-order seed")
    checkpoint_every: int = Field(default=_T.checkpoint_every,
                                  description="optimizer steps between resume checkpoints")
    keep_checkpoints: int = Field(default=_T.keep_checkpoints, description="kept on disk")
    log_every: int = Field(default=_T.log_every, description="steps between log lines")
    export_dtype: str = Field(default=_T.export_dtype, description="exported weight dtype")
    drafter_hidden_size: int = Field(default=0, description="drafter width (0: the target's; "
                                     "another width exports the drafter's own embedding)")
    drafter_intermediate_size: int = Field(default=0, description="MLP width (0: derived)")
    drafter_heads: int = Field(default=0, description="attention heads (0: derived)")
    drafter_kv_heads: int = Field(default=0, description="KV heads (0: derived)")
    drafter_head_dim: int = Field(default=0, description="head size (0: derived)")
    drafter_algorithm: str = Field(default=_T.drafter_algorithm,
                                   description=f"the drafter algorithm, one of "
                                               f"{', '.join(ALGORITHMS)} (the refresh job's "
                                               "default: AERIE_DRAFTER_ALGORITHM)")
    dflash_layers: int = Field(default=_T.dflash_layers, description="DFlash: draft layers")
    dflash_block_size: int = Field(default=_T.dflash_block_size,
                                   description="DFlash: block size, the anchor included "
                                               "(SGLang's num-draft-tokens; vLLM drafts one "
                                               "fewer)")
    dflash_anchors: int = Field(default=_T.dflash_anchors,
                                description="DFlash: blocks trained per sample, at most")
    dflash_gamma: float = Field(default=_T.dflash_gamma, description="DFlash: loss decay over "
                                "the block (0: by block size, 8: 4, 16: 7)")
    dflash_mask_token_id: int = Field(default=_T.dflash_mask_token_id,
                                      description="DFlash: the mask token (-1: the target's "
                                                  "mask_token_id, else its last vocab row)")
    dflash_kd: bool = Field(default=_T.dflash_kd, description="DFlash: distil the target's "
                            "next-token distributions instead of the rollout's tokens")
    warm_start: str = Field(default="serving", description="serving (the drafter serving now) "
                            "| previous (the newest committed one) | none | a storage prefix "
                            "or local drafter dir")

    def to_core(self) -> TrainConfig:
        fields = {k: v for k, v in self.model_dump().items() if k != "warm_start"}
        return TrainConfig(**fields)


def _md_table(rows: list[dict]) -> MetadataValue:
    lines = ["| depth | loss | accuracy | accept length | count |", "|---|---|---|---|---|"]
    lines += [f"| {r['depth']} | {r['loss']:.4f} | {r['accuracy']:.4f} | "
              f"{r['accept_length']:.3f} | {r['count']} |" for r in rows]
    return MetadataValue.md("\n".join(lines))


@asset(partitions_def=refresh_steps, group_name="drafter", kinds={"pytorch", "safetensors"},
       code_version=CODE_VERSIONS["vocab_mapping"], deps=["hidden_state_shards"],
       retry_policy=SERVICE_RETRY,
       description="Draft vocab (d2t / t2d) of the training window, counted under the loss "
                   "mask; cached by content. " + WINDOW_NOTE,
       check_specs=[spec("vocab_mapping", "vocab_coverage",
                         "the draft vocab covers enough of the window's masked tokens")])
def vocab_mapping(context: AssetExecutionContext, config: VocabRunConfig,
                  storage: StorageResource, refresh: RefreshPolicyResource) -> MaterializeResult:
    """Draft vocab (d2t / t2d) of the training window, counted under the loss mask; cached."""
    from pipeline.vocab import stage as vocab_stage

    window = refresh.window if config.window is None else config.window
    with fail_fast_on_permanent_errors():
        v = vocab_stage.run(storage.build(), step_of(context.partition_key), window,
                               config.draft_vocab_size)
    s = v.summary()
    context.log.info(f"window {list(v.window_steps)}: coverage {v.mapping.coverage:.4f}, "
                     f"cache {'hit' if v.cache_hit else 'miss'}")
    return MaterializeResult(metadata={  # coverage and sizes first, the keys in details
        "coverage": round(s["coverage"], 4), "draft_vocab_size": s["draft_vocab_size"],
        "target_vocab_size": s["target_vocab_size"], "masked_tokens": s["masked_tokens"],
        "distinct_tokens": s["distinct_tokens"], "cache_hit": v.cache_hit,
        "window_steps": MetadataValue.json(list(v.window_steps)),
        "seconds": round(v.seconds, 3),
        "details": MetadataValue.md(details_table({"stored at": v.uri,
                                                   "cache key": v.cache_key}))},
        check_results=[result("vocab_coverage", vocab_coverage(v.mapping.coverage,
                                                               config.min_coverage),
                              AssetCheckSeverity.WARN)])


@asset(partitions_def=refresh_steps, group_name="drafter", kinds={"pytorch", "deepspeed"},
       code_version=CODE_VERSIONS["drafter_checkpoint"], deps=["vocab_mapping"],
       retry_policy=SERVICE_RETRY,
       description="The drafter (EAGLE-3, EAGLE 3.1 or DFlash: run config drafter_algorithm) "
                   "trained on the window (DeepSpeed, resumable), in the format SGLang and "
                   "vLLM load, warm-started from the drafter serving now; the training curve "
                   "is stored with the refresh's charts. " + WINDOW_NOTE,
       check_specs=[spec("drafter_checkpoint", "training_loss",
                         "every logged loss finite (blocking) and the loss falling (warning)",
                         blocking=True)])
def drafter_checkpoint(context: AssetExecutionContext, config: DrafterRunConfig,
                       storage: StorageResource, trainer: TrainerResource,
                       mlflow: MlflowResource) -> MaterializeResult:
    """The configured family's drafter trained on the window (DeepSpeed, resumable), in the
    engines' format; warm-started from the drafter serving now (the serving ledger)."""
    from pipeline.evaluation.charts import publish_chart, training_curve
    from pipeline.training.curve import CURVE_FILE, display_points
    from pipeline.training.metrics import depth_table

    store, step = storage.build(), step_of(context.partition_key)
    registry = mlflow.build()
    run = training_run(context, mlflow, registry, step)
    with fail_fast_on_permanent_errors():
        r = trainer.refresh(store, step, config.to_core(), warm_start=config.warm_start,
                            serving_name=registry.model_name, on_line=context.log.info,
                            observer=run)
    res, meta = r.result, r.manifest.meta
    context.log.info(f"{r.uri}: {res.steps} steps, loss {res.final['loss']:.4f}, simulated "
                     f"acceptance {res.final['sim_accept_length']:.3f}"
                     + (" (already committed)" if r.reused else ""))
    curve = run_chart(mlflow, registry.runs, run.run_id, run.charts, "training_curve",
                      publish_chart(store, step, "training_curve",
                                    training_curve(display_points(r.curve, 1000))))
    details = {
        "stored at": r.uri, "reused (committed before)": r.reused,
        "fingerprint": meta["fingerprint"],
        "vocab cache key": meta["vocab_cache_key"], "vocab coverage": round(meta["coverage"], 4),
        "draft vocab size": meta["draft_vocab_size"], "aux layer ids": meta["aux_layer_ids"],
        "warm start": res.warm_start["reason"], "epochs": round(res.epochs, 3),
        "resumed from step": res.resumed_from_step, "world size": res.world_size,
        "ZeRO stage": res.zero_stage, "dtype": res.dtype, "logged steps": len(r.curve),
        "training curve data": f"{r.uri}/{CURVE_FILE}"}
    return MaterializeResult(metadata={  # the numbers that matter first, rounded
        "algorithm": config.drafter_algorithm,
        "final_loss": round(res.final["loss"], 4), "first_loss": round(res.first["loss"], 4),
        "sim_accept_length": round(res.final["sim_accept_length"], 3),
        "warm_start": res.warm_start["mode"],
        "warm_start_source": res.warm_start["source"] or "none",
        "steps": res.steps, "samples": res.samples, "tokens_trained": res.tokens_trained,
        "tokens_per_s": round(res.tokens_per_s, 1), "seconds": round(res.seconds, 2),
        "training_curve": curve,
        **({"mlflow_run": MetadataValue.url(mlflow.run_link(
            registry.runs.experiment_id(), run.run_id))} if run.run_id else {}),
        "per_depth": _md_table(depth_table(res.final)),
        "window_steps": MetadataValue.json(meta["window_steps"]),
        "fingerprint": meta["fingerprint"][:12],  # in full in details
        "details": MetadataValue.md(details_table(details)),
    }, check_results=[_loss_check(res, r.curve)])


def training_run(context: AssetExecutionContext, mlflow: MlflowResource, registry, step: int):
    """The MLflow run that lasts as long as this training, linked to the Dagster run."""
    from pipeline.evaluation.charts import training_curve
    from pipeline.release.training_run import MlflowTrainingRun
    from pipeline.training.curve import display_points

    run_id = context.run.run_id
    return MlflowTrainingRun(
        registry.runs, run_name=f"drafter-step-{step:06d}",
        chart=lambda curve: training_curve(display_points(curve, 1000)),
        tags={"mlflow.source.name": f"dagster {context.job_name} / {context.asset_key.path[-1]}",
              "mlflow.source.type": "JOB", "mlflow.user": mlflow.user(),
              "dagster.run_id": run_id, "dagster.partition": context.partition_key,
              "dagster.run_url": mlflow.dagster_run_link(run_id),
              # the run's description, which MLflow renders as Markdown: a link back
              "mlflow.note.content": f"Trained by Dagster run [{run_id[:8]}]"
                                     f"({mlflow.dagster_run_link(run_id)}), partition "
                                     f"{context.partition_key}."})


def _loss_check(res, curve):
    """ERROR (blocks evaluation) on a non-finite loss anywhere on the curve; only a WARN
    when it merely did not fall: a warm-started drafter on familiar data may plateau and the
    gate still judges it."""
    outcome = training_loss(res.first["loss"], res.final["loss"], [h["loss"] for h in curve])
    return result("training_loss", outcome, AssetCheckSeverity.WARN
                  if outcome.metadata["finite"] else AssetCheckSeverity.ERROR)
