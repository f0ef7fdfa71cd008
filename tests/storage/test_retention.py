"""Storage retention on local and S3 storage (moto_server): which steps go, what stays
(manifests marked deleted, protected steps, the window), bytes reported, crash leftovers,
idempotence; policy checkpoints only when asked and only of extracted steps; readers refuse
deleted data; the Dagster asset protects in-flight runs."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch
from dagster import AssetKey, DagsterRunStatus, instance_for_test, materialize
from dagster._core.test_utils import create_run_for_test

from assets.partitions import step_key
from assets.retention import in_flight_steps, storage_retention, window_of
from pipeline.capture.shards import (
    SHARD_SCHEMA_VERSION,
    SHARDS_KIND,
    ShardSample,
    ShardsDeletedError,
    ShardSpec,
    read_shards_manifest,
    shard_name,
    write_shard,
)
from pipeline.capture.window import WindowError, read_window
from pipeline.contracts import Manifest
from pipeline.layout import OBSERVED, drafter_prefix, observed_key, policy_prefix, shards_prefix
from pipeline.manifest import DeletedByRetention, entry_for, read_manifest, write_manifest
from pipeline.retention import apply_retention, keep_from
from pipeline.snapshot.policy import POLICY_KIND, load_policy_ref, publish_policy
from pipeline.storage import Storage
from pipeline.tokenize.stage import load_step_tokenizer
from pipeline.verified import fetch
from resources.refresh import RefreshPolicyResource
from resources.storage import StorageResource
from resources.trainer import TrainerResource

H = 8
NOW = datetime(2026, 11, 24, 12, 0, tzinfo=UTC)


def commit_step(storage: Storage, step: int, shards: int = 2) -> int:
    """A committed shard step (plus a progress marker, as capture leaves one); its bytes."""
    prefix = shards_prefix(step)
    spec = ShardSpec(step=step, hidden_size=H, aux_layer_ids=(0, 1, 2))
    entries = []
    for i in range(shards):
        t = 3 + i + step
        sample = ShardSample(f"r{step}-{i}", step, torch.arange(t, dtype=torch.int32),
                             torch.ones(t, dtype=torch.bool),
                             torch.zeros(t, 3 * H, dtype=torch.bfloat16),
                             torch.ones(t, H, dtype=torch.bfloat16))
        written = write_shard(storage, f"{prefix}/{shard_name(i)}", spec, [sample])
        entries.append(entry_for(prefix, written.obj, rows=1))
    marker = storage.write_bytes(f"{prefix}/_progress/{shard_name(0)}.json", b"{}")
    write_manifest(storage, prefix, Manifest(SHARDS_KIND, SHARD_SCHEMA_VERSION, tuple(entries),
                                             meta={"step": step}))
    return sum(e.bytes for e in entries) + marker.bytes


def work_dirs(root, steps):
    for s in steps:
        d = root / f"step={s:06d}-0123456789abcdef" / "checkpoints"
        d.mkdir(parents=True)
        (d / "model.pt").write_bytes(b"x" * (100 + s))


def commit_policy(storage: Storage, step: int, tmp_path) -> int:
    """A committed policy checkpoint of ``step``; its bytes."""
    src = tmp_path / f"policy-{step}"
    src.mkdir()
    (src / "config.json").write_text('{"vocab_size": 32}')
    (src / "tokenizer.json").write_text("{}")
    (src / "model.safetensors").write_bytes(bytes(range(256)) * (step + 1))
    publish_policy(storage, step, src)
    return sum(f.bytes for f in read_manifest(storage, policy_prefix(step)).files)


def retain(instance, storage: Storage, step: int, tmp_path, **policy) -> dict:
    """``storage_retention`` after the refresh at ``step`` (retain 4 of window 4, plus
    ``policy``); its materialization's metadata."""
    result = materialize(
        [storage_retention], instance=instance, partition_key=step_key(step),
        resources={"storage": StorageResource(url=storage.url()),
                   "refresh": RefreshPolicyResource(window=4, retain_steps=4, **policy),
                   "trainer": TrainerResource(work_dir=str(tmp_path / "training"))})
    return {k: v.value for k, v in result.asset_materializations_for_node(
        "storage_retention")[0].metadata.items()}


def commit_drafter(storage: Storage, step: int) -> None:
    write_manifest(storage, drafter_prefix(step), Manifest("eagle3_drafter", 1, (), {}))


