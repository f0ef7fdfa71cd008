"""The classic configuration mistakes fail at once, without retries, and the message names
the setting or variable that fixes them: S3 without credentials, a storage root that cannot
be written, the SGLang backend without its URLs, a refresh of a step never ingested, and
promoting or rolling back before any drafter exists."""

from __future__ import annotations

import pytest
from dagster import DagsterEventType, DagsterInstance, materialize
from pydantic import ValidationError

from aerie import cli
from assets.drafter import vocab_mapping
from assets.partitions import refresh_steps, rl_steps
from assets.shards import hidden_state_shards
from assets.snapshots import rollout_snapshot
from assets.tokenized import tokenized_rollouts
from resources.capture import CaptureResource, HFCapture, SGLangCapture
from resources.refresh import RefreshPolicyResource
from resources.storage import StorageResource
from tests.orchestration.conftest import on_every_dagster_backend, use_backend

pytestmark = pytest.mark.integration

DATA = [rollout_snapshot, tokenized_rollouts, hidden_state_shards]


@pytest.fixture
def instance(tmp_path, monkeypatch, dagster_backend):
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    use_backend(cli.prepare_dagster_home(), dagster_backend)
    instance = DagsterInstance.get()
    instance.add_dynamic_partitions(rl_steps.name, ["step-000003"])
    instance.add_dynamic_partitions(refresh_steps.name, ["step-000003"])
    return instance


def _fails_once(result) -> str:
    """The run failed, no step was retried; returns every failure message of the run."""
    assert not result.success
    events = result.all_events
    assert not [e for e in events if e.event_type == DagsterEventType.STEP_RESTARTED]
    assert not [e for e in events if e.event_type == DagsterEventType.STEP_UP_FOR_RETRY]
    return "\n".join(str(e.event_specific_data) for e in events if e.is_failure)


def _materialize(assets, instance, resources, partition="step-000003"):
    return materialize(assets, instance=instance, partition_key=partition,
                       resources=resources, raise_on_error=False)


def test_s3_without_credentials_names_the_variables(instance, monkeypatch, tmp_path):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    # nowhere else to find credentials, and no instance metadata lookup off the machine
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    storage = StorageResource(url="s3://aerie-no-credentials/root",
                              endpoint_url="http://127.0.0.1:9")  # never contacted
    message = _fails_once(_materialize(DATA, instance, {
        "storage": storage, "capture": CaptureResource()}))
    assert "no S3 credentials found" in message
    assert "AWS_ACCESS_KEY_ID" in message and "AWS_SECRET_ACCESS_KEY" in message


def test_an_unwritable_storage_root_names_aerie_storage_url(instance, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    storage = StorageResource(url=(blocker / "storage").as_uri())
    message = _fails_once(_materialize(DATA, instance, {
        "storage": storage, "capture": CaptureResource()}))
    assert f"cannot create the storage root {(blocker / 'storage').as_uri()}" in message
    assert "AERIE_STORAGE_URL" in message


def test_sglang_without_urls_names_the_fields(instance, tmp_path):
    capture = CaptureResource(backend="sglang",
                              sglang=SGLangCapture(aux_urls=["http://127.0.0.1:30001"]))
    message = _fails_once(_materialize(DATA, instance, {
        "storage": StorageResource(url=(tmp_path / "storage").as_uri()),
        "capture": capture}))
    assert "resources.capture.config.sglang.final_urls" in message
    assert "aux_urls must be" not in message  # the field's name, not the client's
    with pytest.raises(ValidationError, match=r"backend\n.*'hf', 'sglang' or 'vllm'"):
        CaptureResource(backend="sglng")
    with pytest.raises(ValidationError, match=r"HFCapture\ndevice\n.*should match pattern"):
        CaptureResource(hf=HFCapture(device="gpu0"))
    with pytest.raises(ValidationError, match=r"hf.device\n.*should match pattern"):
        CaptureResource(hf={"device": "gpu0"})  # as run config gives it
    assert CaptureResource(hf=HFCapture(device="cuda:1")).problem() is None


def test_a_refresh_of_a_step_never_ingested_says_to_ingest_it(instance, tmp_path):
    message = _fails_once(_materialize([vocab_mapping], instance, {
        "storage": StorageResource(url=(tmp_path / "storage").as_uri()),
        "refresh": RefreshPolicyResource(every=4, window=2)}))
    assert "lacks committed hidden-state shards for step(s) [2, 3]" in message
    assert "ingest them first (job ingest_step" in message


def test_promote_or_roll_back_before_any_drafter(tmp_path, monkeypatch, capsys):
    for var in ("AERIE_STORAGE_URL", "MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AERIE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home" / "dagster"))
    assert cli.main(["rollback", "--actor", "ci"]) == 1
    error = capsys.readouterr().err
    assert "has no champion to roll back: no drafter was promoted yet" in error
    assert "aerie demo, or the drafter_refresh job" in error
    assert cli.main(["promote", "3", "--actor", "ci", "--reason", "test"]) == 1
    error = capsys.readouterr().err
    assert "has no version 3; registered versions: none yet" in error
    assert cli.main(["status"]) == 0
    assert "serving now:  no drafter" in capsys.readouterr().out


def test_the_s3_check_passes_a_usable_root_and_names_a_missing_bucket(moto_endpoint):
    """Against a real S3 API (moto_server): an existing bucket passes (an empty prefix
    included); a bucket that does not exist fails naming it and the setting."""
    import uuid

    from pipeline.storage import Storage, StorageAccessError
    from tests.conftest import s3_options

    options = s3_options(moto_endpoint)
    bucket = f"aerie-{uuid.uuid4().hex[:12]}"
    Storage(f"s3://{bucket}", options).fs.mkdir(bucket)
    resource = StorageResource(url=f"s3://{bucket}/root", endpoint_url=moto_endpoint,
                               access_key_id=options["key"],
                               secret_access_key=options["secret"])
    assert resource.checked().root_url == f"s3://{bucket}/root"
    missing = resource.model_copy(update={"url": "s3://aerie-no-such-bucket/root"})
    with pytest.raises(StorageAccessError, match="bucket 'aerie-no-such-bucket' does not "
                                                 "exist. Create the bucket, or point "
                                                 "AERIE_STORAGE_URL"):
        missing.checked()


@on_every_dagster_backend
def test_a_run_left_in_flight_by_a_dead_aerie_process_is_marked_failed(instance):
    """A killed ``aerie`` process leaves its run STARTED; the next command marks it failed,
    so the refresh sensor is not stopped for good by a refresh "still running"."""
    import os
    import subprocess

    from dagster import DagsterRunStatus

    from aerie.launch import _executor_tags, fail_orphaned_runs
    from definitions import defs
    from jobs.refresh import refresh_in_flight

    dead = subprocess.Popen(["true"])
    dead.wait()
    job = defs.resolve_job_def("drafter_refresh")
    tags = {**_executor_tags(), "dagster/partition": "step-000003"}
    orphan = instance.create_run_for_job(job, tags={**tags, "aerie/executed_by_pid":
                                                    str(dead.pid)},
                                         status=DagsterRunStatus.STARTED)
    ours = instance.create_run_for_job(job, tags=tags, status=DagsterRunStatus.STARTED)
    assert ours.tags["aerie/executed_by_pid"] == str(os.getpid())
    assert refresh_in_flight(instance)
    assert fail_orphaned_runs(instance) == [orphan.run_id]  # this process's run is alive
    assert instance.get_run_by_id(orphan.run_id).status == DagsterRunStatus.FAILURE
    assert instance.get_run_by_id(ours.run_id).status == DagsterRunStatus.STARTED
