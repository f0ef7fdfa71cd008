"""Canaries end to end in release and monitor: the gate starts one on part of the servers,
the RL engine's counters (per drafter version) decide it, and it is promoted to every server
or rolled back; the actuator of a mode with servers is called for exactly the servers whose
drafter changes."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pipeline.layout import observed_key
from pipeline.monitor import stage
from pipeline.monitor.canary import CanaryPolicy
from pipeline.monitor.observed import summarise
from pipeline.monitor.verify import VerifyPolicy
from pipeline.records import to_json
from pipeline.release.backend import LedgerBackend
from pipeline.release.canary import CanaryPlan, start_canary
from pipeline.release.ledger import ServingLedger
from pipeline.release.mlflow_registry import CHAMPION
from pipeline.release.promotion import PromotionNotApplied, force_promote, promote
from pipeline.serving_now import CANARY_SCHEMA_VERSION, resolve_serving
from tests.release.helpers import SETTINGS, gate, register, served_version, summary

pytestmark = pytest.mark.integration

FLEET = ("rollout-0", "rollout-1", "rollout-2", "rollout-3")
JUDGE = CanaryPolicy(canary_steps=3, min_verify_passes=60, min_rollouts=2)


@pytest.fixture
def canary_v2(sqlite_registry, storage, serving, drafter_dirs):
    """v1 champion; v2 passed the gate against it and serves half of the servers from RL
    step 21 on."""
    v1 = register(sqlite_registry, storage, drafter_dirs[0], 10)
    assert promote(sqlite_registry, serving, v1, gate(2.0, None)).action == "promoted"
    v2 = register(sqlite_registry, storage, drafter_dirs[1], 20)
    result = start_canary(sqlite_registry, serving, v2, gate(2.5, summary(2.0, v1)),
                          CanaryPlan(share=0.5), started_at=21)
    assert result.action == "canary"
    return v1, v2


def observe(storage, step: int, taus: dict[str, float], rollouts: int = 4,
            seed: int = 0) -> None:
    """Step ``step`` as the RL engine reported it: ``rollouts`` rollouts per drafter
    version, each about 30 verify passes at that version's τ."""
    rng = random.Random(seed * 1000 + step)
    counters = []
    for version, tau in taus.items():
        for _ in range(rollouts):
            passes = rng.randint(25, 35)
            emitted = max(passes, round(passes * (tau + rng.uniform(-0.2, 0.2))))
            counters.append({"drafter_version": version, "verify_ct": passes,
                             "completion_tokens": emitted + 1})
    storage.write_bytes(observed_key(step), to_json(summarise(step, counters)).encode())


def settle(storage, registry, serving, applied=None):
    return stage.settle_canary(
        storage, registry.model_name, lambda: (registry, serving), JUDGE, VerifyPolicy(),
        on_applied=(lambda v, r: applied.append((v.action, r.action))) if applied is not None
        else None)


def test_a_canary_serves_part_of_the_servers_and_the_champion_keeps_the_alias(
        sqlite_registry, storage, serving, canary_v2, tmp_path):
    v1, v2 = canary_v2
    current = serving.current()
    assert current.schema_version == CANARY_SCHEMA_VERSION
    assert served_version(serving) == v1 and sqlite_registry.alias(CHAMPION) == v1
    assert current.canary.target.registry_version == v2 and current.canary.started_at == 21
    served = {s: current.on(s, FLEET).target.registry_version for s in FLEET}
    assert served == {"rollout-0": v2, "rollout-1": v2, "rollout-2": v1, "rollout-3": v1}
    launch = resolve_serving(storage, sqlite_registry.model_name, tmp_path / "c",
                             server="rollout-0", fleet=FLEET)
    assert launch.manifest.target.registry_version == v2 and launch.drafter_dir.is_dir()
    plain = resolve_serving(storage, sqlite_registry.model_name, tmp_path / "c")
    assert plain.manifest.target.registry_version == v1 and plain.manifest.canary is None
    tags = sqlite_registry.get_version(v2).tags
    assert tags["gate.decision"] == "canary" and json.loads(tags["canary"])["state"] == \
        "serving"


