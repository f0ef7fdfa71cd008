"""Broken promotions on the demo world, rolled back by the post-promotion check:

- ``manifest`` mode: the refresh at step 1 promotes v1; the trainer's engine then reports
  that every verify pass with v1 emitted only its bonus token (τ = 1, as with a drafter
  loaded with a wrong ``d2t``). ``serving_acceptance`` of step 2 judges v1 broken, rolls it
  back (no drafter serves again) and fails its check.
- ``sglang-restart`` mode: the restart "succeeds" but the server probed afterwards decodes
  without speculation (the contract server, serving the step's policy); ``serving_drafter``
  rolls the promotion back at once and fails its check.
The healthy promotion left alone is in test_drift_loop (v1 verified healthy at step 6).
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from dagster import AssetCheckKey, AssetKey, DagsterInstance

from aerie import cli
from aerie.demo import RefreshLoop, asset_events, reported_records
from pipeline.demo.config import DemoConfig
from pipeline.demo.world import StepOutput, generate_world
from pipeline.monitor.stage import EVIDENCE_TAG, VERDICT_TAG, VERIFY_ACTOR
from pipeline.release.mlflow_registry import CHAMPION
from pipeline.release.promotion import ROLLED_BACK
from pipeline.serving_now import read_serving
from pipeline.snapshot.writer import SnapshotWriter
from pipeline.storage import Storage
from resources.mlflow import mlflow_from_environment
from resources.refresh import RefreshPolicyResource
from tests.e2e.loop import TRAIN, home_env
from tests.sglang_contract import fixtures

pytestmark = pytest.mark.e2e

WORLD = DemoConfig.small(num_steps=3, prompts_per_step=6)  # 6 rollouts with counters a step
POLICY = RefreshPolicyResource(every=2, window=2)  # one refresh, at step 1


def _bonus_only(records: list[dict]) -> list[dict]:
    """What an engine serving v1 with a wrong ``d2t`` reports: no draft accepted."""
    for r in records:
        if r.get("speculative"):
            r["speculative"]["completion_tokens"] = r["speculative"]["verify_ct"] + 1
    return records


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> tuple[Path, list[StepOutput]]:
    """The demo world, generated once (~8 s; seeded, so each test would generate the same
    one): its directory and the trainer's steps."""
    outputs = []
    directory = tmp_path_factory.mktemp("world") / "demo-world"
    generate_world(WORLD, directory, outputs.append, progress=False)
    return directory, outputs


def _world(home, world) -> list[StepOutput]:
    """A copy of ``world`` in ``home`` (a test's own), and its steps pointing there."""
    cli.prepare_dagster_home()
    directory, outputs = world
    shutil.copytree(directory, home / "demo-world")
    return [replace(out, policy_dir=home / "demo-world" / out.policy_dir.relative_to(directory),
                    records=copy.deepcopy(out.records)) for out in outputs]


def _run(home, outputs, refresh_config: dict, plant=lambda records: records):
    storage = Storage((home / "storage").as_uri())
    writer = SnapshotWriter(storage)
    loop = RefreshLoop(DagsterInstance.get(), policy=POLICY,
                       refresh_config=lambda step: refresh_config)
    for out in outputs:
        records = reported_records(out, storage, WORLD.max_new_tokens, prompts=6)
        writer.write_step(out.step, plant(records), out.policy_dir, out.policy_version,
                          sampling=out.sampling)
        loop.after_step()
    return loop.instance, storage


def _check(instance):
    """The evaluations of ``serving_drafter``'s ``promotion_verified``, newest first."""
    history = instance.event_log_storage.get_asset_check_execution_history(
        AssetCheckKey(AssetKey("serving_drafter"), "promotion_verified"), limit=50)
    return [h.evaluation for h in history if h.status.value in ("SUCCEEDED", "FAILED")]


def _meta(instance, asset: str, partition: str) -> dict:
    """The newest event (materialization or observation) of ``asset`` on ``partition``."""
    events = asset_events(instance, asset, partition)
    assert events, f"no {asset} event for {partition}"
    return events[0][1]


def test_manifest_mode_rolls_back_on_what_the_trainer_reports(world, tmp_path):
    home = tmp_path / "home"
    with home_env(home):
        instance, storage = _run(home, _world(home, world), TRAIN, plant=_bonus_only)
        registry = mlflow_from_environment()
        actions = [r.asset_materialization.metadata["action"].value for r in
                   instance.fetch_materializations(AssetKey("serving_drafter"), limit=9).records]
        assert actions == ["rolled_back", "promoted"]  # newest first: the gate's, then ours
        (check,) = _check(instance)  # reported by serving_acceptance, on v1's refresh
        assert check.partition == "step-000001" and not check.passed
        assert "v1 broken after promotion" in check.description
        assert check.metadata["verdict"].value == "broken"
        assert read_serving(storage, registry.model_name).target is None  # no drafter again
        assert registry.alias(CHAMPION) is None
        tags = registry.get_version("1").tags
        assert tags[VERDICT_TAG] == "broken"
        assert json.loads(tags[ROLLED_BACK])["by"] == VERIFY_ACTOR
        event = _meta(instance, "serving_drafter", "step-000001")  # the rollback's event
        assert (event["action"], event["champion"]) == ("rolled_back", "none")


def test_sglang_restart_mode_rolls_back_when_the_servers_do_not_speculate(world, tmp_path):
    home = tmp_path / "home"
    work = tmp_path / "server"
    work.mkdir()
    policy = home / "demo-world" / "policy" / "step-000001"
    with home_env(home):
        outputs = _world(home, world)
    with home_env(home), fixtures.contract_process(
            work, policy, {"plain": {"mode": "final"}}, lambda: None) as servers:
        serving = {"resources": {"serving": {"config": {
            "mode": "sglang-restart", "restart_command": ["true"],
            "no_drafter_command": ["true"], "server_urls": [servers["plain"].url]}}}}
        instance, storage = _run(home, outputs, {**TRAIN, **serving})
        registry = mlflow_from_environment()
        event = _meta(instance, "serving_drafter", "step-000001")
        assert event["action"] == "rolled_back" and event["champion"] == "none"
        # serving is where it was before the refresh: its partition is not materialized
        assert not instance.get_materialized_partitions(AssetKey("serving_drafter"))
        (check,) = _check(instance)
        assert not check.passed and "do not speculate as served" in check.description
        assert read_serving(storage, registry.model_name).target is None
        evidence = json.loads(registry.get_version("1").tags[EVIDENCE_TAG])
        assert evidence["source"] == "live"
