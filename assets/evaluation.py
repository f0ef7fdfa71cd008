"""``acceptance_eval``: how many tokens per target forward the new drafter buys, measured.

Partition = the refresh step s (``refresh_steps``). Candidate = the drafter of s; champion =
the drafter serving now (the serving record, :mod:`pipeline.serving_now`: the same record
training's warm start and promotion read) unless the run config names another or none; both
are measured with the policy of s on held-out prompts, next to no drafter. The charts (α per
draft position, τ over refresh steps) are stored next to the report and linked.
"""

import functools

from dagster import AssetExecutionContext, Config, MaterializeResult, MetadataValue, asset
from pydantic import Field

from assets.charts import logged_chart
from assets.checks import result, spec
from assets.details import details_table
from assets.drafter import WINDOW_NOTE
from assets.partitions import refresh_steps, step_of
from assets.retry import SERVICE_RETRY, fail_fast_on_permanent_errors
from assets.versions import CODE_VERSIONS
from pipeline.checks import evaluation_sound
from pipeline.evaluation.config import Device, Dtype, EvalConfig
from pipeline.evaluation.evaluators import label
from pipeline.layout import drafter_prefix
from pipeline.release.mlflow_registry import model_name
from pipeline.serving_now import serving_drafter_key
from resources.evaluator import EvaluatorResource
from resources.mlflow import MlflowResource
from resources.serving import ServingResource
from resources.storage import StorageResource

_E = EvalConfig()


class EvalRunConfig(Config):
    """Run config of ``acceptance_eval``; mirrors :class:`EvalConfig` plus the champion."""

    max_prompts: int = Field(default=_E.max_prompts, description="held-out prompts (at most)")
    max_new_tokens: int = Field(default=_E.max_new_tokens, description="tokens per prompt")
    num_steps: int | None = Field(default=None, description="--speculative-num-steps (unset: "
                                                            "the serving resource's settings)")
    eagle_topk: int | None = Field(default=None, description="--speculative-eagle-topk")
    num_draft_tokens: int | None = Field(default=None,
                                         description="--speculative-num-draft-tokens")
    reference_prompts: int = Field(default=_E.reference_prompts,
                                   description="prompts (the longest) also decoded by the "
                                               "independent cache-free greedy reference")
    champion: str = Field(default="serving", description="serving (the drafter serving now; "
                                                         "'registry' is the old name) | none "
                                                         "| a storage prefix")
    temperature: float | None = Field(
        default=None, description="sampler temperature (unset: what the newest rollout "
                                  "snapshot records; 0: greedy)")
    top_p: float | None = Field(default=None, description="sampler top_p (unset: recorded)")
    top_k: int | None = Field(default=None, description="sampler top_k, -1 for all (unset: "
                                                        "recorded)")
    min_p: float | None = Field(default=None, description="sampler min_p (unset: recorded; "
                                                          "SGLang's verification ignores it)")
    seed: int = Field(default=_E.seed, description="seeds the draws of a sampled evaluation")
    device: Device = Field(
        default=_E.device, description="where the target and drafters run (auto: CUDA when "
                                       "present)")
    dtype: Dtype = Field(
        default=_E.dtype, description="bfloat16: near-ties tolerated, see docs/concepts/"
                                       "acceptance.md, Where it runs")
    confidence: float = Field(default=_E.confidence,
                              description="level of the bootstrap intervals of τ")

    def to_core(self, serving: ServingResource) -> EvalConfig:
        """Unset speculative settings are the ones the servers run (the serving resource)."""
        given = (self.num_steps, self.eagle_topk, self.num_draft_tokens)
        if all(v is None for v in given):
            given = (serving.num_steps, serving.topk, serving.num_draft_tokens)
        return EvalConfig(max_prompts=self.max_prompts, max_new_tokens=self.max_new_tokens,
                          num_steps=given[0], eagle_topk=given[1], num_draft_tokens=given[2],
                          reference_prompts=self.reference_prompts,
                          temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                          min_p=self.min_p, seed=self.seed, device=self.device,
                          dtype=self.dtype, confidence=self.confidence)


