"""The step's sampler settings travel with its snapshot: written, checked, carried, read."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.layout import raw_prefix
from pipeline.sampling import GREEDY, SamplingError, SamplingParams
from pipeline.snapshot import stage as snapshot_stage
from pipeline.snapshot.sieve import SnapshotError, StepArgumentError
from pipeline.snapshot.stage import recorded_sampling
from pipeline.snapshot.writer import SnapshotWriter

from .conftest import edit_manifest, good_record


def test_writer_records_the_sampler_and_the_stage_carries_it(storage, policy_dir):
    SnapshotWriter(storage).write_step(3, [good_record(0)], policy_dir, 3,
                                       sampling={"temperature": 0.8, "top_p": 0.95,
                                                 "top_k": 0})
    assert recorded_sampling(storage, 3) is None  # not validated yet
    snapshot_stage.run(storage, 3)
    assert recorded_sampling(storage, 3) == SamplingParams(0.8, top_p=0.95, top_k=-1)


def test_a_step_without_settings_records_none(storage, policy_dir):
    SnapshotWriter(storage).write_step(3, [good_record(0)], policy_dir, 3)
    snapshot_stage.run(storage, 3)
    assert recorded_sampling(storage, 3) is None


@pytest.mark.parametrize(("sampling", "field"), [
    ({"temperature": -1}, "sampling.temperature"),
    ({"temperature": 1, "top_p": 0}, "sampling.top_p"),
    ({"temperature": 1, "top_k": -5}, "sampling.top_k"),
    ({"temperature": 1, "min_p": 1.5}, "sampling.min_p"),
    ({"temperature": float("nan")}, "sampling.temperature"),
    ({"temprature": 1.0}, "sampling.temprature"),
    ({"temperature": True}, "sampling.temperature"),
    ({"top_p": 0.9}, "sampling.temperature"),  # engines default to 1.0; Aerie won't guess
    ({"temperature": 1, "top_k": False}, "sampling.top_k"),
])
def test_bad_settings_fail_the_step_before_anything_is_written(storage, policy_dir,
                                                               sampling, field):
    with pytest.raises(StepArgumentError, match=field) as raised:
        SnapshotWriter(storage).write_step(3, [good_record(0)], policy_dir, 3,
                                           sampling=sampling)
    assert raised.value.field == field
    assert storage.list(raw_prefix(3)) == []


BEYOND_FLOAT64 = st.one_of(
    st.integers(min_value=2 * 10**308, max_value=10**6000),
    st.integers(min_value=-(10**6000), max_value=-2 * 10**308),
    st.fractions(min_value=Fraction(10**400)), st.sampled_from([float("inf"), float("nan")]))
EDGES = {"temperature": BEYOND_FLOAT64, "top_p": BEYOND_FLOAT64, "min_p": BEYOND_FLOAT64,
         "top_k": st.one_of(st.integers(min_value=2**31), st.integers(max_value=-2))}


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(data=st.data(), field=st.sampled_from(sorted(EDGES)))
def test_numbers_at_the_edges_are_refused_by_name(data, field):
    """A float setting beyond float64 or not finite, a top_k beyond the engines' int32 or
    below -1: a SamplingError naming the setting (the writer and the stage turn it into
    their named errors), never an OverflowError."""
    value = data.draw(EDGES[field])
    settings_ = {"temperature": 1.0, field: value}
    with pytest.raises(SamplingError) as raised:
        SamplingParams.from_mapping(settings_)
    assert raised.value.field == field and len(str(raised.value)) < 200


def test_huge_settings_fail_the_writer_and_the_stage_by_name(storage, policy_dir):
    with pytest.raises(StepArgumentError) as raised:
        SnapshotWriter(storage).write_step(3, [good_record(0)], policy_dir, 3,
                                           sampling={"temperature": 10**400})
    assert raised.value.field == "sampling.temperature"
    SnapshotWriter(storage).write_step(3, [good_record(0)], policy_dir, 3,
                                       sampling={"temperature": 1.0})
    edit_manifest(storage, raw_prefix(3),
                  lambda m: {**m, "meta": {**m["meta"], "sampling": {"temperature": 1.0,
                                                                     "top_k": 10**400}}})
    with pytest.raises(SnapshotError) as raised:
        snapshot_stage.run(storage, 3)
    assert raised.value.field == "meta.sampling.top_k"


def test_a_tampered_manifest_setting_is_named_by_the_stage(storage, policy_dir):
    SnapshotWriter(storage).write_step(3, [good_record(0)], policy_dir, 3,
                                       sampling={"temperature": 1.0})
    edit_manifest(storage, raw_prefix(3),
                  lambda m: {**m, "meta": {**m["meta"], "sampling": {"temperature": "hot"}}})
    with pytest.raises(SnapshotError, match=r"meta\.sampling\.temperature") as raised:
        snapshot_stage.run(storage, 3)
    assert raised.value.field == "meta.sampling.temperature"


def test_greedy_settings_fold_into_one_and_labels_read_well():
    assert SamplingParams(0.0, top_p=0.5).canonical() == GREEDY
    assert SamplingParams(1.0, top_p=0.5).canonical() != GREEDY
    assert SamplingParams(1.0, top_k=1).greedy and SamplingParams(1e-7).greedy  # as SGLang
    assert SamplingParams(0.0).label == "greedy"
    assert SamplingParams(0.7, top_p=0.9, top_k=50, min_p=0.05).label == \
        "T=0.7 top_p=0.9 top_k=50 min_p=0.05"
    assert SamplingParams.from_mapping({"temperature": 1, "top_k": None}).top_k == -1
    with pytest.raises(SamplingError, match="expected a mapping"):
        SamplingParams.from_mapping([1.0])


def test_evaluation_takes_the_newest_recorded_sampler_and_the_run_configs_overrides(
        storage, policy_dir):
    from pipeline.evaluation.config import EvalConfig
    from pipeline.evaluation.regime import resolve_sampler

    writer = SnapshotWriter(storage)
    for step, sampling in ((1, {"temperature": 0.6}), (2, {"temperature": 1.0, "top_p": 0.9}),
                           (3, None), (4, {"temperature": 0.2})):
        writer.write_step(step, [good_record(0, step)], policy_dir, step, sampling=sampling)
        snapshot_stage.run(storage, step)

    sampler, source = resolve_sampler(storage, 3, EvalConfig())
    assert sampler == SamplingParams(1.0, top_p=0.9)  # step 3 recorded none; step 4 is later
    assert source == "recorded by the rollout snapshot of step 2"
    sampler, source = resolve_sampler(storage, 3, EvalConfig(top_p=0.5))
    assert sampler == SamplingParams(1.0, top_p=0.5) and source.endswith("run config")
    assert resolve_sampler(storage, 3, EvalConfig(temperature=0))[0].greedy
    assert resolve_sampler(storage, 0, EvalConfig())[0] == GREEDY
    with pytest.raises(SamplingError, match="sampling.top_p"):
        EvalConfig(top_p=2.0)

