"""``vocab_mapping`` and ``drafter_checkpoint`` materialized in-process on a test instance."""

from __future__ import annotations

import uuid

import pytest
from dagster import AssetKey, instance_for_test, materialize

from assets.drafter import drafter_checkpoint, vocab_mapping
from assets.groups import REFRESH_ASSETS
from jobs.drafter import drafter_refresh
from pipeline.eagle3.export import read_drafter_config
from pipeline.eagle3.spec import SpecParams
from pipeline.layout import drafter_prefix
from pipeline.manifest import read_manifest, verify_manifest
from pipeline.records import to_dict
from pipeline.release.ledger import ServingLedger
from pipeline.release.lineage import FINGERPRINT
from pipeline.serving_now import ServingTarget
from pipeline.training.curve import CURVE_FILE, read_curve
from resources.mlflow import TRAINING_VIEW, MlflowResource
from resources.refresh import RefreshPolicyResource
from resources.storage import StorageResource
from resources.trainer import TrainerResource

from .conftest import FAST

pytestmark = pytest.mark.integration

TRAIN = {k: v for k, v in to_dict(FAST).items()
         if k not in ("world_size", "zero_stage", "dtype", "device", "threads")}


def run(instance, storage, tmp_path, step: int, assets, family: str = "demo", **vocab):
    key = f"step-{step:06d}"
    instance.add_dynamic_partitions("refresh_steps", [key])
    config = {"vocab_mapping": {"config": {"window": 2, "draft_vocab_size": 64, **vocab}},
              "drafter_checkpoint": {"config": {**TRAIN, "max_steps": 6}}}
    return materialize(
        assets, partition_key=key, instance=instance, raise_on_error=False,
        resources={"storage": StorageResource(url=storage.root_url),
                   "trainer": TrainerResource(work_dir=str(tmp_path / "work"), threads=1,
                                              zero_stage=0),
                   "mlflow": MlflowResource(target_family=family),
                   "refresh": RefreshPolicyResource(window=9)},  # the run config's wins
        run_config={"ops": {a.key.path[-1]: config[a.key.path[-1]] for a in assets}})


def details(meta: dict) -> dict[str, str]:
    """The rows of a ``details`` table: name -> value as shown."""
    rows = [line.strip("| ").split(" | ") for line in meta["details"].splitlines()[2:]]
    return {name: value for name, value in rows}


def metadata(result, name: str) -> dict:
    (event,) = [e for e in result.get_asset_materialization_events()
                if e.asset_key == AssetKey(name)]
    return {k: v.value for k, v in event.materialization.metadata.items()}


@pytest.mark.integration
def test_two_refreshes_train_publish_and_warm_start_with_lineage(storage, tmp_path):
    with instance_for_test() as instance:
        first = run(instance, storage, tmp_path, 2, [vocab_mapping, drafter_checkpoint])
        assert first.success
        ledger = ServingLedger(storage, "aerie-drafter-demo")  # as if the gate promoted it
        ledger.publish(ServingTarget(storage.url(drafter_prefix(2)), "fp", ledger.name, "1"),
                       SpecParams(3, 1, 4), mode="manifest", reason="promoted")
        second = run(instance, storage, tmp_path, 3, [vocab_mapping, drafter_checkpoint])
        assert second.success
        again = run(instance, storage, tmp_path, 3, [vocab_mapping])
        assert instance.get_materialized_partitions(AssetKey("drafter_checkpoint")) == {
            "step-000002", "step-000003"}
    v2, d2 = metadata(first, "vocab_mapping"), metadata(first, "drafter_checkpoint")
    v3, d3 = metadata(second, "vocab_mapping"), metadata(second, "drafter_checkpoint")
    assert v2["window_steps"] == [1, 2] and v3["window_steps"] == [2, 3]
    assert not v3["cache_hit"] and metadata(again, "vocab_mapping")["cache_hit"]
    assert v3["draft_vocab_size"] == 64 and 0.5 < v3["coverage"] <= 1.0
    assert d2["warm_start"] == "scratch" and d2["warm_start_source"] == "none"
    assert d3["warm_start"] == "warm"
    assert "drafters/step=000002" in d3["warm_start_source"]
    more = details(d3)  # the rest of the record, folded into one table
    assert more["stored at"] == storage.url(drafter_prefix(3)) and d3["window_steps"] == [2, 3]
    assert more["vocab cache key"] == details(v3)["cache key"]
    assert float(more["vocab coverage"]) == v3["coverage"]  # both rounded to 4 places
    assert more["fingerprint"].startswith(d3["fingerprint"]) and len(more["fingerprint"]) == 64
    assert d3["steps"] == 6 and d3["tokens_per_s"] > 0 and d3["seconds"] > 0
    assert (more["ZeRO stage"], more["world size"], more["dtype"]) == ("0", "1", "fp32")
    assert "| 2 |" in d3["per_depth"] and "accept length" in d3["per_depth"]
    assert list(d3)[:4] == ["algorithm", "final_loss", "first_loss", "sim_accept_length"]
    assert d3["algorithm"] == "eagle3"
    assert all(len(str(d3[k]).split(".")[-1]) <= 4 for k in ("final_loss", "first_loss"))
    manifest = read_manifest(storage, drafter_prefix(3))
    assert not verify_manifest(storage, drafter_prefix(3), manifest)
    assert {f.path for f in manifest.files} == {"config.json", "model.safetensors", CURVE_FILE}
    assert [e["step"] for e in read_curve(storage, drafter_prefix(3), manifest)] == list(
        range(1, 7))  # every step, not the manifest's display points
    assert more["logged steps"] == "6"
    assert more["training curve data"] == f"{more['stored at']}/{CURVE_FILE}"
    assert manifest.meta["warm_start"]["mode"] == "warm"
    assert set(manifest.meta["shard_manifest_sha256"]) == {"2", "3"}
    local = storage.local_path(drafter_prefix(3))
    assert read_drafter_config(local).draft_vocab_size == 64