def test_one_canary_at_a_time(sqlite_registry, storage, serving, drafter_dirs, canary_v2):
    v1, _ = canary_v2
    v3 = register(sqlite_registry, storage, drafter_dirs[2], 30)
    result = start_canary(sqlite_registry, serving, v3, gate(2.6, summary(2.0, v1)),
                          CanaryPlan(share=0.5), started_at=31)
    assert result.action == "refused" and "one canary at a time" in result.reasons[0]
    assert serving.current().canary.target.registry_version == canary_v2[1]


def test_a_canary_waits_then_is_promoted_to_every_server(sqlite_registry, storage, serving,
                                                         canary_v2):
    v1, v2 = canary_v2
    observe(storage, 20, {v1: 2.0})  # before the canary started: not counted
    for step in (21, 22):
        observe(storage, step, {v1: 2.0, v2: 2.6})
    waited = settle(storage, sqlite_registry, serving)
    assert waited.verdict.action == "wait" and waited.result is None
    assert serving.current().canary is not None
    observe(storage, 23, {v1: 2.0, v2: 2.6})
    applied = []
    done = settle(storage, sqlite_registry, serving, applied)
    assert done.verdict.action == "promote" and done.verdict.evidence.steps == (21, 22, 23)
    assert applied == [("promote", "promoted")]
    now = serving.current()
    assert now.canary is None and served_version(serving) == v2
    assert now.details["canary_decided_at_step"] == "23"  # where the loop chart marks it
    assert sqlite_registry.alias(CHAMPION) == v2
    tags = sqlite_registry.get_version(v2).tags
    assert tags["gate.decision"] == "promoted" and tags["previous_champion"] == v1
    record = json.loads(tags["canary"])
    assert record["state"] == "promoted" and record["evidence"]["steps"] == [21, 22, 23]
    assert tags[stage.VERDICT_TAG] == "healthy"  # its canary rollouts verified it
    assert json.loads(tags[stage.EVIDENCE_TAG])["source"] == "reported"
    assert settle(storage, sqlite_registry, serving).verdict is None  # nothing left to judge


def test_a_canary_that_is_not_better_is_rolled_back(sqlite_registry, storage, serving,
                                                    canary_v2):
    v1, v2 = canary_v2
    for step in (21, 22, 23):
        observe(storage, step, {v1: 2.4, v2: 2.1})
    done = settle(storage, sqlite_registry, serving)
    assert done.verdict.action == "roll_back" and done.result.action == "canary_rolled_back"
    assert serving.current().canary is None and served_version(serving) == v1
    assert serving.current().restored_from is not None
    assert sqlite_registry.alias(CHAMPION) == v1
    tags = sqlite_registry.get_version(v2).tags
    assert tags["gate.decision"] == "refused" and "is worse than" in \
        sqlite_registry.standing(v2).reasons[0]
    assert json.loads(tags["canary"])["state"] == "rolled_back"
    assert stage.VERDICT_TAG not in tags  # never champion: no post-promotion verdict


def test_a_canary_overtaken_by_another_change_is_not_concluded(sqlite_registry, storage,
                                                               serving, canary_v2):
    v1, v2 = canary_v2
    for step in (21, 22, 23):
        observe(storage, step, {v1: 2.0, v2: 2.6})
    force_promote(sqlite_registry, serving, v1, actor="ops", reason="hold on")  # served v1
    assert serving.current().canary is not None  # served already: nothing moved
    force_promote(sqlite_registry, serving, v2, actor="ops", reason="ship it")
    assert serving.current().canary is None and served_version(serving) == v2
    assert settle(storage, sqlite_registry, serving).verdict is None


