"""After a promotion: the live servers are probed (the contract server, with planted
failures), the verdict judged against the gated τ, and a broken promotion rolled back (alias
and serving), a healthy one left alone."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.evaluation.engine import evaluate
from pipeline.monitor.stage import EVIDENCE_TAG, VERDICT_TAG, VERIFY_ACTOR, _settle
from pipeline.monitor.verify import BROKEN, HEALTHY, UNDECIDED, VerifyPolicy, judge, probe
from pipeline.release.mlflow_registry import CHAMPION
from pipeline.release.promotion import ROLLED_BACK, force_promote
from pipeline.sampling import GREEDY
from tests.release.helpers import gate, register, served_version
from tests.sglang_contract import fixtures
from tests.sglang_contract.drafters import CHAIN, MAX_NEW, save_copy_drafter, spec_flags
from tests.sglang_contract.fixtures import VOCAB

pytestmark = pytest.mark.integration

POLICY = VerifyPolicy(min_tau=1.1, min_share=0.8, min_cycles=20)


def _edited(source, directory, edit):
    """A copy of the drafter in ``source`` with ``edit(tensors)`` applied to its weights."""
    shutil.copytree(source, directory)
    weights = load_file(directory / "model.safetensors")
    edit(weights)
    save_file(weights, directory / "model.safetensors")
    return directory


def _wrong_d2t(w):
    """The vocab mapping of another drafter (``d2t``/``t2d`` consistent with each other, not
    with this ``lm_head``): the draft ids map to target tokens outside the drafter's own."""
    ids = torch.arange(len(w["d2t"]))
    others = (~w["t2d"]).nonzero().flatten()[:len(ids)]
    w["d2t"] = others - ids
    w["t2d"] = torch.zeros_like(w["t2d"])
    w["t2d"][others] = True


def _old(w):
    """Another drafter of the same shape (the one a restart failed to replace)."""
    w["fc.weight"] = torch.randn(w["fc.weight"].shape,
                                 generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """Contract servers: the promoted drafter, the old one, the promoted one with a wrong
    ``d2t``, and one without speculation; and the τ the gate measured in-process."""
    torch.set_num_threads(1)
    work = tmp_path_factory.mktemp("post_promotion")
    model_dir, new = work / "target", work / "new"
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 5, 8, 2, 13, 6)]
    made = {}

    def prepare() -> None:
        target = fixtures.tiny_llama().eval()
        baseline = evaluate(target, None, prompts, max_new_tokens=MAX_NEW).outputs
        drafter = save_copy_drafter(target, new, baseline)
        made["gated"] = evaluate(target, _load(drafter, target), prompts, CHAIN,
                                 max_new_tokens=MAX_NEW).stats.tau
        _edited(new, work / "old", _old)
        _edited(new, work / "bad_d2t", _wrong_d2t)
        fixtures.save_model(target, model_dir)

    endpoints = {"new": spec_flags(CHAIN, new), "old": spec_flags(CHAIN, work / "old"),
                 "bad_d2t": spec_flags(CHAIN, work / "bad_d2t"), "plain": {"mode": "final"}}
    with fixtures.contract_process(work, model_dir, endpoints, prepare) as servers:
        yield {name: s.url for name, s in servers.items()}, prompts, made["gated"]


def _load(directory, target):
    from pipeline.eagle3.export import load_drafter

    return load_drafter(directory, target.get_input_embeddings())


def _probe(live, server: str, version: str = "2"):
    urls, prompts, gated = live
    counts, failure = probe([urls[server]], prompts, MAX_NEW, GREEDY, 0, timeout_s=60)
    return judge(version, "live", gated, counts, POLICY, failure=failure)


def test_the_promoted_drafter_serving_as_measured_is_healthy(live):
    v = _probe(live, "new")
    assert v.verdict == HEALTHY, v.reason
    assert v.tau == pytest.approx(live[2])  # greedy: the servers decode as the gate did
    assert v.gated_tau > 1.3 and v.floor == pytest.approx(0.8 * v.gated_tau)


@pytest.mark.parametrize("server, words", [
    ("old", "below the floor"),
    ("bad_d2t", "below the floor"),
    ("plain", "do not speculate as served"),
])
def test_planted_failures_are_broken(live, server, words):
    v = _probe(live, server)
    assert v.verdict == BROKEN and words in v.reason, v.reason
    if v.tau is not None:
        assert v.tau_high < v.floor