def test_old_steps_go_their_manifests_stay_marked(storage, tmp_path):
    sizes = {s: commit_step(storage, s) for s in range(10)}
    work_dirs(tmp_path / "training", [1, 3, 5, 7, 9])
    for s in (1, 5, 7, 9):
        commit_drafter(storage, s)  # the refresh at step 3 failed: its dir is a resume point
    report = apply_retention(storage, 9, 4, protected={2, 7}, work_root=tmp_path / "training",
                             now=NOW)
    assert keep_from(9, 4) == report.keep_from == 6
    assert report.deleted_steps == (0, 1, 3, 4, 5) and report.protected == (2,)
    assert report.shard_files_deleted == 5 * 3
    assert report.shard_bytes_freed == sum(sizes[s] for s in (0, 1, 3, 4, 5))
    assert report.work_dirs_deleted == ("step=000001-0123456789abcdef",
                                        "step=000005-0123456789abcdef")
    assert report.work_bytes_freed == 101 + 105
    assert report.bytes_freed == report.shard_bytes_freed + report.work_bytes_freed
    assert sorted(p.name for p in (tmp_path / "training").iterdir()) == [
        "step=000003-0123456789abcdef", "step=000007-0123456789abcdef",
        "step=000009-0123456789abcdef"]
    for s in range(10):
        keys = storage.list(shards_prefix(s))
        manifest = read_manifest(storage, shards_prefix(s))
        if s in report.deleted_steps:
            assert keys == [f"{shards_prefix(s)}/_manifest.json"]
            assert manifest.meta["deleted"] == {"at": "2026-11-24T12:00:00+00:00",
                                                "by_refresh": 9, "files": 3,
                                                "bytes_freed": sizes[s]}
            assert len(manifest.files) == 2  # lineage: which files there were, their hashes
        else:
            assert len(keys) == 4 and "deleted" not in manifest.meta


def test_readers_refuse_deleted_data_and_a_second_pass_is_a_no_op(storage):
    for s in range(6):
        commit_step(storage, s, shards=1)
    apply_retention(storage, 5, 2, now=NOW)
    with pytest.raises(ShardsDeletedError, match=r"step=000001: files deleted by storage "
                                                 r"retention at 2026-11-24T12:00:00\+00:00 "
                                                 r"\(after the refresh at step 5; "
                                                 r"manifest kept\).*ingest_step"):
        read_shards_manifest(storage, 1)
    assert read_shards_manifest(storage, 1, data=False).meta["deleted"]["by_refresh"] == 5
    with pytest.raises(WindowError, match=r"deleted: .*step=000003"):
        read_window(storage, [3, 4, 5])
    assert read_window(storage, [4, 5]).keys() == {4, 5}
    again = apply_retention(storage, 5, 2, now=NOW)
    assert again.deleted_steps == () and again.bytes_freed == 0


def test_policies_go_only_when_asked_and_only_of_extracted_steps(storage, tmp_path):
    for s in range(8):
        if s != 2:  # step 2's snapshot came late: not extracted yet
            commit_step(storage, s, shards=1)
    policy_bytes = {s: commit_policy(storage, s, tmp_path) for s in range(8)}
    kept = apply_retention(storage, 7, 4, protected={1}, now=NOW)
    assert kept.policy_steps_deleted == () and kept.deleted_steps == (0, 3)
    assert all("deleted" not in read_manifest(storage, policy_prefix(s)).meta for s in range(8))

    report = apply_retention(storage, 7, 4, protected={1}, policies=True, now=NOW)
    assert report.deleted_steps == () and report.policy_steps_deleted == (0, 3)
    assert report.policy_bytes_freed == policy_bytes[0] + policy_bytes[3] == report.bytes_freed
    for s in range(8):
        marked = read_manifest(storage, policy_prefix(s)).meta.get("deleted")
        assert (marked is not None) == (s in (0, 3))
        assert len(storage.list(policy_prefix(s))) == (1 if s in (0, 3) else 4)
    assert read_manifest(storage, policy_prefix(3)).meta["deleted"]["by_refresh"] == 7
    assert load_policy_ref(storage, 3).vocab_size == 32  # lineage still reads
    named = r"policies/step=000003: files deleted by storage retention at 2026-11-24.*step 7"
    with pytest.raises(DeletedByRetention, match=named):
        fetch(storage, policy_prefix(3), kind=POLICY_KIND, label="policy")
    with pytest.raises(DeletedByRetention, match=named):
        load_step_tokenizer(storage, 3)
    fetch(storage, policy_prefix(4), kind=POLICY_KIND, label="policy")  # kept: reads
    again = apply_retention(storage, 7, 4, protected={1}, policies=True, now=NOW)
    assert again.policy_steps_deleted == () and again.bytes_freed == 0


