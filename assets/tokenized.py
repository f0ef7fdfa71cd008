"""``tokenized_rollouts``: input_ids + loss_mask per sample of one RL step's snapshot."""


from dagster import AssetExecutionContext, Config, MaterializeResult, MetadataValue, asset
from pydantic import Field

from assets.partitions import rl_steps, step_of
from assets.retry import SERVICE_RETRY, fail_fast_on_permanent_errors
from assets.versions import CODE_VERSIONS
from pipeline.tokenize.config import TokenizeConfig
from resources.storage import StorageResource

_T = TokenizeConfig()


class TokenizeRunConfig(Config):
    """Run config of ``tokenized_rollouts``; mirrors :class:`TokenizeConfig` field by field."""

    max_length: int = Field(default=_T.max_length,
                            description="longest sample in tokens; longer ones are cut")
    keep_tail: int = Field(default=_T.keep_tail,
                           description="when cutting, at least this many tokens ending at the "
                                       "response's last masked token are kept; the prompt "
                                       "head gets the rest (= max_length: keep only the end)")
    min_response_tokens: int = Field(default=_T.min_response_tokens,
                                     description="drop samples with fewer masked tokens")
    rows_per_file: int = Field(default=_T.rows_per_file,
                               description="samples per Parquet part")
    end_of_turn_tokens: list[str] = Field(
        default_factory=list,
        description="special tokens closing an assistant turn; empty: the tokenizer's EOS "
                    "plus known closers (<|eot_id|>, <|im_end|>, ...) in its vocab")
    max_examples: int = Field(default=_T.max_examples,
                              description="example sample ids per problem kind in metadata")

    def to_core(self) -> TokenizeConfig:
        return TokenizeConfig(
            max_length=self.max_length, keep_tail=self.keep_tail,
            min_response_tokens=self.min_response_tokens, rows_per_file=self.rows_per_file,
            end_of_turn_tokens=tuple(self.end_of_turn_tokens), max_examples=self.max_examples)


def _table(counts: dict[str, int], what: str) -> MetadataValue:
    rows = "\n".join(f"| {k} | {n} |" for k, n in sorted(counts.items()))
    return MetadataValue.md(f"| {what} | samples |\n|---|---|\n{rows}" if rows else "none")


@asset(partitions_def=rl_steps, group_name="data", kinds={"parquet"},
       code_version=CODE_VERSIONS["tokenized_rollouts"], deps=["rollout_snapshot"],
       retry_policy=SERVICE_RETRY)
def tokenized_rollouts(context: AssetExecutionContext, config: TokenizeRunConfig,
                       storage: StorageResource) -> MaterializeResult:
    """Chat-template tokenization with loss masks; exact engine ids win and are cross-checked."""
    from pipeline.tokenize import stage as tokenize_stage
    from pipeline.tokenize.schema import TOKENIZED_SCHEMA_VERSION

    with fail_fast_on_permanent_errors():
        store = storage.build()
        s = tokenize_stage.run(store, step_of(context.partition_key), config.to_core())
    return MaterializeResult(metadata={
        "uri": MetadataValue.path(s.url),
        "records": s.records_in,
        "samples": s.samples,
        "tokens": s.tokens,
        "masked_tokens": s.masked_tokens,
        "truncated": s.truncated,
        "dropped": s.dropped,
        "dropped_reasons": _table(s.dropped_reasons, "reason"),
        "dropped_examples": MetadataValue.json(s.dropped_examples),
        "exact": s.sources.get("exact", 0),
        "retokenized": s.records_in - s.sources.get("exact", 0),
        "sources": _table(s.sources, "source"),
        "retokenize_checked": s.retokenize_checked,
        "retokenize_mismatches": s.retokenize_mismatches,
        "mismatch_examples": MetadataValue.json(s.mismatch_examples),
        "tokenizer_fingerprint": s.tokenizer_fingerprint,
        "policy_uri": MetadataValue.path(store.url(s.policy_uri)),
        "schema_version": TOKENIZED_SCHEMA_VERSION,
        "dagster/row_count": s.samples,
    })
