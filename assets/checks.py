"""Asset checks of the refresh stages: specs declared next to each asset, results computed by
:mod:`pipeline.checks` and reported from the asset body (so they are partition-aware and run
in the same step as the materialization they judge).

Blocking checks (``shard_integrity``, ``training_loss`` on a non-finite loss,
``acceptance_lossless``) fail the step with ERROR severity, and Dagster then skips every
downstream asset of the same run: a diverged drafter is not evaluated, and an evaluation that
is not lossless never reaches registration or promotion. ``hidden_state_shards`` is the last
asset of its run, so shards that rot later are caught where they are read: training re-hashes
its window and refuses damaged files, and re-running the step's ingest re-extracts exactly
those (:func:`pipeline.capture.stage.run`).
"""

from dagster import AssetCheckResult, AssetCheckSeverity, AssetCheckSpec

from pipeline.checks import CheckOutcome


def spec(asset: str, name: str, description: str, blocking: bool = False) -> AssetCheckSpec:
    return AssetCheckSpec(name, asset=asset, description=description, blocking=blocking)


def result(name: str, outcome: CheckOutcome,
           severity: AssetCheckSeverity = AssetCheckSeverity.ERROR) -> AssetCheckResult:
    return AssetCheckResult(check_name=name, passed=outcome.passed, severity=severity,
                            description=outcome.description, metadata=outcome.metadata)
