"""Decisions about a registered version, against the embedded sqlite registry: a re-run whose
candidate is the drafter serving now changes nothing, and every decision keeps its own tags
while a promoted version's standing never turns ``refused``."""

from __future__ import annotations

import json
import math

import pytest

from pipeline.manifest import read_manifest
from pipeline.release.backend import LedgerBackend, ServingError
from pipeline.release.decisions import DecisionRecord
from pipeline.release.gate import ALREADY_CHAMPION, Candidate, EvalSummary, decide
from pipeline.release.ledger import ServingLedger
from pipeline.release.lineage import lineage_tags
from pipeline.release.mlflow_registry import CHAMPION, DrafterRegistry
from pipeline.release.promotion import (
    PromotionError,
    PromotionNotApplied,
    force_promote,
    promote,
    rollback,
)
from pipeline.storage import Storage
from tests.release.helpers import (
    POLICY,
    SETTINGS,
    lineage,
    publish_drafter,
    summary,
)

pytestmark = pytest.mark.integration


def register(registry: DrafterRegistry, storage: Storage, drafter_dir, step: int) -> str:
    """Publish and register a drafter under the fingerprint its manifest carries."""
    uri = publish_drafter(storage, step, drafter_dir)
    fingerprint = read_manifest(storage, storage.key_of(uri)).meta["fingerprint"]
    return registry.register(None, uri, lineage(fingerprint, uri, step=step)).version.version


def gate(candidate: str, tau: float, champion: EvalSummary | None):
    return decide(Candidate(summary(tau, candidate), format_ok=True), champion, None, POLICY)


def refusal(champion: str | None) -> object:
    """A refusal as the gate returned it before it knew the candidate could be the champion
    (τ compared with itself)."""
    return decide(Candidate(summary(2.0, None), True), summary(2.0, champion), None, POLICY)


def decision_tags(registry: DrafterRegistry, version: str) -> dict[str, str]:
    return {k: v for k, v in registry.get_version(version).tags.items()
            if k.startswith("gate.")}


@pytest.fixture
def champion_v1(sqlite_registry, storage, serving, drafter_dirs) -> str:
    v1 = register(sqlite_registry, storage, drafter_dirs[0], 10)
    assert promote(sqlite_registry, serving, v1, gate(v1, 2.0, None)).action == "promoted"
    return v1


@pytest.mark.parametrize("rerun", ["gate-sees-itself", "tau-equals-itself", "old-promotion"])
def test_a_rerun_whose_candidate_is_the_champion_changes_nothing(
        sqlite_registry, serving, champion_v1, rerun):
    """The bug: a re-run compared the champion with itself, recorded 'refused' and rewrote
    the champion's tags. Whatever decision the re-run brings, it is a no-op."""
    registry, v1 = sqlite_registry, champion_v1
    decision = {"gate-sees-itself": gate(v1, 2.0, summary(2.0, v1)),
                "tau-equals-itself": refusal(v1),
                "old-promotion": gate(v1, 2.0, None)}[rerun]
    tags, ledger = registry.get_version(v1).tags, serving.ledger.history()
    result = promote(registry, serving, v1, decision, dagster_run_id="rerun")
    assert result.action == ALREADY_CHAMPION and not result.moved
    assert (result.version, result.previous_champion) == (v1, v1)
    assert "serving now" in result.reasons[0] and "nothing promoted" in result.reasons[0]
    assert registry.get_version(v1).tags == tags  # nothing recorded, nothing overwritten
    assert tags["gate.decision"] == "promoted"
    assert serving.ledger.history() == ledger  # nothing restarted or republished
    assert registry.alias(CHAMPION) == v1


def test_a_drafter_registered_twice_is_recognised_by_its_fingerprint(
        sqlite_registry, serving, champion_v1):
    registry, v1 = sqlite_registry, champion_v1
    first = registry.get_version(v1)
    twin = registry.client.create_model_version(  # the same files, another version number
        registry.model_name, first.source, tags=dict(first.tags))
    result = promote(registry, serving, str(twin.version), gate(str(twin.version), 3.0, None))
    assert result.action == ALREADY_CHAMPION
    assert f"has the fingerprint of v{v1}" in result.reasons[0]
    assert decision_tags(registry, str(twin.version)) == {
        k: v for k, v in first.tags.items() if k.startswith("gate.")}  # copied, untouched
    assert len(serving.ledger.history()) == 1


