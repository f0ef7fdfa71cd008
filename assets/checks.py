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
    if not outcome.established:
        raise ValueError(f"check {name} has no result yet ({outcome.description}): report it "
                         "through established()")
    return AssetCheckResult(check_name=name, passed=bool(outcome.passed), severity=severity,
                            description=outcome.description, metadata=outcome.metadata)


def established(context, **checks: tuple[CheckOutcome, AssetCheckSeverity]
                ) -> list[AssetCheckResult]:
    """The results of ``checks`` (name: outcome, severity) that were established. A check
    not established (a verification pending, nothing to verify) gets no result, so Dagster
    shows it not evaluated (skipped) rather than green; the log says why."""
    out, selected = [], {key.name for key in context.selected_asset_check_keys}
    for name, (outcome, severity) in checks.items():
        if name not in selected:  # a subset run (can_subset) that left the check out
            continue
        if outcome.established:
            out.append(result(name, outcome, severity))
        else:
            context.log.info(f"check {name}: not evaluated: {outcome.description}")
    return out