class Servers:
    """An actuator on named servers that records what each activation reached."""

    mode = "sglang-restart"
    compares_with_current = False

    def __init__(self, servers=FLEET, log=None, fail_on=None):
        self.servers, self.log, self.fail_on = tuple(servers), log if log is not None \
            else [], fail_on

    def on(self, servers):
        return Servers(tuple(s for s in self.servers if s in servers), self.log, self.fail_on)

    def check(self, new_dir: Path, current_dir: Path | None) -> None:
        pass

    def activate(self, new_dir, target):
        name = target.registry_version if target else "none"
        if name == self.fail_on:
            raise RuntimeError(f"{name} does not start")
        self.log.append((self.servers, name))
        return {"servers": str(len(self.servers))}


def test_an_actuator_is_called_for_the_servers_whose_drafter_changes(
        sqlite_registry, storage, drafter_dirs, tmp_path):
    log: list = []
    serving = LedgerBackend(ServingLedger(storage, sqlite_registry.model_name), SETTINGS,
                            Servers(log=log), cache_dir=tmp_path / "cache")
    v1 = register(sqlite_registry, storage, drafter_dirs[0], 10)
    promote(sqlite_registry, serving, v1, gate(2.0, None))
    v2 = register(sqlite_registry, storage, drafter_dirs[1], 20)
    start_canary(sqlite_registry, serving, v2, gate(2.5, summary(2.0, v1)),
                 CanaryPlan(servers=("rollout-3",)), started_at=21)
    assert serving.current().canary.servers == ("rollout-3",)
    for step in (21, 22, 23):
        observe(storage, step, {v1: 2.0, v2: 2.6})
    settle(storage, sqlite_registry, serving)
    assert log == [(FLEET, v1), (("rollout-3",), v2),  # the canary's server only, then
                   (FLEET[:3], v2)]                    # the rest when it is promoted
    v3 = register(sqlite_registry, storage, drafter_dirs[2], 30)
    start_canary(sqlite_registry, serving, v3, gate(2.8, summary(2.6, v2)),
                 CanaryPlan(share=0.5), started_at=31)
    for step in (31, 32, 33):
        observe(storage, step, {v2: 2.6, v3: 2.2})
    settle(storage, sqlite_registry, serving)
    assert log[3:] == [(FLEET[:2], v3), (FLEET[:2], v2)]  # rolled back: those two again


def test_a_mode_that_addresses_all_servers_at_once_refuses_a_canary(
        sqlite_registry, storage, drafter_dirs, tmp_path):
    log: list = []
    serving = LedgerBackend(ServingLedger(storage, sqlite_registry.model_name), SETTINGS,
                            Servers(servers=(), log=log), cache_dir=tmp_path / "cache")
    v1 = register(sqlite_registry, storage, drafter_dirs[0], 10)
    promote(sqlite_registry, serving, v1, gate(2.0, None))
    v2 = register(sqlite_registry, storage, drafter_dirs[1], 20)
    with pytest.raises(PromotionNotApplied, match="addresses them all at once"):
        start_canary(sqlite_registry, serving, v2, gate(2.5, summary(2.0, v1)),
                     CanaryPlan(share=0.5), started_at=21)
    assert serving.current().canary is None and log == [((), v1)]
    tags = sqlite_registry.get_version(v2).tags
    assert "gate.decision" not in tags and "all at once" in tags["gate.1.error"]


def test_a_failed_canary_start_leaves_everything_as_it_was(sqlite_registry, storage,
                                                          drafter_dirs, tmp_path):
    serving = LedgerBackend(ServingLedger(storage, sqlite_registry.model_name), SETTINGS,
                            Servers(fail_on="2"), cache_dir=tmp_path / "cache")
    v1 = register(sqlite_registry, storage, drafter_dirs[0], 10)
    promote(sqlite_registry, serving, v1, gate(2.0, None))
    v2 = register(sqlite_registry, storage, drafter_dirs[1], 20)
    with pytest.raises(PromotionNotApplied, match="does not start"):
        start_canary(sqlite_registry, serving, v2, gate(2.5, summary(2.0, v1)),
                     CanaryPlan(share=0.5), started_at=21)
    assert serving.current().sequence == 1 and serving.current().canary is None
    assert sqlite_registry.alias(CHAMPION) == v1