def test_an_already_champion_decision_that_went_stale_is_refused(
        sqlite_registry, serving, storage, champion_v1, drafter_dirs):
    """The report measured v1 against itself, but v2 serves by now: not a no-op."""
    registry, v1 = sqlite_registry, champion_v1
    v2 = register(registry, storage, drafter_dirs[1], 20)
    force_promote(registry, serving, v2, actor="ops", reason="test")
    result = promote(registry, serving, v1, gate(v1, 2.0, summary(2.0, v1)))
    assert result.action == "refused" and "stale decision" in result.reasons[0]
    assert registry.get_version(v1).tags["gate.decision"] == "promoted"  # standing kept
    assert registry.alias(CHAMPION) == v2


def test_every_decision_keeps_its_own_tags_and_a_promotion_never_turns_refused(
        sqlite_registry, serving, storage, champion_v1, drafter_dirs):
    registry, v1 = sqlite_registry, champion_v1
    v2 = register(registry, storage, drafter_dirs[1], 20)

    worse = promote(registry, serving, v2, gate(v2, 1.5, summary(2.0, v1)), actor="gate",
                    dagster_run_id="run-a")
    assert worse.action == "refused"
    assert registry.get_version(v2).tags["gate.decision"] == "refused"  # never promoted
    first = decision_tags(registry, v2)

    better = promote(registry, serving, v2, gate(v2, 2.5, summary(2.0, v1)),
                     dagster_run_id="run-b")
    assert better.action == "promoted"
    tags = registry.get_version(v2).tags
    assert (tags["gate.decision"], tags["gate.decision_id"]) == ("promoted", "2")
    assert "beats" in registry.standing(v2).reasons[0]  # the deciding reason first
    assert tags["gate.1"] == first["gate.1"]  # decision 1 as written

    rollback(registry, serving, actor="ops", reason="τ regressed")
    later = promote(registry, serving, v2, gate(v2, 1.9, summary(2.0, v1)),
                    dagster_run_id="run-c")
    assert later.action == "refused"
    tags = registry.get_version(v2).tags
    assert (tags["gate.decision"], tags["gate.decision_id"]) == ("promoted", "2")

    history = registry.decisions(v2)
    assert [(n, d.decision, d.run_id, d.champion) for n, d in history.items()] == [
        (1, "refused", "run-a", v1), (2, "promoted", "run-b", v1), (3, "refused", "run-c", v1)]
    assert history[1].actor == "gate" and history[2].baseline == "champion"
    assert history[2].relative_gain == pytest.approx(0.25)
    assert any("worse" in r for r in history[3].reasons)


def test_a_forced_promotion_is_a_decision_too(sqlite_registry, serving, storage, champion_v1,
                                              drafter_dirs):
    registry, v1 = sqlite_registry, champion_v1
    v2 = register(registry, storage, drafter_dirs[1], 20)
    force_promote(registry, serving, v2, actor="bob", reason="INC-42", dagster_run_id="r")
    (forced,) = registry.decisions(v2).values()
    assert (forced.decision, forced.actor, forced.champion, forced.baseline) == (
        "forced", "bob", v1, "override")
    assert forced.reasons == ("forced by bob: INC-42",) and math.isnan(forced.relative_gain)
    assert registry.get_version(v2).tags["gate.decision"] == "forced"
    again = force_promote(registry, serving, v2, actor="bob", reason="again")
    assert again.action == ALREADY_CHAMPION and len(registry.decisions(v2)) == 1


class _FailingApply(LedgerBackend):
    """Serving that refuses every update (a restart hook that keeps failing)."""

    def apply(self, target, *, reason, details=None):
        raise ServingError("restart hook timed out")


def test_a_promotion_that_was_not_applied_stays_a_decision_not_a_standing(
        sqlite_registry, storage, champion_v1, drafter_dirs):
    registry, v1 = sqlite_registry, champion_v1
    v2 = register(registry, storage, drafter_dirs[1], 20)
    failing = _FailingApply(ServingLedger(storage, registry.model_name), SETTINGS)
    promote(registry, failing, v2, gate(v2, 1.5, summary(2.0, v1)))  # refused first
    with pytest.raises(PromotionNotApplied, match="restart hook timed out"):
        promote(registry, failing, v2, gate(v2, 2.5, summary(2.0, v1)))
    tags = registry.get_version(v2).tags
    assert registry.decisions(v2)[2].decision == "promoted"
    assert "restart hook timed out" in tags["gate.2.error"]
    assert tags["gate.decision"] == "refused"  # what counts: it was not promoted
    assert registry.alias(CHAMPION) == v1


def test_a_champion_whose_standing_cannot_be_written_fails_loudly(
        sqlite_registry, serving, storage, champion_v1, drafter_dirs, monkeypatch):
    registry, v1 = sqlite_registry, champion_v1
    v2 = register(registry, storage, drafter_dirs[1], 20)

    def down(version, n):
        raise ConnectionError("registry went away")

    monkeypatch.setattr(registry, "set_standing", down)
    with pytest.raises(PromotionError, match=rf"v{v2} is champion and served, but"):
        promote(registry, serving, v2, gate(v2, 2.5, summary(2.0, v1)))
    assert registry.alias(CHAMPION) == v2  # the switch stands; the error says what is missing