@asset(partitions_def=refresh_steps, group_name="drafter", kinds={"pytorch"},
       code_version=CODE_VERSIONS["acceptance_eval"], deps=["drafter_checkpoint"],
       retry_policy=SERVICE_RETRY,
       description="τ and α of the candidate, the serving champion and no drafter on held-out "
                   "prompts of the window; charts linked from the metadata. " + WINDOW_NOTE,
       check_specs=[spec("acceptance_eval", "acceptance_lossless",
                         "every drafter's greedy outputs equal no drafter's on the checked "
                         "prompts (all held-out prompts when greedy, the reference sample "
                         "when sampled) and the cache-free reference's on the reference "
                         "sample (bf16: near-ties counted), and τ was measured; blocks "
                         "registration and promotion",
                         blocking=True)])
def acceptance_eval(context: AssetExecutionContext, config: EvalRunConfig,
                    storage: StorageResource, mlflow: MlflowResource,
                    serving: ServingResource, evaluator: EvaluatorResource
                    ) -> MaterializeResult:
    """τ and α of the candidate, the serving champion and no drafter on held-out prompts."""
    from pipeline.evaluation import stage as evaluation_stage
    from pipeline.evaluation.charts import alpha_chart, publish_chart, tau_curve

    store, step = storage.build(), step_of(context.partition_key)
    with fail_fast_on_permanent_errors():
        champion = (serving_drafter_key(store, model_name(mlflow.target_family))
                    if config.champion in ("serving", "registry")
                    else None if config.champion == "none" else config.champion)
        r = evaluation_stage.run(store, step, drafter_prefix(step), champion,
                                 config.to_core(serving), evaluator.build())
    s = r.summary()
    context.log.info(f"step {step} ({r.regime}, {r.evaluator_kind}): " + ", ".join(
        f"{k} {v:.3f}" for k, v in s.items() if k.endswith("_tau")))
    alphas = {n: c.acceptance.alpha for n, c in r.contestants.items() if n != "no_drafter"}
    alpha_png = alpha_chart(alphas, f"step {step}: α per draft position")
    tau_png = tau_curve(evaluation_stage.tau_history(store, r.comparable_key),
                        f"τ of the candidate and champion at each refresh ({r.regime})")
    @functools.cache
    def candidate_run():  # the run that trained the candidate holds its charts
        runs = mlflow.build().runs
        return runs, runs.find_run(r.contestants["candidate"].fingerprint)

    def chart(name: str, short: str, png: bytes) -> MetadataValue:
        return logged_chart(mlflow, candidate_run, name, png,
                            publish_chart(store, step, short, png), context.log)

    matches = {k: v for k, v in s.items() if k.endswith("_match")}
    details = {**matches, "settings": r.settings, "sampler": r.sampler,
               "sampler source": r.sampler_source, "sampler key": r.sampler_key,
               "seed": r.seed, "held-out key": r.heldout_key, "settings key": r.settings_key}
    return MaterializeResult(metadata={  # τ of each contestant first, rounded
        **{k: _readable(v) for k, v in s.items() if k not in matches},
        "champion": champion_name(store, mlflow, champion),
        "evaluator": label(r.evaluator),
        "window_steps": MetadataValue.json(list(r.heldout["window_steps"])),
        "acceptance_per_position": chart("acceptance_per_position", "alpha", alpha_png),
        "tau_over_rl_steps": chart("offline_tau_over_rl_steps", "tau", tau_png),  # the
        # run's tau_over_rl_steps.png is the loop chart (serving_drafter)
        "seconds": round(r.seconds, 2),
        "details": MetadataValue.md(details_table(details))},
        check_results=[result("acceptance_lossless", evaluation_sound(r))])


def _readable(value):
    """τ to 3 decimals, α lists to 3 (the report keeps every digit)."""
    if isinstance(value, list):
        return MetadataValue.json([round(v, 3) if isinstance(v, float) else v for v in value])
    return round(value, 3) if isinstance(value, float) else value


def champion_name(store, mlflow: MlflowResource, champion: str | None) -> str:
    """The champion measured, named as everywhere (``v<version> (<fingerprint>)``) when it
    is the drafter serving now, else its storage prefix."""
    from pipeline.serving_now import read_serving

    if champion is None:
        return "none"
    serving = read_serving(store, model_name(mlflow.target_family))
    target = serving.target if serving else None
    if target is not None and store.key_of(target.drafter_uri) == champion:
        return target.name
    return champion