def test_old_loop_charts_go_when_asked_their_observed_records_stay(storage):
    for s in range(6):
        storage.write_bytes(observed_key(s), b"{}")
        storage.write_bytes(f"{OBSERVED}/step={s:06d}/tau_over_rl_steps.png", b"png" * (s + 1))
    assert apply_retention(storage, 5, 2, now=NOW).chart_files_deleted == 0
    report = apply_retention(storage, 5, 2, protected={1}, charts=True, now=NOW)
    assert report.chart_files_deleted == 3 and report.chart_bytes_freed == 3 * (1 + 3 + 4)
    assert report.bytes_freed == report.chart_bytes_freed
    left = storage.list(OBSERVED)
    assert [k for k in left if k.endswith(".png")] == [
        f"{OBSERVED}/step={s:06d}/tau_over_rl_steps.png" for s in (1, 4, 5)]
    assert all(observed_key(s) in left for s in range(6))
    assert apply_retention(storage, 5, 2, protected={1}, charts=True).chart_files_deleted == 0


def test_leftovers_of_a_crash_after_the_marker_are_swept(storage):
    size = commit_step(storage, 0)
    commit_step(storage, 5)
    prefix = shards_prefix(0)
    manifest = read_manifest(storage, prefix)
    write_manifest(storage, prefix, Manifest(manifest.kind, manifest.kind_version,
                                             manifest.files, {**manifest.meta, "deleted": {
                                                 "at": "earlier", "by_refresh": 4, "files": 3,
                                                 "bytes_freed": size}}))
    storage.delete(f"{prefix}/{shard_name(0)}")  # the crash came after the first delete
    report = apply_retention(storage, 5, 1, now=NOW)
    assert report.deleted_steps == (0,) and report.shard_files_deleted == 2
    assert storage.list(prefix) == [f"{prefix}/_manifest.json"]
    assert read_manifest(storage, prefix).meta["deleted"]["at"] == "earlier"  # not rewritten


def test_retain_steps_must_cover_the_window():
    with pytest.raises(ValueError, match="retain_steps must be >= 1"):
        keep_from(5, 0)
    with pytest.raises(ValueError, match="retain_steps 2 would delete steps the next "
                                         "refresh's window of 4 reads"):
        RefreshPolicyResource(window=4, retain_steps=2)  # refused when it is built
    RefreshPolicyResource(window=4, retain_steps=0)
    with pytest.raises(ValueError, match="prune_policies needs retain_steps > 0"):
        RefreshPolicyResource(retain_steps=0, prune_policies=True)


@pytest.mark.integration
def test_the_asset_keeps_what_queued_and_running_runs_read(tmp_path):
    storage = Storage((tmp_path / "store").as_uri())
    for s in range(10):
        commit_step(storage, s, shards=1)
        commit_policy(storage, s, tmp_path)
    work_dirs(tmp_path / "training", [0, 9])
    with instance_for_test() as instance:
        instance.add_dynamic_partitions("refresh_steps", [step_key(9)])
        create_run_for_test(instance, job_name="drafter_refresh",  # a queued run needs an
                            status=DagsterRunStatus.NOT_STARTED,  # origin; same claim
                            tags={"dagster/partition": step_key(3)},
                            run_config={"ops": {"vocab_mapping": {"config": {"window": 2}}}})
        create_run_for_test(instance, job_name="ingest_step", status=DagsterRunStatus.STARTED,
                            tags={"dagster/partition": step_key(0)})
        create_run_for_test(instance, job_name="drafter_refresh",
                            status=DagsterRunStatus.SUCCESS,
                            tags={"dagster/partition": step_key(5)})  # finished: no claim
        create_run_for_test(instance, job_name="__ASSET_JOB", status=DagsterRunStatus.STARTED,
                            tags={"dagster/partition": step_key(5)},  # from the asset UI
                            asset_selection=frozenset({AssetKey("drafter_checkpoint")}))
        create_run_for_test(instance, job_name="__ASSET_JOB", status=DagsterRunStatus.STARTED,
                            tags={"dagster/partition": step_key(8)},
                            asset_selection=frozenset({AssetKey("acceptance_eval")}))
        assert in_flight_steps(instance, "none", default_window=2) == {0, 2, 3, 4, 5}
        meta = retain(instance, storage, 9, tmp_path, prune_policies=True)
        observed = instance.fetch_observations(AssetKey("hidden_state_shards"), 10).records
        observed = sorted(r.partition_key for r in observed)
    assert meta["deleted"] == [1] and meta["protected"] == [0, 2, 3, 4, 5]
    assert observed == [step_key(1)]  # the partition says its data is gone
    assert meta["keep_from_step"] == 6 and meta["shard_files_deleted"] == 2
    assert meta["policies_deleted"] == [1] and meta["policy_bytes_freed"] > 0
    assert meta["work_dirs_deleted"] == []
    assert meta["bytes_freed"] == meta["shard_bytes_freed"] + meta["policy_bytes_freed"]
    assert read_shards_manifest(storage, 2).meta.get("deleted") is None


