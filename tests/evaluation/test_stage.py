"""The acceptance_eval stage on a tiny world: held-out prompts, three contestants, lineage."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch

from pipeline.capture.heldout import heldout_prompts
from pipeline.checks import evaluation_sound
from pipeline.evaluation import inprocess, stage
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.stage import NO_DRAFTER, read_report, tau_history
from pipeline.storage import Storage
from tests.evaluation.world import SETTINGS, STEPS, eval_world, publish_drafter

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> tuple[Storage, torch.nn.Module]:
    return eval_world(tmp_path_factory.mktemp("eval-world") / "storage")

def test_three_contestants_on_the_same_heldout_prompts(world, tmp_path, monkeypatch):
    storage, target = world
    candidate = publish_drafter(storage, target, 2, seed=1, tmp=tmp_path)
    champion = publish_drafter(storage, target, 1, seed=2, tmp=tmp_path)
    config = EvalConfig(max_prompts=6, max_new_tokens=12, **SETTINGS)
    report = stage.run(storage, 2, candidate, champion, config)

    split, prompts = heldout_prompts(storage, list(STEPS), 6)
    assert report.prompt_keys == [p.key for p in prompts] and len(prompts) >= 2
    assert report.heldout["fraction"] == 0.3 and report.heldout["prompts"] == len(prompts)
    assert set(report.contestants) == {"candidate", "champion", NO_DRAFTER}
    assert report.settings == {**SETTINGS, "max_new_tokens": 12}
    for c in report.contestants.values():
        s = c.acceptance
        assert s.prompts == len(prompts)
        # Lossless: every drafter emits exactly the greedy tokens, and on the sampled
        # (longest) prompts exactly the cache-free reference's.
        assert c.outputs_match_baseline == len(prompts)
        assert c.outputs_match_reference == report.reference["prompts"]
    lengths = [len(p.prompt_ids) for p in prompts]
    assert report.reference["prompts"] == min(4, len(prompts))
    sampled = report.reference["indices"]
    assert min(lengths[i] for i in sampled) >= max(
        (n for i, n in enumerate(lengths) if i not in sampled), default=0)
    assert report.contestants[NO_DRAFTER].tau == 1.0
    assert report.contestants["candidate"].acceptance.num_steps == 3
    assert report.contestants["candidate"].fingerprint == "fp-1"
    # Committed and idempotent: the same inputs return the report without decoding again.
    assert read_report(storage, 2) == report
    history = tau_history(storage)
    assert history["candidate"] == {2: report.contestants["candidate"].tau}
    assert history[NO_DRAFTER] == {2: 1.0}

    def boom(*_a, **_k):
        raise AssertionError("a committed report must not be recomputed")

    monkeypatch.setattr(inprocess, "evaluate", boom)
    assert stage.run(storage, 2, candidate, champion, config) == report
    # Other settings are other inputs.
    with pytest.raises(AssertionError, match="recomputed"):
        stage.run(storage, 2, candidate, champion,
                         EvalConfig(max_prompts=6, max_new_tokens=13, **SETTINGS))


def test_a_champion_of_another_algorithm_is_measured_alike(world, tmp_path):
    """Switching algorithms is an ordinary contest: an EAGLE 3.1 candidate against an
    EAGLE-3 champion, both decoded (losslessly) on the same prompts at the same settings."""
    storage, target = world
    candidate = publish_drafter(storage, target, 2, seed=5, tmp=tmp_path, algorithm="eagle3.1")
    champion = publish_drafter(storage, target, 1, seed=6, tmp=tmp_path)
    report = stage.run(storage, 2, candidate, champion,
                       EvalConfig(max_prompts=4, max_new_tokens=12, **SETTINGS))
    outcome = evaluation_sound(report)
    assert outcome.passed, outcome.description
    assert report.contestants["candidate"].acceptance.cycles > 0
    assert report.contestants["champion"].acceptance.cycles > 0
    written = json.loads(storage.read_bytes(f"{candidate}/config.json"))
    assert (written["fc_norm"], written["norm_output"]) == (True, True)


def test_a_dflash_candidate_is_measured_with_its_blocks_chain_against_an_eagle3_champion(
        world, tmp_path):
    """Another family is an ordinary contest too: the same prompts and sampler, each drafter
    drafting as its engine serves it (DFlash: a chain as long as its block, recorded on its
    contestant), both losslessly."""
    storage, target = world
    candidate = publish_drafter(storage, target, 2, seed=7, tmp=tmp_path, algorithm="dflash")
    champion = publish_drafter(storage, target, 1, seed=6, tmp=tmp_path)
    report = stage.run(storage, 2, candidate, champion,
                       EvalConfig(max_prompts=4, max_new_tokens=12, **SETTINGS))
    outcome = evaluation_sound(report)
    assert outcome.passed, outcome.description
    dflash, eagle = report.contestants["candidate"], report.contestants["champion"]
    assert dflash.settings == {"num_steps": 7, "eagle_topk": 1, "num_draft_tokens": 8}
    assert eagle.settings is None and report.settings["num_steps"] == 3
    assert dflash.acceptance.num_steps == 7 and eagle.acceptance.num_steps == 3
    assert dflash.acceptance.cycles > 0


def test_report_keys_track_prompts_and_settings(world, tmp_path):
    storage, target = world
    candidate = publish_drafter(storage, target, 2, seed=3, tmp=tmp_path)
    a = stage.run(storage, 2, candidate, None, EvalConfig(max_prompts=2,
                                                                 max_new_tokens=6, **SETTINGS))
    b = stage.run(storage, 2, candidate, None, EvalConfig(max_prompts=3,
                                                                 max_new_tokens=6, **SETTINGS))
    c = stage.run(storage, 2, candidate, None, EvalConfig(max_prompts=3,
                                                                 max_new_tokens=7, **SETTINGS))
    assert set(a.contestants) == {"candidate", NO_DRAFTER}
    assert a.heldout_key != b.heldout_key and b.heldout_key == c.heldout_key
    assert a.settings_key == b.settings_key != c.settings_key


def test_settings_are_all_or_none():
    with pytest.raises(ValueError, match="together"):
        EvalConfig(num_steps=3).spec_params(["LlamaForCausalLM"])
    auto = EvalConfig().spec_params(["LlamaForCausalLM"])
    assert (auto.num_steps, auto.eagle_topk, auto.num_draft_tokens) == (5, 4, 8)


def test_a_drafter_without_lineage_is_refused(world):
    storage, _ = world
    with pytest.raises(FileNotFoundError, match="no committed drafter"):
        stage.run(storage, 2, "drafters/step=000009", None)


def test_charts_are_png_and_published_to_storage(tmp_path):
    from pipeline.evaluation.charts import alpha_chart, alpha_figure, publish_chart, tau_curve
    from pipeline.storage import Storage

    alphas = {"candidate": [0.9, 0.7, float("nan")], "champion": [0.5, 0.2, 0.1]}
    (ax,) = alpha_figure(alphas).axes
    bars = [(round(b.get_x() + b.get_width() / 2, 3), round(b.get_height(), 3))
            for b in ax.patches]
    assert bars == [(-0.2, 0.9), (0.8, 0.7), (1.8, 0.0), (0.2, 0.5), (1.2, 0.2), (2.2, 0.1)]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["candidate", "champion"]
    png = alpha_chart(alphas)
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 2000
    curve = tau_curve({"stale": {0: 3.0, 4: 2.5}, "refreshed": {0: 3.0, 4: 3.1}},
                      refresh_steps=[4])
    assert curve.startswith(b"\x89PNG") and curve != png
    storage = Storage((tmp_path / "s").as_uri())
    url = publish_chart(storage, 7, "alpha", png)
    assert url == storage.url("evals/step=000007/charts/alpha.png")
    assert storage.read_bytes(storage.key_of(url)) == png


def test_decoding_stops_at_turn_closers_listed_only_in_generation_config(target, prompts,
                                                                         references):
    """A chat model lists its turn closer (``<|eot_id|>``, ``<|im_end|>``) in
    generation_config.json: evaluation stops there too, as the serving engines do."""
    from transformers import GenerationConfig

    from pipeline.evaluation.engine import evaluate

    model = copy.deepcopy(target)
    closer = references[0][2]  # the third token greedy decoding emits for prompt 0
    model.config.eos_token_id = 299
    model.generation_config = GenerationConfig(eos_token_id=[299, closer])
    assert inprocess.stop_token_ids(model) == {299, closer}
    run = evaluate(model, None, [prompts[0]], max_new_tokens=10,
                   eos_token_id=inprocess.stop_token_ids(model))
    first = references[0].index(closer)
    assert run.outputs[0] == references[0][:first + 1]  # the closer is emitted, then stop
    model.generation_config = GenerationConfig(eos_token_id=[299, True])
    with pytest.raises(ValueError, match="not a token id"):
        inprocess.stop_token_ids(model)


def test_the_stage_decodes_every_contestant_and_the_reference_to_the_stop_tokens(
        world, tmp_path, monkeypatch):
    """The stage passes the target's stop tokens (config and generation_config) to every
    decoding it runs: baseline, drafters and the cache-free reference."""
    storage, target = world
    candidate = publish_drafter(storage, target, 2, seed=5, tmp=tmp_path)
    seen: list[tuple[frozenset[int], frozenset[int]]] = []
    real_evaluate, real_reference = inprocess.evaluate, inprocess.greedy_reference

    def evaluate(model, *args, eos_token_id, **kwargs):
        seen.append((frozenset(eos_token_id), inprocess.stop_token_ids(model)))
        return real_evaluate(model, *args, eos_token_id=eos_token_id, **kwargs)

    def greedy_reference(model, prompt, max_new_tokens, eos):
        seen.append((frozenset(eos), inprocess.stop_token_ids(model)))
        return real_reference(model, prompt, max_new_tokens, eos)

    monkeypatch.setattr(inprocess, "evaluate", evaluate)
    monkeypatch.setattr(inprocess, "greedy_reference", greedy_reference)
    stage.run(storage, 2, candidate, None, EvalConfig(max_prompts=3, max_new_tokens=5,
                                                      reference_prompts=2, **SETTINGS))
    assert len(seen) == 2 + 2  # baseline + candidate, two reference prompts
    assert all(given == wanted and given for given, wanted in seen)


def test_a_sampled_evaluation_reports_its_regime_intervals_and_greedy_check(world, tmp_path):
    storage, target = world
    candidate = publish_drafter(storage, target, 2, seed=3, tmp=tmp_path)
    champion = publish_drafter(storage, target, 1, seed=4, tmp=tmp_path)
    config = EvalConfig(max_prompts=6, max_new_tokens=12, temperature=1.0, top_k=20, seed=5,
                        reference_prompts=2, **SETTINGS)
    report = stage.run(storage, 2, candidate, champion, config)

    assert report.regime == "T=1 top_k=20" and report.seed == 5
    assert "overridden by the run config" in report.sampler_source
    assert report.sampler_key and report.sampler_key != stage.run(
        storage, 2, candidate, champion, replace(config, temperature=0.5)).sampler_key
    # the token-for-token check runs greedily on the reference sample only
    assert report.lossless_prompts == report.reference["prompts"] == 2
    for c in report.contestants.values():
        s = c.acceptance
        assert c.outputs_match_baseline == 2 and c.outputs_match_reference == 2
        assert [sum(col) for col in zip(*c.per_prompt, strict=True)] == \
            [s.emitted_tokens, s.cycles]
        lo, hi = c.tau_interval
        assert lo <= s.tau <= hi
    assert report.contestants[NO_DRAFTER].tau_interval == [1.0, 1.0]
    assert report.summary()["regime"] == "T=1 top_k=20"


def test_bf16_evaluation_counts_near_ties_and_stays_sound(world, tmp_path, monkeypatch):
    from pipeline.checks import evaluation_sound

    storage, target = world
    candidate = publish_drafter(storage, target, 2, seed=6, tmp=tmp_path)
    loaded = []  # the dtypes target and drafter really ran in
    load_target, algorithm_of = inprocess._load_target, inprocess.algorithm_of_directory
    monkeypatch.setattr(inprocess, "_load_target", lambda *a: loaded.append(
        next((m := load_target(*a)).parameters()).dtype) or m)

    def spied(directory):  # the drafter's algorithm, its load recording the dtype
        found = algorithm_of(directory)
        return replace(found, load=lambda *a, **k: loaded.append(
            next((m := found.load(*a, **k)).fc.parameters()).dtype) or m)

    monkeypatch.setattr(inprocess, "algorithm_of_directory", spied)
    config = EvalConfig(max_prompts=6, max_new_tokens=12, dtype="bfloat16", **SETTINGS)
    report = stage.run(storage, 2, candidate, None, config)
    assert loaded == [torch.bfloat16, torch.bfloat16]
    assert report.dtype == "bfloat16" and report.device == "cpu"
    for c in report.contestants.values():
        exact = c.outputs_match_baseline + c.outputs_match_reference
        assert exact + c.ties == report.checked_prompts + report.reference["prompts"]
    assert evaluation_sound(report).passed


def test_a_near_tie_is_told_from_a_real_difference(world):
    from pipeline.evaluation.reference import is_near_tie

    _, target = world
    prompt = [3, 5, 7]
    with torch.inference_mode():
        logits = target(input_ids=torch.tensor([prompt])).logits[0, -1]
    first, second = torch.topk(logits, 2).indices.tolist()
    last = int(logits.argmin())
    scale = max(1.0, float(logits.abs().max()))
    gap = float(logits[first] - logits[second]) / scale
    assert is_near_tie(target, prompt, [first], [second], gap * 1.01)
    assert not is_near_tie(target, prompt, [first], [second], gap * 0.99)
    assert not is_near_tie(target, prompt, [first], [last], gap * 1.01)
    assert not is_near_tie(target, prompt, [first], [second], 0.0)  # fp32: held exact
    assert not is_near_tie(target, prompt, [first, 4], [first], 1.0)  # stopped earlier


def test_a_cuda_evaluation_without_cuda_says_so():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="no CUDA device; use device 'cpu' or 'auto'"):
        inprocess.resolve_device("cuda")
    assert inprocess.resolve_device("auto") == torch.device("cpu")
