"""``rollout_snapshot``: one RL step's rollouts, validated, with bad records quarantined."""


from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    MaterializeResult,
    MetadataValue,
    asset,
)

from assets.partitions import rl_steps, step_of
from assets.retry import SERVICE_RETRY, fail_fast_on_permanent_errors
from assets.versions import CODE_VERSIONS
from resources.storage import StorageResource

MAX_QUARANTINE_RATIO = 0.05


@asset(
    partitions_def=rl_steps,
    code_version=CODE_VERSIONS["rollout_snapshot"],
    group_name="data",
    kinds={"parquet"},
    retry_policy=SERVICE_RETRY,
    check_specs=[AssetCheckSpec("quarantine_ratio", asset="rollout_snapshot",
                                description=f"at most {MAX_QUARANTINE_RATIO:.0%} of records "
                                            "quarantined, and at least one accepted")],
)
def rollout_snapshot(context: AssetExecutionContext, storage: StorageResource):
    """Validated rollouts of one RL step plus the policy checkpoint that generated them."""
    from pipeline.snapshot import stage as snapshot_stage
    from pipeline.snapshot.schema import ROLLOUT_SCHEMA_VERSION

    with fail_fast_on_permanent_errors():
        store = storage.build()
        summary = snapshot_stage.run(store, step_of(context.partition_key))
    ratio = summary.quarantined / max(summary.records_in, 1)
    reasons = "\n".join(f"| {_cell(r)} | {n} |" for r, n in sorted(summary.reasons.items()))
    yield MaterializeResult(
        metadata={
            "uri": MetadataValue.path(summary.url),
            "records": summary.records_in,
            "accepted": summary.accepted,
            "quarantined": summary.quarantined,
            "quarantine_reasons": MetadataValue.md(
                "| reason | records |\n|---|---|\n" + reasons if reasons else "none"),
            "tokens": summary.tokens,
            "policy_uri": MetadataValue.path(store.url(summary.policy_uri)),
            "schema_version": ROLLOUT_SCHEMA_VERSION,
            "dagster/row_count": summary.accepted,
        },
        check_results=[AssetCheckResult(
            check_name="quarantine_ratio",
            passed=summary.accepted > 0 and ratio <= MAX_QUARANTINE_RATIO,
            severity=AssetCheckSeverity.WARN,
            metadata={"quarantine_ratio": ratio, "accepted": summary.accepted})],
    )


def _cell(text: str) -> str:
    """A markdown table cell: record-supplied text (field names) cannot break the table."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ").replace("\r", " ")
