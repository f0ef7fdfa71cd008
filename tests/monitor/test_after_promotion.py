"""What ``serving_drafter`` makes of a promotion after the gate: which promotions are
verified, how, and what the promotion and its ``promotion_verified`` check then say
(:func:`pipeline.monitor.stage.after_promotion`). The live probe and the rollback are
replaced here; their own tests run them for real (tests/release/promotion)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipeline.monitor import stage
from pipeline.monitor.verify import Verification, VerifyPolicy
from pipeline.release.promotion import PromotionResult

PROMOTED = PromotionResult("promoted", "m", "3", "2", None, ("τ 2.4 beats 2.1",))


class Registry:
    def __init__(self, tags: dict | None = None):
        self.tags = tags or {}

    def get_version(self, version):
        return SimpleNamespace(tags=self.tags)


def verdict(name: str) -> Verification:
    return Verification("3", "live", name, f"τ {name}", gated_tau=2.4, floor=1.9, tau=1.2,
                        tau_low=1.1, tau_high=1.3, cycles=40)


def after(p=PROMOTED, registry=None, verify="live", checked=None, monkeypatch=None):
    probes = []
    if monkeypatch is not None:
        monkeypatch.setattr(stage, "verify_promotion",
                            lambda *a, **k: probes.append(a) or checked)
    out = stage.after_promotion(None, registry or Registry(), p, 7, verify=verify,
                                serving=lambda: "backend", urls=["http://127.0.0.1:1"],
                                policy=VerifyPolicy())
    return out, probes


@pytest.mark.parametrize("action", ["refused", "forced", "rolled_back"])
def test_only_a_new_champion_is_verified(action):
    p = PromotionResult(action, "m", "3", "2", None, ())
    out, _ = after(p)
    assert (out.promotion, out.outcome.passed, out.verification) == (p, None, None)
    assert out.outcome.description == f"{action}: no new drafter to verify"


def test_a_rerun_reads_the_verdict_already_recorded(monkeypatch):
    out, probes = after(registry=Registry({stage.VERDICT_TAG: "broken"}),
                        monkeypatch=monkeypatch)
    assert probes == [] and not out.outcome.passed and out.promotion == PROMOTED
    out, _ = after(registry=Registry({stage.VERDICT_TAG: "healthy"}))
    assert out.outcome.passed and "verified already: healthy" in out.outcome.description


@pytest.mark.parametrize("verify, says", [("off", "off (AERIE_SERVING_VERIFY)"),
                                          ("reported", "RL engine reports")])
def test_verification_elsewhere_or_off_probes_nothing(monkeypatch, verify, says):
    out, probes = after(verify=verify, monkeypatch=monkeypatch)
    assert probes == [] and says in out.outcome.description
    assert out.outcome.passed is None  # pending or off: not evaluated, never green


def test_a_healthy_live_verdict_keeps_the_promotion(monkeypatch):
    checked = stage.Checked(verdict("healthy"))
    out, probes = after(checked=checked, monkeypatch=monkeypatch)
    assert len(probes) == 1 and probes[0][2] == "backend" and probes[0][4] == "3"
    assert out.promotion == PROMOTED and out.outcome.passed
    assert out.verification == checked.verification


def test_a_broken_live_verdict_says_the_promotion_was_rolled_back(monkeypatch):
    back = PromotionResult("rolled_back", "m", "2", "3", None, ("post-promotion check",))
    out, _ = after(checked=stage.Checked(verdict("broken"), back), monkeypatch=monkeypatch)
    assert out.promotion == PromotionResult("rolled_back", "m", "2", "3", None,
                                            ("τ 2.4 beats 2.1", "post-promotion check"))
    assert not out.outcome.passed
    assert out.outcome.description == ("v3 broken after promotion: τ broken; rolled back to "
                                       "v2")
    assert out.outcome.metadata["rolled_back_to"] == "2"


def test_a_broken_verdict_not_rolled_back_says_why():
    checked = stage.Checked(verdict("broken"), None, "v4 serves by now")
    outcome = stage.outcome_of(checked)
    assert not outcome.passed and outcome.description.endswith("not rolled back: v4 serves "
                                                               "by now")
    assert stage.outcome_of(stage.Checked(None, note="nothing serves")).passed is None


def test_an_undecided_verdict_is_pending_not_passed():
    outcome = stage.outcome_of(stage.Checked(verdict("undecided")))
    assert outcome.passed is None and outcome.description.startswith("v3 pending")
    assert stage.outcome_of(stage.Checked(verdict("healthy"))).passed is True
