"""Retries: transient failures go to Dagster's retry policy, permanent ones fail at once."""

from __future__ import annotations

import pytest
from dagster import AssetKey, DagsterEventType, asset, instance_for_test, materialize

from assets.retry import (
    SERVICE_RETRY,
    fail_fast_on_permanent_errors,
    is_permanent,
    service_retry_policy,
)
from definitions import defs
from pipeline.capture.engine_http import EngineRejectedError, EngineRequestError
from pipeline.manifest import ManifestError
from pipeline.release.backend import ServingError, ServingRefused
from pipeline.release.promotion import PromotionError, PromotionNotApplied
from pipeline.snapshot.sieve import SnapshotError
from pipeline.storage import Storage, StorageError, StorageUnavailable

pytestmark = pytest.mark.integration


def _caused(error: BaseException, cause: BaseException) -> BaseException:
    error.__cause__ = cause
    return error


def _flaky(errors: list[BaseException]):
    """An asset that raises ``errors`` one per attempt, then succeeds; retried without delay."""
    attempts = []

    @asset(retry_policy=service_retry_policy(delay=0))
    def flaky() -> int:
        attempts.append(1)
        with fail_fast_on_permanent_errors():
            if len(attempts) <= len(errors):
                raise errors[len(attempts) - 1]
        return len(attempts)

    return flaky, attempts


def _restarts(instance, run_id) -> int:
    return len(instance.get_records_for_run(
        run_id, of_type=DagsterEventType.STEP_RESTARTED).records)


@pytest.mark.parametrize("error", [
    ConnectionResetError("peer reset"), TimeoutError("slow"), OSError("S3 503 SlowDown"),
    EngineRequestError("failed after 4 attempts: connection refused", url="u", samples=()),
    ServingError("restart hook timed out"),
    _caused(PromotionNotApplied("serving update failed, nothing moved"),
            ServingError("http://127.0.0.1:30000: ConnectionError")),
    PromotionNotApplied("moving champion failed (read back '3'); undone"),
    StorageUnavailable("cannot open s3://aerie/shards/x for writing: 503 SlowDown"),
    _caused(PromotionNotApplied("serving update failed, nothing moved"),
            StorageUnavailable("cannot list the uploads under s3://aerie/serving: reset"))])
def test_transient_errors_are_retried_until_success(dagster_backend, error):
    flaky, attempts = _flaky([error, error])
    with instance_for_test(overrides=dagster_backend) as instance:
        result = materialize([flaky], instance=instance)
        assert result.success and len(attempts) == 3
        assert _restarts(instance, result.run_id) == 2


@pytest.mark.parametrize("error", [
    ValueError("record 7: field 'reward' is not a number"),
    SnapshotError("no completion marker"), FileNotFoundError("step=000003"),
    EngineRejectedError("http://127.0.0.1:30000/generate answered HTTP 400", url="u",
                        samples=()),
    ServingRefused("hot swap refused: draft vocab size differs"),
    _caused(PromotionNotApplied("serving update failed, nothing moved"),
            ServingRefused("drafter has no committed manifest")),
    PromotionError("alias move failed AND restoring serving failed"),
    StorageError("s3://other/drafters/step=000010 is not under storage root s3://aerie"),
    StorageError("invalid storage key 'drafters/../secrets'"),
    ManifestError("file:///r/evals/step=000010/_manifest.json", "files", "not a list")])
def test_permanent_errors_fail_at_once(dagster_backend, error):
    flaky, attempts = _flaky([error])
    with instance_for_test(overrides=dagster_backend) as instance:
        result = materialize([flaky], instance=instance, raise_on_error=False)
        assert not result.success and len(attempts) == 1
        assert _restarts(instance, result.run_id) == 0
        failure = result.get_step_failure_events()[0].step_failure_data.error
        assert str(error) in failure.message  # the reason reaches the UI


def test_the_storage_layer_raises_what_the_policy_expects(tmp_path, monkeypatch):
    """The errors the storage layer really raises: a bad key or a foreign URL is permanent,
    a store that cannot be reached is not (nor is fsspec's own OSError)."""
    storage = Storage(tmp_path.as_uri())
    with pytest.raises(StorageError) as foreign:
        storage.key_of("s3://elsewhere/drafters/step=000001")
    with pytest.raises(StorageError) as bad_key:
        storage.path("drafters/../../etc")
    assert is_permanent(foreign.value) and is_permanent(bad_key.value)

    def unreachable(*args, **kwargs):
        raise ConnectionResetError("connection reset by peer")

    monkeypatch.setattr(storage, "is_local", False)  # the remote write path
    monkeypatch.setattr(storage.fs, "open", unreachable)
    with pytest.raises(StorageUnavailable) as down, storage.open_write("shards/x"):
        pass
    assert not is_permanent(down.value) and not is_permanent(down.value.__cause__)


def test_retries_give_up_after_the_policy_max(dagster_backend):
    flaky, attempts = _flaky([ConnectionError("down")] * 10)
    with instance_for_test(overrides=dagster_backend) as instance:
        result = materialize([flaky], instance=instance, raise_on_error=False)
        assert not result.success
        assert len(attempts) == service_retry_policy().max_retries + 1


def test_every_stage_that_talks_to_a_service_has_the_policy():
    graph = defs.get_repository_def().asset_graph
    for key in graph.get_all_asset_keys():
        node = graph.assets_def_for_key(AssetKey(key.path)).node_def
        assert node.retry_policy == SERVICE_RETRY, key


def test_a_failed_blocking_check_is_not_retried_and_stops_downstream(dagster_backend):
    from dagster import AssetCheckResult, AssetCheckSpec, MaterializeResult

    attempts = []

    @asset(retry_policy=service_retry_policy(delay=0),
           check_specs=[AssetCheckSpec("sound", asset="judged", blocking=True)])
    def judged():
        attempts.append(1)
        return MaterializeResult(check_results=[AssetCheckResult(passed=False)])

    @asset(deps=[judged])
    def downstream() -> None:
        raise AssertionError("must not run after a failed blocking check")

    with instance_for_test(overrides=dagster_backend) as instance:
        result = materialize([judged, downstream], instance=instance, raise_on_error=False)
        assert not result.success and len(attempts) == 1
        assert _restarts(instance, result.run_id) == 0
        assert instance.get_latest_materialization_event(AssetKey("downstream")) is None
