"""Promotion, manual override and rollback: alias and servers move together or not at all."""

from __future__ import annotations

import json
import sys
import threading

import pytest

from pipeline.release.backend import LedgerBackend
from pipeline.release.ledger import ServingLedger
from pipeline.release.lock import LockTimeout
from pipeline.release.mlflow_registry import CHAMPION
from pipeline.release.promotion import (
    ROLLED_BACK,
    PromotionError,
    force_promote,
    promote,
    rollback,
)
from pipeline.release.restart import RestartHook
from pipeline.serving_now import resolve_serving
from tests.conftest import on_every_storage
from tests.release.helpers import (
    SETTINGS,
    gate,
    register,
    served_version,
    summary,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def champion_v1(sqlite_registry, storage, serving, drafter_dirs):
    """v1 registered and promoted against no drafter; v2 registered, not promoted."""
    v1 = register(sqlite_registry, storage, drafter_dirs[0], 10)
    result = promote(sqlite_registry, serving, v1, gate(2.0, None))
    assert result.action == "promoted"
    v2 = register(sqlite_registry, storage, drafter_dirs[1], 20)
    return v1, v2


def test_promotions_move_alias_and_serving_and_record_lineage(sqlite_registry, serving,
                                                              storage, champion_v1, tmp_path):
    registry, (v1, v2) = sqlite_registry, champion_v1
    assert registry.alias(CHAMPION) == v1 and served_version(serving) == v1
    tags = registry.get_version(v1).tags
    assert tags["previous_champion"] == "none" and tags["gate.decision"] == "promoted"
    assert "no drafter" in registry.standing(v1).reasons[0]

    result = promote(registry, serving, v2, gate(2.5, summary(2.0, v1)),
                     dagster_run_id="run-9")
    assert result.action == "promoted" and result.previous_champion == v1
    assert registry.alias(CHAMPION) == v2 and served_version(serving) == v2
    tags = registry.get_version(v2).tags
    assert tags["previous_champion"] == v1 and registry.standing(v2).run_id == "run-9"
    assert serving.current().previous_sequence == 1 and serving.current().sequence == 2

    launch = resolve_serving(storage, registry.model_name, tmp_path / "cache")
    assert (launch.drafter_dir / "config.json").is_file()
    assert launch.args[launch.args.index("--speculative-draft-model-path") + 1] == \
        str(launch.drafter_dir)
    assert launch.drafter_dir.parent == tmp_path / "cache"  # a verified copy
    assert (launch.drafter_dir / "model.safetensors").read_bytes() == storage.read_bytes(
        "drafters/step=000020/model.safetensors")
    assert promote(registry, serving, v2, gate(2.5, summary(2.0, v1))).action == \
        "already_champion"


def test_a_worse_candidate_is_refused_and_nothing_moves(sqlite_registry, serving, champion_v1):
    registry, (v1, v2) = sqlite_registry, champion_v1
    before = serving.current()
    result = promote(registry, serving, v2, gate(1.9, summary(2.0, v1)))
    assert result.action == "refused" and not result.moved
    assert registry.alias(CHAMPION) == v1 and serving.current() == before
    tags = registry.get_version(v2).tags
    assert tags["gate.decision"] == "refused" and "worse" in registry.standing(v2).reasons[0]
    assert "previous_champion" not in tags
    described = registry.client.get_model_version(registry.model_name, v2).description
    assert "Gate: refused, gain: candidate τ 1.9000 is worse than champion" in described


def test_a_failed_serving_update_leaves_the_old_drafter_and_alias(sqlite_registry, storage,
                                                                  champion_v1, tmp_path):
    registry, (v1, v2) = sqlite_registry, champion_v1
    hook = RestartHook([sys.executable, "-c", "import sys; sys.exit('no GPU left')",
                        "{drafter_dir}"], SETTINGS, timeout_s=30)
    failing = LedgerBackend(ServingLedger(storage, registry.model_name), SETTINGS, hook,
                            cache_dir=tmp_path / "cache")
    before = failing.current()
    with pytest.raises(PromotionError, match="serving update failed.*no GPU left"):
        promote(registry, failing, v2, gate(2.5, summary(2.0, v1)))
    assert registry.alias(CHAMPION) == v1 and failing.current() == before
    assert "no GPU left" in registry.get_version(v2).tags["promotion.error"]


@pytest.mark.parametrize("fault", ["raises", "lost-write"])
def test_a_failed_alias_move_undoes_the_serving_update(sqlite_registry, storage, champion_v1,
                                                       tmp_path, monkeypatch, fault):
    registry, (v1, v2) = sqlite_registry, champion_v1
    calls = tmp_path / "hook-calls.txt"
    hook = RestartHook([sys.executable, "-c", "import sys; open(sys.argv[1], 'a')"
                        ".write(sys.argv[2] + '\\n')", str(calls), "{registry_version}"],
                       SETTINGS, timeout_s=30)
    backend = LedgerBackend(ServingLedger(storage, registry.model_name), SETTINGS, hook,
                            cache_dir=tmp_path / "cache")
    real = registry.set_alias

    def broken(alias, version):
        if alias != CHAMPION:
            return real(alias, version)
        if fault == "raises":
            raise ConnectionError("registry went away")
        # "lost-write": the call returns but another writer's value is what sticks

    monkeypatch.setattr(registry, "set_alias", broken)
    with pytest.raises(PromotionError, match="serving update was undone") as info:
        promote(registry, backend, v2, gate(2.5, summary(2.0, v1)))
    assert ("registry went away" if fault == "raises" else "read back '1'") in str(info.value)
    assert registry.alias(CHAMPION) == v1 and served_version(backend) == v1
    assert backend.current().restored_from == 1
    assert calls.read_text().split() == [v2, v1]  # servers got v2, then v1 back


def test_rollback_restores_the_previous_champion(sqlite_registry, serving, champion_v1,
                                                 storage, tmp_path):
    registry, (v1, v2) = sqlite_registry, champion_v1
    promote(registry, serving, v2, gate(2.5, summary(2.0, v1)))
    result = rollback(registry, serving, actor="alice", reason="τ regressed in prod")
    assert result.action == "rolled_back" and result.version == v1
    assert registry.alias(CHAMPION) == v1 and served_version(serving) == v1
    rolled = json.loads(registry.get_version(v2).tags[ROLLED_BACK])
    assert (rolled["by"], rolled["reason"]) == ("alice", "τ regressed in prod")

    # v1 was promoted against no drafter: rolling back again serves no drafter
    result = rollback(registry, serving, actor="alice", reason="drafter off")
    assert result.version is None and registry.alias(CHAMPION) is None
    assert serving.current().target is None and serving.current().sglang_args == ()
    launch = resolve_serving(storage, registry.model_name, tmp_path / "cache")
    assert launch.drafter_dir is None and launch.args == ()
    with pytest.raises(PromotionError, match="no champion"):
        rollback(registry, serving)


def test_force_promote_records_who_and_why(sqlite_registry, serving, champion_v1):
    registry, (v1, v2) = sqlite_registry, champion_v1
    with pytest.raises(ValueError, match="actor and reason"):
        force_promote(registry, serving, v2, actor="", reason="x")
    result = force_promote(registry, serving, v2, actor="bob", reason="hotfix for INC-42")
    assert result.action == "forced" and registry.alias(CHAMPION) == v2
    tags = registry.get_version(v2).tags
    forced = registry.standing(v2)
    assert (forced.actor, forced.reasons) == ("bob", ("forced by bob: hotfix for INC-42",))
    assert tags["gate.decision"] == "forced" and tags["previous_champion"] == v1
    assert served_version(serving) == v2
    assert rollback(registry, serving).version == v1


def test_a_stale_decision_is_refused(sqlite_registry, serving, storage, champion_v1,
                                     drafter_dirs):
    registry, (v1, v2) = sqlite_registry, champion_v1
    v3 = register(registry, storage, drafter_dirs[2], 30)
    decision = gate(2.5, summary(2.0, v1))  # evaluated while v1 was champion
    force_promote(registry, serving, v2, actor="bob", reason="test")
    result = promote(registry, serving, v3, decision)
    assert result.action == "refused" and "stale decision" in result.reasons[0]
    assert registry.alias(CHAMPION) == v2 and served_version(serving) == v2


def test_concurrent_promotions_serialise(sqlite_registry, serving, storage, champion_v1,
                                         drafter_dirs):
    registry, (v1, v2) = sqlite_registry, champion_v1
    v3 = register(registry, storage, drafter_dirs[2], 30)
    results = {}

    def run(version):
        results[version] = promote(registry, serving, version, gate(2.5, summary(2.0, v1)))

    threads = [threading.Thread(target=run, args=(v,)) for v in (v2, v3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    actions = sorted(r.action for r in results.values())
    assert actions == ["promoted", "refused"]
    winner = next(v for v, r in results.items() if r.action == "promoted")
    assert registry.alias(CHAMPION) == winner and served_version(serving) == winner
    assert len(serving.ledger.history()) == 2  # v1, then the winner only


def test_promotion_waits_for_the_lock(sqlite_registry, serving, champion_v1):
    registry, (v1, v2) = sqlite_registry, champion_v1
    registry.lock_timeout_s = 0.3
    with registry.promotion_lock():
        with pytest.raises(LockTimeout):
            promote(registry, serving, v2, gate(2.5, summary(2.0, v1)))
    assert registry.alias(CHAMPION) == v1


def test_a_rollbacks_follow_up_runs_while_it_holds_the_lock(sqlite_registry, serving,
                                                            champion_v1):
    """``on_applied`` (serving_acceptance records its event there, outside the promotion
    pool) runs after the change and before the lock is released: a promotion waits."""
    registry, (v1, v2) = sqlite_registry, champion_v1
    promote(registry, serving, v2, gate(2.5, summary(2.0, v1)))
    registry.lock_timeout_s = 0.3
    seen = []

    def follow_up(result):
        seen.append((result.version, served_version(serving)))
        with pytest.raises(LockTimeout):
            promote(registry, serving, v2, gate(2.5, summary(2.0, v1)))

    rollback(registry, serving, actor="check", expected=v2, on_applied=follow_up)
    assert seen == [(v1, v1)] and served_version(serving) == v1


def test_the_serving_record_is_the_champion_and_a_disagreeing_alias_is_refused(
        sqlite_registry, storage, serving, drafter_dirs):
    """Promotion reads the same record as warm start and evaluation (the serving record);
    an alias moved behind its back stops promotion and rollback until a forced promotion
    reconciles both."""
    from pipeline.serving_now import serving_drafter_key

    v1 = register(sqlite_registry, storage, drafter_dirs[0], 1)
    v2 = register(sqlite_registry, storage, drafter_dirs[1], 2)
    assert promote(sqlite_registry, serving, v1, gate(2.0, None)).action == "promoted"
    assert serving_drafter_key(storage, sqlite_registry.model_name) == \
        storage.key_of(sqlite_registry.get_version(v1).drafter_uri)
    sqlite_registry.set_alias(CHAMPION, v2)  # moved by hand, servers still run v1
    with pytest.raises(PromotionError, match=rf"serves v{v1} but alias champion is v{v2}"):
        promote(sqlite_registry, serving, v2, gate(3.0, summary(2.0, v1)))
    with pytest.raises(PromotionError, match="reconcile"):
        rollback(sqlite_registry, serving, actor="t", reason="r")
    forced = force_promote(sqlite_registry, serving, v2, actor="t", reason="reconcile")
    assert forced.action == "forced" and forced.previous_champion == v1
    assert served_version(serving) == v2 == sqlite_registry.alias(CHAMPION)


def test_reconciling_a_lagging_alias_keeps_the_rollback_chain(
        sqlite_registry, storage, serving, drafter_dirs):
    """Servers run v2 but alias champion was moved back to v1: forcing v2 only moves the
    alias; v2 keeps v1 as its previous champion, so a rollback still restores v1."""
    from pipeline.release.promotion import PREVIOUS_CHAMPION

    v1 = register(sqlite_registry, storage, drafter_dirs[0], 1)
    v2 = register(sqlite_registry, storage, drafter_dirs[1], 2)
    promote(sqlite_registry, serving, v1, gate(2.0, None))
    promote(sqlite_registry, serving, v2, gate(3.0, summary(2.0, v1)))
    sqlite_registry.set_alias(CHAMPION, v1)
    r = force_promote(sqlite_registry, serving, v2, actor="ops", reason="realign alias")
    assert r.action == "forced" and sqlite_registry.alias(CHAMPION) == v2
    assert sqlite_registry.get_version(v2).tags[PREVIOUS_CHAMPION] == v1
    assert rollback(sqlite_registry, serving, actor="ops", reason="r").version == v1
    assert served_version(serving) == v1 == sqlite_registry.alias(CHAMPION)


@on_every_storage
def test_an_undo_never_overwrites_someone_elses_update(sqlite_registry, storage, serving,
                                                      champion_v1, drafter_dirs, monkeypatch):
    """The alias move fails after another writer changed serving (a promoter without the
    lock): the undo refuses rather than put the old drafter back over that update."""
    from pipeline.release.promotion import serving_target

    registry, (v1, v2) = sqlite_registry, champion_v1
    v3 = register(registry, storage, drafter_dirs[2], 30)
    real = registry.set_alias

    def interleaved(alias, version):
        if alias != CHAMPION:
            return real(alias, version)
        serving.apply(serving_target(registry.get_version(v3)), reason="another writer")
        raise ConnectionError("registry went away")

    monkeypatch.setattr(registry, "set_alias", interleaved)
    with pytest.raises(PromotionError, match="serving moved on from this promotion's "
                                             "manifest 2 to 3"):
        promote(registry, serving, v2, gate(2.5, summary(2.0, v1)))
    assert served_version(serving) == v3  # the other writer's update stands
    assert len(serving.ledger.history()) == 3


def test_an_alias_move_that_cannot_be_read_back_is_not_undone(sqlite_registry, serving,
                                                              champion_v1, monkeypatch):
    """The registry took the move, only the read-back failed: serving keeps the new drafter
    (undoing it would split alias and serving), and the error says what to check."""
    registry, (v1, v2) = sqlite_registry, champion_v1
    real_set, real_alias, moved = registry.set_alias, registry.alias, []

    def set_alias(alias, version):
        real_set(alias, version)
        moved.append(alias)

    def alias(name):
        if CHAMPION in moved:
            raise ConnectionError("registry went away")
        return real_alias(name)

    monkeypatch.setattr(registry, "set_alias", set_alias)
    monkeypatch.setattr(registry, "alias", alias)
    with pytest.raises(PromotionError, match="accepted moving champion to v2 but reading it "
                                             "back failed .*serving serves v2"):
        promote(registry, serving, v2, gate(2.5, summary(2.0, v1)))
    monkeypatch.undo()
    assert registry.alias(CHAMPION) == v2 and served_version(serving) == v2
