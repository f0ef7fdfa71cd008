"""Each engine's per-request speculative report as the record's ``speculative`` field, the
field names as the engines write them (SGLang meta_info, slime spec_info, vLLM
metrics.speculative_decoding), and the same τ from either count of emitted tokens."""

from __future__ import annotations

from pipeline.adapters.spec_counters import from_sglang, from_slime, from_vllm
from pipeline.monitor.observed import rollout_counts
from pipeline.snapshot.schema import _speculative


def test_sglang_meta_info():
    meta = {"completion_tokens": 25, "spec_verify_ct": 10, "spec_accept_length": 2.5,
            "spec_num_correct_drafts": 14, "spec_num_proposed_drafts": 30}
    spec = from_sglang(meta, "3")
    assert _speculative(spec) == {"drafter_version": "3", "verify_ct": 10,
                                  "completion_tokens": 25, "accepted_tokens": 14,
                                  "draft_tokens": 30}
    old = from_sglang({"completion_tokens": 5, "spec_verify_ct": 2,
                       "spec_accepted_drafts": 2, "spec_proposed_drafts": 6}, "3")
    assert (old["accepted_tokens"], old["draft_tokens"]) == (2, 6)  # 0.5.14's names
    # stopped at the prefill token: SGLang omits spec_verify_ct
    assert from_sglang({"completion_tokens": 1}, "3")["verify_ct"] == 0
    assert from_sglang({"completion_tokens": 40}, "3") is None  # no speculation at all


def test_slime_spec_info():
    info = {"spec_accept_token_num": 9, "spec_draft_token_num": 18, "spec_verify_ct": 6,
            "completion_token_num": 16}
    # summed over the sample's requests: τ from the accepted tokens, not the completion's
    assert _speculative(from_slime(info, "2")) == {
        "drafter_version": "2", "verify_ct": 6, "completion_tokens": None,
        "accepted_tokens": 9, "draft_tokens": 18}
    older = {"spec_verify_ct": 6, "completion_token_num": 16}
    assert from_slime(older, "2")["completion_tokens"] == 16
    zeroed = dict.fromkeys(info, 0)  # slime's SpecInfo when the engine did not speculate
    assert from_slime(zeroed, "2") is None
    assert from_slime({}, "2") is None and from_slime(None, "2") is None


def test_vllm_per_request_metrics_count_tau_from_accepted_tokens():
    metrics = {"num_spec_steps": 8, "num_accepted_draft_tokens": 12, "num_draft_tokens": 24,
               "mean_acceptance_length": 2.5, "draft_acceptance_rate": 0.5}
    spec = _speculative(from_vllm(metrics, "4"))
    assert spec["completion_tokens"] is None
    emitted, cycles = rollout_counts(spec)
    assert emitted / cycles == metrics["mean_acceptance_length"]  # vLLM's own ratio
    assert from_vllm(None, "4") is None


def test_both_counts_of_emitted_tokens_agree_on_an_untruncated_request():
    # 1 prefill token + 10 verify passes accepting 14 drafts: 25 completion tokens
    spec = from_sglang({"completion_tokens": 25, "spec_verify_ct": 10,
                        "spec_num_correct_drafts": 14}, "3")
    assert rollout_counts(spec) == rollout_counts({**spec, "completion_tokens": None})
