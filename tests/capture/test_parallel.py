"""Data-parallel hf extraction (capture.parallel): two real processes on the CPU write the
same shard bytes as one, commit once, and resume after a failed part."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest
from dagster import instance_for_test, materialize

from assets.shards import hidden_state_shards
from pipeline.capture import parallel
from pipeline.capture import stage as capture_stage
from pipeline.capture.backends import open_backend
from pipeline.capture.shards import iter_step
from pipeline.capture.stage import ExtractionError, Part
from pipeline.layout import shards_prefix
from pipeline.manifest import read_manifest
from pipeline.snapshot.policy import load_policy_ref, publish_policy
from pipeline.storage import Storage
from resources.capture import CaptureResource, HFCapture, SGLangCapture
from resources.storage import StorageResource
from tests.capture.helpers import (
    CONFIG,
    STEP,
    TOKEN_BYTES,
    lengths,
    shard_files,
    tiny_llama,
    write_tokenized,
)

OPEN = {"kind": "hf", "aux_layer_ids": [0, 2, 4], "token_budget": CONFIG.token_budget,
        "options": {"dtype": "float32", "device": "cpu"}}
FAILING_PART = [sys.executable, "-c", "import sys; sys.stdin.readline(); "
                "print('{\"error\": \"RuntimeError: planted\"}'); sys.exit(1)"]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("policy")
    tiny_llama(layers=6, hidden=64).save_pretrained(path)
    return path


def world(root, policy_dir) -> Storage:
    storage = Storage(root.as_uri())
    publish_policy(storage, STEP, policy_dir)
    write_tokenized(storage, STEP, lengths(20))
    return storage


def extract(storage: Storage, processes: int, **kw):
    with open_backend(storage, STEP, **OPEN) as backend:
        return parallel.run(storage, STEP, backend, CONFIG, processes=processes,
                            open_args=OPEN, policy=load_policy_ref(storage, STEP), **kw)


@pytest.fixture(scope="module")
def single(tmp_path_factory, policy_dir):
    storage = world(tmp_path_factory.mktemp("one"), policy_dir)
    return storage, extract(storage, 1)


@pytest.mark.integration
def test_two_processes_write_the_bytes_one_process_writes(tmp_path, policy_dir, single):
    one, first = single
    storage = world(tmp_path, policy_dir)
    summary = extract(storage, 2)
    assert first.shards > 3 and shard_files(storage) == shard_files(one)
    assert summary.backend_calls == first.backend_calls > 0  # each batch ran once, somewhere
    assert (summary.processes, first.processes) == (2, 1)
    assert (summary.samples, summary.tokens, summary.shards_reused) == (
        first.samples, first.tokens, 0)
    assert sum(1 for _ in iter_step(storage, STEP)) == 20
    again = extract(storage, 2)
    assert again.already_committed and again.backend_calls == 0


@pytest.mark.integration
def test_a_failed_part_commits_nothing_and_the_next_run_keeps_the_finished_parts(
        tmp_path, policy_dir, single):
    one, first = single
    storage = world(tmp_path, policy_dir)
    with pytest.raises(parallel.PartFailed, match=r"part 1 of 2 exited with status 1: "
                                              r"RuntimeError: planted"):
        extract(storage, 2, command=FAILING_PART)
    assert read_manifest(storage, shards_prefix(STEP)) is None
    written = sorted(k.rsplit("/", 1)[1] for k in storage.list(shards_prefix(STEP))
                     if k.endswith(".parquet"))
    even = [f"shard-{i:05d}.parquet" for i in range(0, first.shards, 2)]
    assert written == even  # part 0's shards, each with its marker

    resumed = extract(storage, 2)
    assert resumed.shards_reused == len(even)
    assert resumed.backend_calls < first.backend_calls
    assert shard_files(storage) == shard_files(one)


def test_no_process_is_started_for_a_part_that_would_own_no_shard(tmp_path, policy_dir):
    storage = world(tmp_path, policy_dir)
    whole = replace(CONFIG, shard_bytes=1 << 30)  # one shard: part 1 would own nothing
    with open_backend(storage, STEP, **OPEN) as backend:
        summary = parallel.run(storage, STEP, backend, whole, processes=2, open_args=OPEN,
                               command=FAILING_PART)  # fails the run if it is started
    assert summary.shards == 1 and summary.samples == 20


@pytest.mark.integration
def test_a_failed_part_is_retried_unless_its_own_error_would_not_be(tmp_path, policy_dir):
    from assets.retry import is_permanent

    storage = world(tmp_path, policy_dir)
    answers = {"killed": "", "bad input": json.dumps({
        "error": "ValueError: bad", "error_types": ["builtins.ValueError", "builtins.Exception"]})}
    for case, answer in answers.items():
        command = [sys.executable, "-c", f"import sys; sys.stdin.readline(); print({answer!r}); "
                                         f"sys.exit(1)"]
        with pytest.raises(parallel.PartFailed) as failed:
            extract(storage, 2, command=command)
        assert is_permanent(failed.value) == (case == "bad input"), case


def test_a_part_whose_backend_differs_is_refused_before_it_computes(tmp_path, policy_dir):
    storage = world(tmp_path, policy_dir)
    with open_backend(storage, STEP, **OPEN) as backend:
        fingerprint = capture_stage.start(storage, STEP, backend, CONFIG).fingerprint
    with open_backend(storage, STEP, **{**OPEN, "aux_layer_ids": [1, 2, 4]}) as other:
        with pytest.raises(ExtractionError, match="part 1 of 2: this process's backend"):
            capture_stage.run_part(storage, STEP, other, CONFIG, Part(1, 2), fingerprint)
    assert storage.list(shards_prefix(STEP)) == []
    with pytest.raises(ValueError, match="part 2 of 2"):
        Part(2, 2)


@pytest.mark.integration
def test_processes_are_a_capture_resource_setting(tmp_path, policy_dir, single):
    one, _ = single
    url = (tmp_path / "storage").as_uri()
    storage = world(tmp_path / "storage", policy_dir)
    config = {"token_budget": CONFIG.token_budget, "max_batch_size": CONFIG.max_batch_size,
              "shard_bytes": 60 * TOKEN_BYTES, "row_group_bytes": 24 * TOKEN_BYTES,
              "heldout_fraction": 0.0}
    resources = {"storage": StorageResource(url=url),
                 "capture": CaptureResource(aux_layer_ids=[0, 2, 4], hf=HFCapture(processes=2))}
    with instance_for_test() as instance:
        instance.add_dynamic_partitions("rl_steps", ["step-000003"])
        result = materialize([hidden_state_shards], partition_key="step-000003",
                             instance=instance, resources=resources,
                             run_config={"ops": {"hidden_state_shards": {"config": config}}})
    assert result.success and shard_files(storage) == shard_files(one)
    (event,) = result.get_asset_materialization_events()
    assert event.materialization.metadata["processes"].value == 2
    assert "hf.processes is 2, but only the 'hf' backend" in CaptureResource(
        backend="sglang", hf=HFCapture(processes=2), sglang=SGLangCapture(
            aux_urls=["http://127.0.0.1:9"], final_urls=["http://127.0.0.1:9"])).problem()
