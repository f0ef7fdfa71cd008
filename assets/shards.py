"""``hidden_state_shards``: the target's hidden states of one RL step's tokenized samples (the
layers the configured drafter algorithm reads)."""


from dagster import AssetExecutionContext, Config, MaterializeResult, MetadataValue, asset
from pydantic import Field

from assets.checks import result, spec
from assets.partitions import rl_steps, step_of
from assets.retry import SERVICE_RETRY, fail_fast_on_permanent_errors
from assets.versions import CODE_VERSIONS
from pipeline.capture.config import ExtractConfig
from pipeline.capture.provenance import Encoding
from pipeline.checks import shard_integrity
from resources.capture import CaptureResource
from resources.storage import StorageResource

_E = ExtractConfig()


class ShardsConfig(Config):
    """Run config of ``hidden_state_shards``; mirrors :class:`ExtractConfig` field by field.

    Which backend captures the states is the ``capture`` resource's business.
    """

    token_budget: int = Field(default=_E.token_budget,
                              description="max padded tokens (batch × longest) per forward")
    max_batch_size: int = Field(default=_E.max_batch_size, description="max samples per forward")
    shard_bytes: int = Field(default=_E.shard_bytes,
                             description="bf16 state bytes per shard before compression")
    row_group_bytes: int = Field(default=_E.row_group_bytes,
                                 description="state bytes per Parquet row group (read unit)")
    compression: str = Field(default=_E.compression,
                             description="Parquet codec: zstd (smaller) or none (faster)")
    sort_by_length: bool = Field(default=_E.sort_by_length,
                                 description="batch a shard's samples longest first")
    heldout_fraction: float = Field(default=_E.heldout_fraction,
                                    description="share of prompts held out for evaluation "
                                                "(never trained on)")
    encoding: Encoding = Field(default=_E.encoding,
                               description="how states are stored: bfloat16, fp8-aux (aux "
                                           "states as float8 e4m3 with a per-token scale) "
                                           "or fp8 (final states too: ~0.5x the bytes)")

    def to_core(self) -> ExtractConfig:
        return ExtractConfig(
            token_budget=self.token_budget, max_batch_size=self.max_batch_size,
            shard_bytes=self.shard_bytes, row_group_bytes=self.row_group_bytes,
            compression=self.compression, sort_by_length=self.sort_by_length,
            heldout_fraction=self.heldout_fraction, encoding=self.encoding)


@asset(partitions_def=rl_steps, group_name="data", kinds={"parquet", "pytorch"},
       code_version=CODE_VERSIONS["hidden_state_shards"], deps=["tokenized_rollouts"],
       retry_policy=SERVICE_RETRY,
       check_specs=[spec("hidden_state_shards", "shard_integrity",
                         "every shard re-hashed matches its manifest (size, sha256)",
                         blocking=True)])
def hidden_state_shards(context: AssetExecutionContext, config: ShardsConfig,
                        storage: StorageResource, capture: CaptureResource) -> MaterializeResult:
    """Aux-layer and post-norm final states per token, captured with the step's own policy."""
    from pipeline.capture import parallel
    from pipeline.snapshot.policy import load_policy_ref

    store, step = storage.build(), step_of(context.partition_key)
    with fail_fast_on_permanent_errors():
        policy = load_policy_ref(store, step)
        with capture.open(store, step, config.token_budget) as backend:
            s = parallel.run(store, step, backend, config.to_core(), policy=policy,
                             processes=capture.processes,
                             open_args=capture.open_args(config.token_budget))
        integrity = shard_integrity(store, step)
    context.log.info(f"step {step}: {s.shards} shards ({s.shards_reused} kept), "
                     f"{s.backend_calls} backend calls, {s.seconds:.1f}s")
    return MaterializeResult(metadata={
        "uri": MetadataValue.path(s.url),
        "samples": s.samples,
        "heldout_samples": s.heldout,
        "tokens": s.tokens,
        "loss_tokens": s.loss_tokens,
        "padded_tokens": s.padded_tokens,
        "shards": s.shards,
        "shards_reused": s.shards_reused,
        "bytes": s.bytes,
        "bytes_per_token": round(s.bytes_per_token, 2),
        "aux_layer_ids": MetadataValue.json(list(s.aux_layer_ids)),
        "hidden_size": s.hidden_size,
        "schema_version": s.schema_version,
        "backend": capture.backend,
        "processes": s.processes,
        "provenance": MetadataValue.json(s.provenance),
        "policy_uri": MetadataValue.path(policy.uri),
        "seconds": round(s.seconds, 3),
        "dagster/row_count": s.samples,
    }, check_results=[result("shard_integrity", integrity)])