def test_the_absolute_floor_never_exceeds_the_gated_tau():
    """A drafter the gate promoted at τ 1.08 (a weak world) serving as gated is healthy."""
    assert POLICY.floor(1.08) == pytest.approx(1.08) and POLICY.floor(3.0) == pytest.approx(2.4)
    as_gated = [(11, 10), (10, 10), (12, 10), (11, 10), (10, 10), (11, 10)]  # τ 1.083
    assert judge("1", "reported", 1.08, as_gated, POLICY).verdict == HEALTHY
    assert judge("1", "reported", 1.08, [(10, 10)] * 6, POLICY).verdict == BROKEN  # τ 1.0


def test_too_few_verify_passes_decide_nothing():
    v = judge("2", "reported", 2.0, [(5, 3), (4, 2)], POLICY)
    assert v.verdict == UNDECIDED and "5 verify passes over 2 samples" in v.reason
    assert judge("2", "reported", 2.0, [(30, 10)] * 4, POLICY).verdict == UNDECIDED  # 4 < 5
    # the noise is allowed for: a point estimate below the floor whose interval reaches it
    noisy = [(30, 10), (10, 10), (10, 10), (10, 10), (10, 10), (30, 10)]
    v = judge("2", "reported", 2.0, noisy, POLICY)  # τ 100/60 = 1.667 ... floor 1.6
    low = [(30, 10)] + [(10, 10)] * 5  # τ 1.333 < 1.6, interval up to ~2.0
    w = judge("2", "reported", 2.0, low, POLICY)
    assert v.tau > v.floor and v.verdict == HEALTHY
    assert w.tau < w.floor < w.tau_high and w.verdict == HEALTHY


@pytest.fixture
def promoted_v2(sqlite_registry, storage, serving, drafter_dirs):
    v1 = register(sqlite_registry, storage, drafter_dirs[0], 10)
    force_promote(sqlite_registry, serving, v1, actor="test", reason="seed a champion")
    v2 = register(sqlite_registry, storage, drafter_dirs[1], 20)
    from pipeline.release.promotion import promote
    from tests.release.helpers import summary

    assert promote(sqlite_registry, serving, v2, gate(2.5, summary(2.0, v1))).action == \
        "promoted"
    return v1, v2


def test_a_broken_promotion_is_rolled_back_and_recorded(live, sqlite_registry, serving,
                                                        promoted_v2):
    v1, v2 = promoted_v2
    checked = _settle(sqlite_registry, serving, _probe(live, "bad_d2t", v2))
    assert checked.rollback is not None and checked.rollback.action == "rolled_back"
    assert sqlite_registry.alias(CHAMPION) == v1 and served_version(serving) == v1
    tags = sqlite_registry.get_version(v2).tags
    assert tags[VERDICT_TAG] == BROKEN and json.loads(tags[EVIDENCE_TAG])["source"] == "live"
    rolled = json.loads(tags[ROLLED_BACK])
    assert rolled["by"] == VERIFY_ACTOR and "floor" in rolled["reason"]
    assert "post-promotion check" in serving.current().reason


def test_a_healthy_promotion_is_left_alone(live, sqlite_registry, serving, promoted_v2):
    _, v2 = promoted_v2
    checked = _settle(sqlite_registry, serving, _probe(live, "new", v2))
    assert checked.rollback is None
    assert sqlite_registry.alias(CHAMPION) == v2 and served_version(serving) == v2
    assert sqlite_registry.get_version(v2).tags[VERDICT_TAG] == HEALTHY


def test_a_verdict_on_a_drafter_no_longer_serving_rolls_nothing_back(
        live, sqlite_registry, storage, serving, promoted_v2, drafter_dirs):
    v1, v2 = promoted_v2
    v3 = register(sqlite_registry, storage, drafter_dirs[2], 30)
    force_promote(sqlite_registry, serving, v3, actor="test", reason="moved on")
    checked = _settle(sqlite_registry, serving, _probe(live, "old", v2))
    assert checked.rollback is None and "no longer the champion" in checked.note
    assert served_version(serving) == v3 and sqlite_registry.alias(CHAMPION) == v3
    assert sqlite_registry.get_version(v2).tags[VERDICT_TAG] == BROKEN


def test_a_failed_rollback_leaves_no_verdict_so_the_next_attempt_judges_again(
        live, sqlite_registry, serving, promoted_v2, monkeypatch):
    v1, v2 = promoted_v2

    def unreachable(*args, **kwargs):
        raise RuntimeError("the restart hook failed")

    monkeypatch.setattr("pipeline.monitor.stage.rollback", unreachable)
    with pytest.raises(RuntimeError):
        _settle(sqlite_registry, serving, _probe(live, "bad_d2t", v2))
    assert VERDICT_TAG not in sqlite_registry.get_version(v2).tags
    monkeypatch.undo()
    checked = _settle(sqlite_registry, serving, _probe(live, "bad_d2t", v2))
    assert checked.rollback is not None and served_version(serving) == v1