@pytest.mark.integration
def test_a_refresh_run_config_that_widens_its_window_widens_what_is_kept():
    with instance_for_test() as instance:
        wide = create_run_for_test(instance, job_name="drafter_refresh", run_config={
            "ops": {"vocab_mapping": {"config": {"window": 6}}}})
        plain = create_run_for_test(instance, job_name="drafter_refresh")
    assert (window_of(wide, 4), window_of(plain, 4)) == (6, 4)


@pytest.mark.integration
def test_retention_off_deletes_nothing(tmp_path):
    storage = Storage((tmp_path / "store").as_uri())
    for s in range(3):
        commit_step(storage, s, shards=1)
    with instance_for_test() as instance:
        instance.add_dynamic_partitions("refresh_steps", [step_key(2)])
        result = materialize(
            [storage_retention], instance=instance, partition_key=step_key(2),
            resources={"storage": StorageResource(url=storage.url()),
                       "refresh": RefreshPolicyResource(),
                       "trainer": TrainerResource(work_dir=str(tmp_path / "training"))})
    meta = result.asset_materializations_for_node("storage_retention")[0].metadata
    assert meta["retain_steps"].value == 0 and meta["bytes_freed"].value == 0
    assert all(len(storage.list(shards_prefix(s))) == 3 for s in range(3))


@pytest.mark.integration
def test_pruned_history_takes_the_ingestion_runs_and_keys_of_deleted_steps_only(tmp_path):
    storage = Storage((tmp_path / "store").as_uri())
    for s in range(9):
        if s != 2:  # step 2 is still waiting to be extracted
            commit_step(storage, s, shards=1)
    with instance_for_test() as instance:
        instance.add_dynamic_partitions("rl_steps", [step_key(s) for s in range(9)])
        instance.add_dynamic_partitions("refresh_steps", [step_key(3), step_key(8)])
        ingest = {s: create_run_for_test(instance, job_name="ingest_step",
                                         status=DagsterRunStatus.SUCCESS,
                                         tags={"dagster/partition": step_key(s)})
                  for s in range(9)}
        instance.report_engine_event("a logged event", ingest[0])  # its own SQLite file
        shard_file = Path(instance.event_log_storage.path_for_shard(ingest[0].run_id))
        assert shard_file.exists()
        backfill = create_run_for_test(instance, job_name="__ASSET_JOB",
                                       status=DagsterRunStatus.FAILURE,
                                       tags={"dagster/partition": step_key(1)},
                                       asset_selection=frozenset({AssetKey("rollout_snapshot")}))
        refresh = create_run_for_test(instance, job_name="drafter_refresh",  # same key format
                                      status=DagsterRunStatus.SUCCESS,
                                      tags={"dagster/partition": step_key(3)})
        create_run_for_test(instance, job_name="ingest_step", status=DagsterRunStatus.STARTED,
                            tags={"dagster/partition": step_key(1)})  # in flight: protected
        meta = retain(instance, storage, 8, tmp_path, prune_history=True)
        keys = instance.get_dynamic_partitions("rl_steps")
        left = {r.run_id for r in instance.get_runs()}
    assert meta["history_steps_pruned"] == [0, 3, 4] and meta["runs_deleted"] == 3
    assert keys == [step_key(s) for s in (1, 2, 5, 6, 7, 8)]
    assert not {ingest[s].run_id for s in (0, 3, 4)} & left
    assert {ingest[1].run_id, ingest[2].run_id, backfill.run_id, refresh.run_id} <= left
    assert not shard_file.exists()
