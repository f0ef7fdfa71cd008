"""The engine on every family of :mod:`tests.families`: no drafter, chain and tree drafting
all emit exactly what the target's plain cache-free greedy loop emits, on prompts that run
past the sliding window; and what the engine cannot reproduce it refuses up front."""

from __future__ import annotations

import pytest
import torch

from pipeline.eagle3.spec import SpecParams
from pipeline.evaluation import target as target_module
from pipeline.evaluation.engine import evaluate
from pipeline.evaluation.reference import greedy_reference
from pipeline.evaluation.target import (
    TargetRunner,
    UnsupportedTarget,
    attention_windows,
    exact_length_limit,
)
from tests.evaluation.synthetic import OracleDrafter, RandomDrafter, context_seed
from tests.families import FAMILIES, VOCAB, WINDOW, tiny_target

pytestmark = pytest.mark.integration

MAX_NEW = 12
LENGTHS = (1, WINDOW + 1, 3 * WINDOW)  # the longest ends 4·WINDOW past the start


def mixed_rank(context, position):
    return [0, 0, 1, None][context_seed(position, context) % 4]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    model = tiny_target(request.param)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]
    return model, prompts, [greedy_reference(model, p, MAX_NEW) for p in prompts]


@pytest.mark.parametrize("drafting", ["none", "chain", "tree", "random-tree"])
def test_engine_equals_the_cache_free_reference(family, drafting):
    model, prompts, reference = family
    drafter, params = {
        "none": (None, None),
        "chain": (OracleDrafter(model, top_prob=0.6, greedy_rank=mixed_rank),
                  SpecParams(4, 1, 5)),
        "tree": (OracleDrafter(model, top_prob=0.6, greedy_rank=mixed_rank),
                 SpecParams(3, 2, 6)),
        "random-tree": (RandomDrafter(VOCAB, seed=2), SpecParams(3, 4, 8)),
    }[drafting]
    run = evaluate(model, drafter, prompts, params, max_new_tokens=MAX_NEW)
    assert run.outputs == reference
    if drafting in ("chain", "tree"):
        assert run.stats.tau > 1.2  # drafts were accepted, so pruning was exercised


def test_a_window_the_engine_ignored_would_be_caught(monkeypatch):
    """The reference sees what the engine's own baseline cannot: decode a windowed target
    with its windows dropped from the masks, and outputs leave the reference past the
    window while drafting still agrees with the (wrong) baseline."""
    model = tiny_target("mistral_window")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (4 * WINDOW,), generator=g).tolist() for _ in range(3)]
    reference = [greedy_reference(model, p, MAX_NEW) for p in prompts]
    monkeypatch.setattr(target_module, "attention_windows", lambda _config: {None: None})
    wrong = evaluate(model, None, prompts, max_new_tokens=MAX_NEW).outputs
    drafted = evaluate(model, OracleDrafter(model), prompts, SpecParams(3, 2, 6),
                       max_new_tokens=MAX_NEW).outputs
    assert drafted == wrong != reference


def test_prefill_masks_are_transformers_sliding_window_masks():
    """The runner's windowed mask equals transformers' own sliding-window causal mask,
    position by position (the boundary: a key ``W - 1`` back is seen, ``W`` back is not)."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    runner = TargetRunner(tiny_target("mistral_window"))
    p = 3 * WINDOW
    positions = torch.arange(p)
    mask = runner._masks(positions, positions, torch.ones(p, p, dtype=torch.bool).tril())
    seen = mask[0, 0] == 0  # additive: 0 where attended
    rule = sliding_window_causal_mask_function(WINDOW)
    want = torch.tensor([[bool(rule(torch.tensor(0), torch.tensor(0), torch.tensor(q),
                                    torch.tensor(k))) for k in range(p)] for q in range(p)])
    assert torch.equal(seen, want)
    assert seen[WINDOW, 1] and not seen[WINDOW, 0]


def test_a_window_shorter_than_the_draft_hides_a_nodes_own_ancestors():
    """With a 3-token window and 5-deep chains, a tree node must not see its own ancestors
    3 positions up: outputs still equal the cache-free reference."""
    config = tiny_target("mistral_window").config
    config.sliding_window = 3
    torch.manual_seed(0)
    model = type(tiny_target("mistral_window"))(config).eval()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (2, 9, 14)]
    reference = [greedy_reference(model, p, MAX_NEW) for p in prompts]
    run = evaluate(model, OracleDrafter(model), prompts, SpecParams(5, 1, 6),
                   max_new_tokens=MAX_NEW)
    assert run.outputs == reference and run.stats.tau > 3  # long accepted chains


def test_attention_windows_per_layer_kind():
    assert attention_windows(tiny_target("llama3").config) == {None: None}
    assert attention_windows(tiny_target("mistral_window").config) == {None: WINDOW}
    assert attention_windows(tiny_target("gemma3").config) == {
        "full_attention": None, "sliding_attention": WINDOW}


def test_layer_kinds_the_engine_cannot_run_are_refused():
    config = tiny_target("qwen2_tied").config
    config.layer_types = ["full_attention", "linear_attention"] * 2
    with pytest.raises(UnsupportedTarget, match=r"layer types \['linear_attention'\]"):
        attention_windows(config)
    config.layer_types = ["sliding_attention"] * 4
    config.sliding_window = None
    with pytest.raises(UnsupportedTarget, match="no sliding_window"):
        attention_windows(config)


def test_length_limits_follow_transformers_switch_points():
    phi3 = tiny_target("phi3_longrope").config
    assert exact_length_limit(phi3) == 256  # original_max_position_embeddings
    llama = tiny_target("llama3").config
    llama.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    assert exact_length_limit(llama) == llama.max_position_embeddings
    assert exact_length_limit(tiny_target("gpt_oss").config) is None  # yarn: static


def test_longrope_past_its_original_length_is_refused_before_decoding():
    model = tiny_target("phi3_longrope")  # original_max_position_embeddings 256
    fits = [list(range(3, 3 + 200))]
    assert evaluate(model, None, fits, max_new_tokens=56).outputs == [
        greedy_reference(model, fits[0], 56)]
    with pytest.raises(UnsupportedTarget, match=r"257-token sequence passes .* \(256\)"):
        evaluate(model, None, fits, max_new_tokens=57)
    with pytest.raises(UnsupportedTarget, match="260-token"):  # + 4 draft steps
        evaluate(model, RandomDrafter(VOCAB), fits, SpecParams(4, 1, 5), max_new_tokens=56)
