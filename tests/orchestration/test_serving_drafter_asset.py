"""``serving_drafter`` materialized in-process against the embedded sqlite registry and a
storage root under tmp: re-running a refresh whose candidate is the drafter serving now
succeeds, says ``already_champion`` and leaves the serving record and the champion's
registry tags exactly as they were."""

from __future__ import annotations

import uuid

import pytest
from dagster import materialize

from assets.release import serving_drafter
from pipeline.contracts import Manifest
from pipeline.evaluation.metrics import AcceptanceStats
from pipeline.evaluation.stage import (
    EVAL_KIND,
    NO_DRAFTER,
    REPORT_FILE,
    REPORT_SCHEMA_VERSION,
    AcceptanceReport,
    Contestant,
)
from pipeline.layout import eval_prefix
from pipeline.manifest import entry_for, read_manifest, write_manifest
from pipeline.records import to_dict, to_json
from pipeline.serving_now import read_serving, serving_history
from resources.mlflow import MlflowResource
from resources.refresh import RefreshPolicyResource
from resources.serving import ServingResource
from tests.conftest import ver
from tests.release.helpers import lineage, make_drafter_dir, publish_drafter

pytestmark = pytest.mark.integration

STEP, PARTITION = 10, "step-000010"
DRAFTER_STATS = AcceptanceStats(  # τ = 600 / 300 = 2
    num_steps=3, prompts=4, cycles=300, emitted_tokens=600, bonus_tokens=300,
    prefill_tokens=4, accept_hist=[100, 100, 100, 0], position_attempts=[300, 200, 100],
    position_accepts=[200, 100, 0])
BASELINE_STATS = AcceptanceStats(num_steps=0, prompts=4, cycles=300, emitted_tokens=300,
                                 bonus_tokens=300, prefill_tokens=4)


@pytest.fixture
def world(instance, local_storage, tmp_path):
    """A drafter published at refresh step 10 and registered as version 1."""
    storage, storage_resource = local_storage
    mlflow = MlflowResource(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                            artifact_location=(tmp_path / "artifacts").as_uri(),
                            target_family=f"t{uuid.uuid4().hex[:10]}",
                            lock_dir=str(tmp_path / "locks"), lock_timeout_s=30)
    uri = publish_drafter(storage, STEP, make_drafter_dir(tmp_path / "drafter"))
    fingerprint = read_manifest(storage, storage.key_of(uri)).meta["fingerprint"]
    registry = mlflow.build()
    registry.register(None, uri, lineage(fingerprint, uri, step=STEP))
    instance.add_dynamic_partitions("refresh_steps", [PARTITION])
    resources = {"storage": storage_resource, "mlflow": mlflow, "serving": ServingResource(),
                 "refresh": RefreshPolicyResource()}
    return instance, storage, registry, resources, (uri, fingerprint)


def write_report(storage, drafter: tuple[str, str], *, with_champion: bool) -> None:
    """The acceptance report of step 10: the candidate (and, re-evaluated after its
    promotion, the same drafter as champion) against no drafter."""
    uri, fingerprint = drafter
    measured = Contestant("candidate", uri, fingerprint, to_dict(DRAFTER_STATS), 4)
    contestants = {"candidate": measured,
                   NO_DRAFTER: Contestant(NO_DRAFTER, None, None, to_dict(BASELINE_STATS), 4)}
    if with_champion:
        contestants["champion"] = Contestant("champion", uri, fingerprint,
                                             to_dict(DRAFTER_STATS), 4)
    report = AcceptanceReport(
        step=STEP, policy_uri="file:///policy", policy_sha256="p" * 64,
        heldout={"prompts": 4}, settings={"num_steps": 3}, heldout_key="H", settings_key="S",
        contestants=contestants, fingerprint=f"report-{with_champion}", seconds=1.0)
    prefix = eval_prefix(STEP)
    written = storage.write_bytes(f"{prefix}/{REPORT_FILE}", to_json(report).encode())
    write_manifest(storage, prefix, Manifest(
        kind=EVAL_KIND, kind_version=REPORT_SCHEMA_VERSION, files=(entry_for(prefix, written),),
        meta={"step": STEP, "fingerprint": report.fingerprint}))


def serve(instance, resources) -> dict:
    """The gate's event: a materialization when the champion moved, else an observation
    (the partition stays unmaterialized); ``"event"`` says which."""
    result = materialize([serving_drafter], instance=instance, resources=resources,
                         partition_key=PARTITION)
    assert result.success
    events = {"materialization": result.asset_materializations_for_node("serving_drafter"),
              "observation": result.asset_observations_for_node("serving_drafter")}
    ((kind, (event,)),) = [(k, e) for k, e in events.items() if e]
    return {"event": kind, **{k: v.value for k, v in event.metadata.items()}}


@pytest.mark.parametrize("rerun", ["same-report", "re-evaluated-against-itself"])
def test_a_rerun_of_the_served_drafter_changes_nothing_and_says_so(world, rerun):
    instance, storage, registry, resources, drafter = world
    write_report(storage, drafter, with_champion=False)
    first = serve(instance, resources)
    assert (first["action"], ver(first["champion"]), ver(first["previous_champion"])) == (
        "promoted", "1", "none")
    assert first["event"] == "materialization"  # what serves changed
    champion_tags = registry.get_version("1").tags
    ledger = serving_history(storage, registry.model_name)
    assert champion_tags["gate.decision"] == "promoted" and len(ledger) == 1

    if rerun == "re-evaluated-against-itself":  # what acceptance_eval measures on a re-run
        write_report(storage, drafter, with_champion=True)
    again = serve(instance, resources)
    assert (again["action"], again["promoted"]) == ("already_champion", False)
    assert again["event"] == "observation"  # nothing changed: the partition stays as it was
    assert (ver(again["champion"]), ver(again["previous_champion"])) == ("1", "1")
    assert "the drafter serving now" in again["reasons"]
    assert again["serving_sequence"] == ledger[-1].sequence
    expected = "already_champion" if rerun == "re-evaluated-against-itself" else "promote"
    assert again["decision"]["verdict"] == expected  # the gate never compared v1 with v1
    assert registry.get_version("1").tags == champion_tags  # not one tag rewritten
    assert serving_history(storage, registry.model_name) == ledger
    assert read_serving(storage, registry.model_name) == ledger[-1]
    assert registry.champion().version == "1"


def test_with_canary_share_the_gate_starts_a_canary_and_the_champion_serves_on(world):
    instance, storage, registry, resources, drafter = world
    write_report(storage, drafter, with_champion=False)
    resources = {**resources, "serving": ServingResource(canary_share=0.5)}
    event = serve(instance, resources)
    assert (event["action"], event["promoted"], event["event"]) == (
        "canary", False, "observation")  # the champion (none) serves on
    assert (ver(event["canary"]), event["canary_from_step"]) == ("1", STEP + 1)
    assert event["canary_servers"] == "50% of them" and event["candidate"].startswith("v1")
    current = read_serving(storage, registry.model_name)
    assert current.target is None and current.canary.target.registry_version == "1"
    assert registry.get_version("1").tags["gate.decision"] == "canary"
    assert registry.champion() is None