def test_a_decision_number_is_never_reused(sqlite_registry, storage, drafter_dirs):
    registry = sqlite_registry
    v = register(registry, storage, drafter_dirs[0], 10)
    record = DecisionRecord("refused", ("gain: worse",), "gate", "t0", "champion", -0.1, "3")
    assert [registry.record_decision(v, record) for _ in range(3)] == [1, 2, 3]
    registry.client.delete_model_version_tag(registry.model_name, v, "gate.2")
    assert registry.record_decision(v, record) == 4
    assert registry.decisions(v)[1] == record


def test_decision_records_round_trip_through_one_tag():
    long = DecisionRecord("refused", ("x" * 6000, "second"), "gate", "t", "no-drafter", math.nan)
    text = long.to_tag()
    entry = json.loads(text)
    assert len(json.dumps(entry["reasons"])) <= 5000 and entry["reasons"][0].endswith("...")
    assert "run_id" not in entry and entry["champion"] == "none"
    assert entry["relative_gain"] is None  # NaN: JSON has no spelling for it
    back = DecisionRecord.from_tag(text)
    assert back.reasons == tuple(entry["reasons"]) and back.champion is None
    assert math.isnan(back.relative_gain)
    record = DecisionRecord("promoted", ("beats v3",), "gate", "t", "champion", 0.25, "3", "r")
    assert DecisionRecord.from_tag(record.to_tag()) == record
    with pytest.raises(ValueError, match="decision"):
        DecisionRecord("maybe", (), "gate", "t", "champion", 0.0)


def test_a_version_shows_a_few_rounded_tags(sqlite_registry, serving, storage, drafter_dirs):
    """The headline, one lineage record, one tag per decision and the standing: nothing
    else, and every float rounded; the training run keeps each key."""
    registry = sqlite_registry
    v1 = register(registry, storage, drafter_dirs[0], 10)
    assert promote(registry, serving, v1, gate(v1, 2.0, None)).action == "promoted"
    tags = registry.get_version(v1).tags
    assert set(tags) == {"fingerprint", "rl_step", "tau", "lineage", "gate.1", "gate.decision",
                         "gate.decision_id", "previous_champion"}, sorted(tags)
    assert len(tags["tau"].split(".")[-1]) <= 4  # rounded: the run keeps every digit
    lineage = registry.get_version(v1).lineage
    assert lineage["rl_step_window"] == [8, 9, 10] and lineage["alpha"] == [0.8, 0.6, 0.4]
    assert registry.get_version(v1).drafter_uri == lineage["drafter_uri"]
    assert "gate: promoted" in registry.client.get_model_version(
        registry.model_name, v1).description.lower()


def test_a_version_registered_with_one_tag_per_field_is_still_read(
        sqlite_registry, serving, storage, drafter_dirs):
    """Versions registered before the compact layout: their lineage, decisions and standing
    read as before, and a new decision takes the next number."""
    registry = sqlite_registry
    uri = publish_drafter(storage, 10, drafter_dirs[0])
    fingerprint = read_manifest(storage, storage.key_of(uri)).meta["fingerprint"]
    old = {**lineage_tags(lineage(fingerprint, uri, step=10)),
           "gate.1.decision": "refused", "gate.1.reasons": '["worse than v7"]',
           "gate.1.actor": "gate", "gate.1.decided_at": "t0", "gate.1.baseline": "champion",
           "gate.1.relative_gain": "-0.2", "gate.1.champion": "7",
           "gate.decision": "refused", "gate.decision_id": "1", "gate.reasons": '["x"]'}
    registry.ensure_model()
    v = str(registry.client.create_model_version(registry.model_name, uri, tags=old).version)
    found = registry.get_version(v)
    assert found.drafter_uri == uri and found.lineage["rl_step_window"] == [8, 9, 10]
    assert "gate.1.decision" not in found.lineage and "gate.decision" not in found.lineage
    (first,) = registry.decisions(v).values()
    assert (first.decision, first.reasons, first.champion, first.relative_gain) == (
        "refused", ("worse than v7",), "7", -0.2)
    assert registry.standing(v) == first
    assert "gate.reasons" in registry.get_version(v).tags  # the old standing's copy
    assert promote(registry, serving, v, gate(v, 2.0, None)).action == "promoted"
    assert sorted(registry.decisions(v)) == [1, 2] and registry.standing(v).decision == \
        "promoted"
    assert "gate.reasons" not in registry.get_version(v).tags  # no stale copy beside it
