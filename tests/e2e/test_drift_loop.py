"""The closed loop on the demo world: the trainer reports the acceptance its speculative
generation had with the serving drafter, ``serving_acceptance`` turns it into τ per RL step,
and when the policy's training goes unstable (the drift world, tests/e2e/loop.py) the drift
sensor asks for a refresh at once, before the fixed cadence would, and only once."""

from __future__ import annotations

import json
import os

import pytest
from dagster import AssetKey

from bench.closed_loop import DRIFT_POLICY, ClosedLoop, run
from jobs.refresh import due_refresh
from pipeline.evaluation.stage import read_report
from pipeline.monitor.observed import observed_series
from tests.e2e.loop import home_env

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def drift(tmp_path_factory) -> ClosedLoop:
    home = tmp_path_factory.mktemp("drift") / "home"
    with home_env(home):
        yield run(home)


def _meta(loop: ClosedLoop, asset: str, partition: str) -> dict:
    for r in loop.instance.fetch_materializations(AssetKey(asset), limit=100).records:
        if r.asset_materialization.partition == partition:
            return {k: v.value for k, v in r.asset_materialization.metadata.items()}
    raise AssertionError(f"no materialization of {asset} for {partition}")


def test_drift_refreshes_before_the_cadence_would_and_once(drift):
    assert drift.triggers == {"step-000005": "cadence", "step-000008": "drift"}
    # the cadence alone would not have refreshed again through the last step (10)
    assert due_refresh(list(range(11)), 5, DRIFT_POLICY.every) is None
    fired = [step for step, tick in drift.drift_ticks if tick == "run"]
    assert fired == [8]
    after = dict((step, tick) for step, tick in drift.drift_ticks if step > 8)
    assert "fired already for this drop" in after[9], after  # still low: no second refresh


def test_observed_tau_follows_the_serving_drafter(drift):
    """Before the instability the RL engine sees about the τ the gate measured offline; at
    step 8 it has fallen by more than the drift threshold."""
    promoted = read_report(drift.storage, 5).contestants["candidate"].tau
    series = {o.step: o.of("1") for o in observed_series(drift.storage)}
    assert all(series[s] is None for s in range(6))  # nothing served before the refresh
    for step in (6, 7):
        assert abs(series[step].tau / promoted - 1) < DRIFT_POLICY.max_tau_drop_percent / 100
    assert series[8].tau < promoted * (1 - DRIFT_POLICY.max_tau_drop_percent / 100)
    assert series[8].verify_ct >= DRIFT_POLICY.drift_min_cycles


def test_every_step_has_its_serving_acceptance_and_the_chart(drift):
    for step in range(11):
        meta = _meta(drift, "serving_acceptance", f"step-{step:06d}")
        assert meta["rollouts"] == 32
        assert meta["with_counters"] == (8 if step >= 6 else 0)
        if meta["with_counters"]:  # a drafter serves: the chart is on its MLflow run's page
            assert meta["chart"].startswith(os.environ["AERIE_MLFLOW_UI_URL"] + "/#/")
            assert "/artifactPath/charts/tau_over_rl_steps.png" in meta["chart"]
        else:  # none serves yet: the stored copy
            assert meta["chart"].endswith("tau_over_rl_steps.png")
    assert _meta(drift, "serving_acceptance", "step-000006")["tau_v1"] > 1.0
    png = drift.storage.read_bytes("observed/step=000010/tau_over_rl_steps.png")
    assert png.startswith(b"\x89PNG")


def test_the_healthy_promotion_was_verified_and_left_alone(drift):
    """In ``manifest`` mode v1 is judged on what the trainer reported with it (step 6 on):
    healthy, so it kept serving until the drift refresh."""
    from pipeline.monitor.stage import EVIDENCE_TAG, VERDICT_TAG
    from pipeline.release.promotion import ROLLED_BACK
    from resources.mlflow import mlflow_from_environment

    tags = mlflow_from_environment().get_version("1").tags
    assert tags[VERDICT_TAG] == "healthy"
    assert json.loads(tags[EVIDENCE_TAG])["source"] == "reported"
    assert ROLLED_BACK not in tags
