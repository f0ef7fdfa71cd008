"""A refresh step's release end to end on a tiny world: evaluate -> register -> gate -> serve.

Random drafters cannot beat greedy decoding, so the gate must refuse them; a forced
champion is then measured as the champion of the next candidate's report.
"""

from __future__ import annotations

import uuid

import pytest

from pipeline.eagle3.spec import SpecParams
from pipeline.evaluation import stage as evaluation_stage
from pipeline.evaluation.config import EvalConfig
from pipeline.release import register as register_stage
from pipeline.release import serve as serve_stage
from pipeline.release.backend import LedgerBackend
from pipeline.release.gate import GatePolicy
from pipeline.release.ledger import ServingLedger
from pipeline.release.mlflow_registry import DrafterRegistry
from pipeline.release.promotion import force_promote
from pipeline.release.register import ReleaseError
from pipeline.serving_now import serving_drafter_key
from tests.evaluation.world import SETTINGS, STEPS, eval_world, publish_drafter
from tests.release.helpers import as_refresh

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return eval_world(tmp_path_factory.mktemp("eval-world") / "storage")

CONFIG = EvalConfig(max_prompts=4, max_new_tokens=10, **SETTINGS)
# Random drafters get an accept now and then (τ ≈ 1.03 here): demand +50%.
STRICT = GatePolicy(min_relative_gain=0.5, min_cycles=1)


@pytest.fixture
def registry(sqlite_tracking, tmp_path) -> DrafterRegistry:
    tracking, artifacts = sqlite_tracking
    return DrafterRegistry.connect(tracking, f"release-{uuid.uuid4().hex[:8]}",
                                   artifact_location=artifacts,
                                   lock_path=tmp_path / "promotion.lock")


def test_a_worse_candidate_is_registered_but_refused(world, registry, tmp_path):
    storage, target = world
    prefix = as_refresh(storage, 2, publish_drafter(storage, target, 2, seed=5, tmp=tmp_path),
                        "f" * 64)
    report = evaluation_stage.run(storage, 2, prefix, None, CONFIG)
    reg = register_stage.run(storage, registry, 2, "run-1")
    v = reg.registration.version
    assert v.fingerprint == "f" * 64 and "challenger" in v.aliases
    assert v.lineage["rl_step_window"] == list(STEPS)
    assert v.lineage["heldout_key"] == report.heldout_key
    assert float(v.tags["tau"]) == round(report.contestants["candidate"].tau, 4)  # shown rounded
    again = register_stage.run(storage, registry, 2, "run-2")
    assert again.registration.version.version == v.version  # idempotent

    serving = LedgerBackend(ServingLedger(storage, registry.model_name),
                            SpecParams(3, 1, 4))
    r = serve_stage.run(storage, registry, serving, 2, STRICT)
    assert not r.decision.promote and r.promotion.action == "refused"
    assert any(x.startswith("gain:") for x in r.decision.reasons)  # τ ≈ 1 cannot beat 1
    assert registry.champion() is None and serving.current() is None
    assert serving_drafter_key(storage, registry.model_name) is None

    # A forced champion is what the next report measures, and the gate compares with it.
    force_promote(registry, serving, v.version, actor="test", reason="seed a champion")
    assert serving_drafter_key(storage, registry.model_name) == prefix
    nxt = as_refresh(storage, 1, publish_drafter(storage, target, 1, seed=6, tmp=tmp_path),
                     "e" * 64)
    evaluation_stage.run(storage, 1, nxt, serving_drafter_key(storage, registry.model_name), CONFIG)
    register_stage.run(storage, registry, 1, "run-3")
    r3 = serve_stage.run(storage, registry, serving, 1, STRICT)
    assert r3.decision.baseline == "champion" and r3.decision.champion_version == v.version
    assert not r3.decision.promote and r3.promotion.action == "refused"
    assert registry.champion().version == v.version
    assert serving.current().target.fingerprint == "f" * 64


def test_registration_refuses_a_report_of_another_drafter(world, registry, tmp_path):
    storage, target = world
    prefix = as_refresh(storage, 2, publish_drafter(storage, target, 2, seed=7, tmp=tmp_path),
                        "a" * 64)
    evaluation_stage.run(storage, 2, prefix, None, CONFIG)
    as_refresh(storage, 2, publish_drafter(storage, target, 2, seed=8, tmp=tmp_path), "b" * 64)
    with pytest.raises(ReleaseError, match="re-run acceptance_eval"):
        register_stage.run(storage, registry, 2, "run")