def test_the_mlflow_run_lasts_as_long_as_the_training(storage, tmp_path):
    """Opened before training, every step's metrics, closed after the drafter is committed
    with the curve chart and the drafter; linked both ways with the Dagster run."""
    family = f"runs-{uuid.uuid4().hex[:8]}"  # its own experiment: no run of this drafter yet
    with instance_for_test() as instance:
        result = run(instance, storage, tmp_path, 2, [vocab_mapping, drafter_checkpoint],
                     family)
        assert result.success
    meta = metadata(result, "drafter_checkpoint")
    registry = MlflowResource(target_family=family).build()
    fingerprint = details(meta)["fingerprint"]  # in full there; the headline shows 12
    (found,) = registry.client.search_runs(
        [registry.runs.experiment_id()], f"tags.{FINGERPRINT} = '{fingerprint}'")
    info, tags = found.info, found.data.tags
    assert info.status == "FINISHED"
    assert (info.end_time - info.start_time) / 1000 >= meta["seconds"]  # the whole training
    losses = registry.client.get_metric_history(info.run_id, "train/loss")
    assert sorted(m.step for m in losses) == list(range(1, 7))
    assert tags["dagster.run_id"] == result.run_id
    assert tags["dagster.run_url"] == f"http://127.0.0.1:3000/runs/{result.run_id}"
    assert tags["mlflow.source.name"].startswith("dagster ") and tags["mlflow.user"]
    assert f"[{result.run_id[:8]}](http://127.0.0.1:3000/runs/{result.run_id})" in tags[
        "mlflow.note.content"]  # the run's description links back
    charts = [a.path for a in registry.client.list_artifacts(info.run_id, "charts")]
    assert charts == ["charts/training_curve.png"]
    assert meta["mlflow_run"].endswith(f"/runs/{info.run_id}?{TRAINING_VIEW}")
    experiment = registry.client.get_experiment(info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"


def test_the_window_defaults_to_the_refresh_resources_k(storage):
    with instance_for_test() as instance:
        instance.add_dynamic_partitions("refresh_steps", ["step-000003"])
        result = materialize(
            [vocab_mapping], partition_key="step-000003", instance=instance,
            resources={"storage": StorageResource(url=storage.root_url),
                       "refresh": RefreshPolicyResource(window=1)},
            run_config={"ops": {"vocab_mapping": {"config": {"draft_vocab_size": 64}}}})
    assert metadata(result, "vocab_mapping")["window_steps"] == [3]


def test_missing_inputs_fail_the_assets_with_named_steps(storage, tmp_path):
    with instance_for_test() as instance:
        result = run(instance, storage, tmp_path, 3, [vocab_mapping], window=5)
        assert not result.success
        (failure,) = result.get_step_failure_events()
        assert "step(s) [0]" in failure.event_specific_data.error.to_string()
        result = run(instance, storage, tmp_path, 2, [drafter_checkpoint])
        assert not result.success
        (failure,) = result.get_step_failure_events()
        assert "materialize vocab_mapping" in failure.event_specific_data.error.to_string()


def test_the_two_jobs_split_the_assets_by_partitioning():
    """ingest_step and drafter_refresh together cover every asset of the definitions exactly
    once; every refresh asset is partitioned by refresh step, every data asset by RL step."""
    from definitions import defs
    from jobs.snapshots import ingest_step

    graph = defs.get_repository_def().asset_graph
    every = set(graph.get_all_asset_keys())
    jobs = [defs.resolve_job_def(j.name) for j in (ingest_step, drafter_refresh)]
    selected = [set(job.asset_layer.executable_asset_keys) for job in jobs]
    assert selected[0] | selected[1] == every and not selected[0] & selected[1]
    for job, keys, partitions in zip(jobs, selected, ("rl_steps", "refresh_steps"),
                                     strict=True):
        assert job.partitions_def.name == partitions
        assert {graph.get(k).partitions_def.name for k in keys} == {partitions}, job.name
    for key in every:  # the groups agree: drafter + release are the refresh
        node = graph.get(key)
        refresh = node.group_name in ("drafter", "release")
        assert node.partitions_def.name == ("refresh_steps" if refresh else "rl_steps"), key
        assert (key.to_user_string() in REFRESH_ASSETS) is refresh, key
