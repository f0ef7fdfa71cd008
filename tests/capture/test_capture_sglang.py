"""The ``sglang`` capture backend against the contract server (tests/sglang_contract):
equivalence with a direct HF computation, retries of every injected fault, clear errors for
persistent faults and misconfigured servers, scale-out over several URLs, timeouts."""

from __future__ import annotations

import json
import time

import pytest
import requests
import torch
from hypothesis import given
from hypothesis import strategies as st

from pipeline.capture.engine_http import JsonHttp, RetryPolicy, TransientFailure
from pipeline.capture.sglang import (
    EngineConfigError,
    EngineRequestError,
    SGLangCaptureConfig,
    parse_generate_response,
    plan_requests,
)
from tests.conftest import free_port
from tests.sglang_contract import fixtures
from tests.sglang_contract.fixtures import AUX_IDS, HIDDEN, LAYERS

pytestmark = pytest.mark.integration

# The contract-server fixtures, made visible to pytest in this module.
contract_deployment = fixtures.contract_deployment
tiny_llama_dir = fixtures.tiny_llama_dir
sglang_servers = fixtures.sglang_servers

BATCH = [[5], [1, 2, 3, 4, 5], list(range(3, 20)), [7, 7, 7, 9, 2, 100, 3, 4, 8],
         [127, 0, 64], list(range(40, 52))]


@pytest.fixture(scope="session")
def hf_model(tiny_llama_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def hf_reference(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Aux ``cat(hidden_states[l + 1])`` ``[T, 3H]`` and final ``hidden_states[-1]`` ``[T, H]``."""
    with torch.no_grad():
        hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1][0] for i in AUX_IDS], -1), hs[-1][0]


def backend(servers, aux=("aux",), final=("final",), **overrides):
    settings = dict(aux_urls=[servers[n].url for n in aux],
                    final_urls=[servers[n].url for n in final], hidden_size=HIDDEN,
                    aux_layer_ids=AUX_IDS, num_target_layers=LAYERS, max_concurrency=4,
                    request_batch_size=2, timeout_s=10.0, max_retries=2, backoff_s=0.01,
                    backoff_max_s=0.05)
    settings.update(overrides)
    return SGLangCaptureConfig(**settings).build()


def assert_matches_hf(hf_model, batch, captured, dtype=torch.float32) -> None:
    assert len(captured) == len(batch)
    for ids, states in zip(batch, captured, strict=True):
        aux, final = hf_reference(hf_model, ids)
        assert states.aux_hidden.shape == (len(ids), 3 * HIDDEN)
        assert states.final_hidden.shape == (len(ids), HIDDEN)
        assert states.aux_hidden.dtype == states.final_hidden.dtype == dtype
        torch.testing.assert_close(states.aux_hidden, aux.to(dtype), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(states.final_hidden, final.to(dtype), rtol=1e-5, atol=1e-5)


# ---- facts the contract server relies on -------------------------------------------------


def test_hf_last_hidden_state_is_post_norm_and_earlier_ones_are_layer_outputs(hf_model):
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    outputs = []
    hooks = [layer.register_forward_hook(lambda m, i, o: outputs.append(o[0] if isinstance(
        o, tuple) else o)) for layer in hf_model.model.layers]
    try:
        with torch.no_grad():
            out = hf_model(ids, output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    hs = out.hidden_states
    assert len(hs) == LAYERS + 1
    for layer in range(LAYERS - 1):
        assert torch.equal(hs[layer + 1], outputs[layer])
    torch.testing.assert_close(hs[-1], hf_model.model.norm(outputs[-1]))
    assert not torch.allclose(hs[-1], outputs[-1])


def test_contract_server_speaks_the_documented_shapes(sglang_servers):
    url = sglang_servers["final"].url
    params = {"max_new_tokens": 3, "temperature": 0}
    single = requests.post(f"{url}/generate", timeout=30, json={
        "input_ids": [1, 2, 3, 4], "sampling_params": params, "return_hidden_states": True}).json()
    assert isinstance(single, dict)
    hs = single["meta_info"]["hidden_states"]
    assert len(hs) == 3  # prefill block + one row per decode step
    assert len(hs[0]) == 4 and all(len(row) == HIDDEN for row in hs[0])
    assert all(len(row) == HIDDEN and isinstance(row[0], float) for row in hs[1:])
    assert len(single["output_ids"]) == 3 and single["meta_info"]["cached_tokens"] == 0
    batched = requests.post(f"{url}/generate", timeout=30, json={
        "input_ids": [[1, 2], [3, 4, 5]], "sampling_params": {"max_new_tokens": 1},
        "return_hidden_states": True}).json()
    assert [len(o["meta_info"]["hidden_states"][0]) for o in batched] == [2, 3]
    assert all(len(o["meta_info"]["hidden_states"]) == 1 for o in batched)
    info = requests.get(f"{url}/server_info", timeout=30).json()
    assert info["disable_radix_cache"] is True and info["chunked_prefill_size"] == -1
    assert requests.post(f"{url}/flush_cache", timeout=30).status_code == 200
    assert requests.get(f"{url}/health", timeout=30).status_code == 200


# ---- equivalence and scale-out -----------------------------------------------------------


def test_capture_matches_hf(sglang_servers, hf_model):
    with backend(sglang_servers, final=("final", "final_b")) as b:
        captured = b.capture(BATCH)
    assert_matches_hf(hf_model, BATCH, captured)


def test_capture_matches_the_hf_backend(sglang_servers, hf_model):
    from pipeline.capture.hf import HFCaptureBackend

    want = HFCaptureBackend(hf_model, aux_layer_ids=AUX_IDS).capture(BATCH)
    with backend(sglang_servers) as b:
        got = b.capture(BATCH)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.aux_hidden, w.aux_hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g.final_hidden, w.final_hidden, rtol=1e-5, atol=1e-5)


def test_bfloat16_output_is_the_rounded_reference(sglang_servers, hf_model):
    with backend(sglang_servers, dtype="bfloat16") as b:
        captured = b.capture(BATCH[:3])
    assert_matches_hf(hf_model, BATCH[:3], captured, dtype=torch.bfloat16)


def test_provenance_names_the_servers_version_and_layer_ids(sglang_servers):
    with backend(sglang_servers) as b:
        record = b.provenance()
    assert (record["engine"], record["engine_version"]) == ("sglang", "0.5.23")
    assert record["aux_layer_ids"] == record["engine_aux_layer_ids"] == list(AUX_IDS)
    with backend(sglang_servers, preflight=False) as b:  # nothing asked: nothing claimed
        assert b.provenance()["engine_version"] == "unknown"


def test_requests_go_round_robin_over_all_urls(sglang_servers):
    with backend(sglang_servers, final=("final", "final_b"), request_batch_size=1) as b:
        b.capture(BATCH[:4])
    assert sglang_servers["final"].stats()["generate_requests"] == 2
    assert sglang_servers["final_b"].stats()["generate_requests"] == 2
    assert sglang_servers["aux"].stats()["samples"] == 4


def test_a_dead_url_fails_over_to_the_next(sglang_servers, hf_model):
    dead = f"http://127.0.0.1:{free_port()}"
    cfg = dict(aux_urls=[sglang_servers["aux"].url], final_urls=[dead, sglang_servers["final"].url],
               request_batch_size=1)
    with backend(sglang_servers, **cfg) as b:
        captured = b.capture(BATCH[:2])
        assert b.stats.failures["connection"] == 1 and b.stats.retries == 1
    assert_matches_hf(hf_model, BATCH[:2], captured)


def test_request_token_budget_splits_requests(sglang_servers):
    with backend(sglang_servers, request_batch_size=8, request_token_budget=10) as b:
        b.capture([[1] * 6, [2] * 3, [3] * 4, [4] * 20])
    assert sglang_servers["final"].stats()["generate_requests"] == 3  # [0,1] [2] [3]


def test_request_float_budget_bounds_json_bodies(sglang_servers):
    aux_width = HIDDEN * len(AUX_IDS)
    with backend(sglang_servers, request_batch_size=8, request_float_budget=10 * aux_width
                 + aux_width - 1) as b:  # 10 tokens of aux rows
        assert b.request_tokens == 10
        b.capture([[1] * 6, [2] * 3, [3] * 4, [4] * 20])
    assert sglang_servers["final"].stats()["generate_requests"] == 3  # [0,1] [2] [3]
    with backend(sglang_servers) as b:
        assert b.request_tokens == min(16384, (1 << 21) // aux_width)


# ---- faults ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["http500", "drop", "garbage", "short", "nan", "null",
                                  "slow"])
def test_each_fault_is_recovered_by_one_retry(sglang_servers, hf_model, kind):
    sglang_servers["final"].set_faults(kind, count=1, delay_s=30.0)
    start = time.monotonic()
    with backend(sglang_servers, timeout_s=0.5) as b:
        captured = b.capture(BATCH[1:3])
        assert b.stats.retries == 1
    assert time.monotonic() - start < 5.0
    stats = sglang_servers["final"].stats()
    assert (stats["generate_requests"], stats["faults_injected"]) == (2, 1)
    assert_matches_hf(hf_model, BATCH[1:3], captured)


def test_persistent_short_rows_name_url_sample_and_cause(sglang_servers):
    server = sglang_servers["final"]
    server.set_faults("short", count=-1)
    with backend(sglang_servers) as b, pytest.raises(EngineRequestError) as err:
        b.capture(BATCH[1:3])
    message = str(err.value)
    assert server.url in message and "sample 0" in message
    assert "4 rows for 5 input tokens" in message
    assert "--disable-radix-cache" in message and "--chunked-prefill-size -1" in message
    assert err.value.url == server.url and err.value.samples == (0, 1)
    assert server.stats()["generate_requests"] == 3  # 1 + max_retries


def test_the_error_names_the_sample_of_a_later_request(sglang_servers):
    sglang_servers["final"].set_faults("nan", count=-1, every=2)
    with backend(sglang_servers, max_concurrency=1, max_retries=0) as b:
        with pytest.raises(EngineRequestError, match=r"sample 2.*non-finite value in row 8"):
            b.capture(BATCH[:3])  # final requests: [0, 1] then [2] (faulted)


def test_persistent_http500_lists_every_url_tried(sglang_servers):
    for name in ("final", "final_b"):
        sglang_servers[name].set_faults("http500", count=-1)
    with backend(sglang_servers, final=("final", "final_b"), max_retries=3) as b:
        with pytest.raises(EngineRequestError, match="failed after 4 attempt") as err:
            b.capture(BATCH[:1])
    assert len(err.value.attempts) == 4 and "HTTP 500" in str(err.value)
    assert sglang_servers["final"].url in str(err.value)
    assert sglang_servers["final_b"].url in str(err.value)


def test_timeouts_are_honoured(sglang_servers):
    sglang_servers["final"].set_faults("slow", count=-1, delay_s=60.0)
    start = time.monotonic()
    with backend(sglang_servers, timeout_s=0.3, max_retries=1) as b:
        with pytest.raises(EngineRequestError, match="timeout"):
            b.capture(BATCH[:1])
    assert time.monotonic() - start < 3.0
    assert sglang_servers["final"].stats()["generate_requests"] == 2


# ---- misconfigured servers ---------------------------------------------------------------


def test_preflight_rejects_a_server_without_hidden_states(sglang_servers):
    with backend(sglang_servers, final=("no_hidden",)) as b:
        with pytest.raises(EngineConfigError, match="--enable-return-hidden-states"):
            b.capture(BATCH[:1])
    assert sglang_servers["no_hidden"].stats()["generate_requests"] == 0


def test_a_server_without_hidden_states_is_not_retried(sglang_servers):
    server = sglang_servers["no_hidden"]
    with backend(sglang_servers, final=("no_hidden",), preflight=False) as b:
        with pytest.raises(EngineConfigError) as err:
            b.capture(BATCH[:1])
    assert server.url in str(err.value)
    assert "was not started with --enable-return-hidden-states" in str(err.value)
    assert server.stats()["generate_requests"] == 1


def test_missing_hidden_states_in_an_answer_is_a_config_error(sglang_servers):
    sglang_servers["final"].set_faults("omit_hidden", count=-1)
    with backend(sglang_servers) as b:
        with pytest.raises(EngineConfigError, match="no meta_info.hidden_states"):
            b.capture(BATCH[:1])
    assert sglang_servers["final"].stats()["generate_requests"] == 1


def test_radix_cache_is_caught_by_preflight_and_by_cached_tokens(sglang_servers):
    with backend(sglang_servers, final=("radix",)) as b:
        with pytest.raises(EngineConfigError, match="--disable-radix-cache"):
            b.capture(BATCH[:2])
    with backend(sglang_servers, final=("radix",), preflight=False) as b:
        b.capture(BATCH[:2])  # nothing cached yet: fine
        with pytest.raises(EngineConfigError, match="cached prefix tokens.*radix"):
            b.capture(BATCH[:2])


def test_chunked_prefill_is_caught_by_preflight_and_by_row_counts(sglang_servers):
    with backend(sglang_servers, final=("chunked",)) as b:
        with pytest.raises(EngineConfigError, match="--chunked-prefill-size -1"):
            b.capture(BATCH[:1])
    with backend(sglang_servers, final=("chunked",), preflight=False) as b:
        b.capture([[1] * 8])  # one chunk: all rows
        with pytest.raises(EngineRequestError, match="4 rows for 12 input tokens.*chunked"):
            b.capture([list(range(12))])


def test_swapped_roles_are_explained(sglang_servers):
    with backend(sglang_servers, final=("aux",)) as b:
        with pytest.raises(EngineConfigError, match="aux capture is on"):
            b.capture(BATCH[:1])
    with backend(sglang_servers, final=("aux",), preflight=False) as b:
        with pytest.raises(EngineConfigError, match="width 192 .*aux-capture server"):
            b.capture(BATCH[:1])
    with backend(sglang_servers, aux=("final",), preflight=False) as b:
        with pytest.raises(EngineConfigError,
                           match="width 64 .*--enable-return-aux-hidden-states"):
            b.capture(BATCH[:1])


def test_preflight_catches_aux_layer_ids_the_width_cannot(sglang_servers):
    with backend(sglang_servers, aux_layer_ids=(1, 3, 5)) as b:
        with pytest.raises(EngineConfigError, match=r"aux layers \[1, 3, 4\]"):
            b.capture(BATCH[:1])


# ---- units (no server) -------------------------------------------------------------------


@given(st.lists(st.integers(1, 50), max_size=30), st.integers(1, 6), st.integers(1, 120))
def test_plan_requests_covers_every_sample_once_in_order(lengths, max_samples, budget):
    plan = plan_requests(lengths, max_samples, budget)
    assert [i for chunk in plan for i in chunk] == list(range(len(lengths)))
    for chunk in plan:
        assert 1 <= len(chunk) <= max_samples
        assert len(chunk) == 1 or sum(lengths[i] for i in chunk) <= budget


def test_backoff_is_deterministic_jittered_and_capped():
    policy = RetryPolicy(max_retries=5, backoff_s=1.0, backoff_max_s=4.0, seed=7)
    delays = [policy.delay(3, k) for k in range(5)]
    assert delays == [RetryPolicy(5, 1.0, 4.0, 7).delay(3, k) for k in range(5)]
    assert delays != [RetryPolicy(5, 1.0, 4.0, 8).delay(3, k) for k in range(5)]
    for k, d in enumerate(delays):
        assert 0.5 * min(4.0, 2**k) <= d < 1.5 * min(4.0, 2**k)


def _answer(rows, **meta):
    return [{"text": "", "meta_info": {"hidden_states": [rows], "cached_tokens": 0, **meta}}]


@pytest.mark.parametrize(("rows", "reason"), [
    ([[0.0, 1.0], [0.0]], "ragged rows"),
    ([[0.0, None], [1.0, 2.0]], "null value in row 0"),
    ([[0.0, 1.0], [float("inf"), 2.0]], "non-finite value in row 1"),
    ([[0.0, 1.0]], "1 rows for 2 input tokens"),
])
def test_flaky_looking_answers_are_transient(rows, reason):
    with pytest.raises(TransientFailure, match=reason):
        parse_generate_response(_answer(rows), url="u", samples=[0], lengths=[2], width=2,
                                role="final", hidden_size=2)


def test_a_single_object_answer_is_accepted_for_one_sample():
    [rows] = parse_generate_response(_answer([[1.0, 2.0]])[0], url="u", samples=[4],
                                     lengths=[1], width=2, role="final", hidden_size=2)
    assert rows.tolist() == [[1.0, 2.0]]


def test_http_errors_are_classified():
    decode = JsonHttp._decode
    with pytest.raises(TransientFailure, match="HTTP 503"):
        decode(503, b"busy", "u", False)
    with pytest.raises(TransientFailure, match="HTTP 429"):
        decode(429, b"{}", "u", False)
    with pytest.raises(EngineRequestError, match="HTTP 400: too long"):
        decode(400, json.dumps({"error": {"message": "too long"}}).encode(), "u", False)
    with pytest.raises(TransientFailure, match="malformed JSON"):
        decode(200, b"{oops", "u", False)
    assert decode(404, b"", "u", True) is None


def test_config_is_validated_and_empty_inputs_handled(sglang_servers):
    with pytest.raises(ValueError, match="aux_urls"):
        SGLangCaptureConfig(aux_urls=[], final_urls=["http://x"], hidden_size=4,
                            aux_layer_ids=(1, 2, 3))
    with pytest.raises(ValueError, match="dtype"):
        SGLangCaptureConfig(aux_urls=["http://x"], final_urls=["http://x"], hidden_size=4,
                            aux_layer_ids=(1, 2, 3), dtype="float16")
    cfg = SGLangCaptureConfig(aux_urls="http://a:1/, http://b:2", final_urls=["http://c:3"],
                              hidden_size=4, aux_layer_ids=[1, 2, 3], api_key="s3cret")
    assert cfg.aux_urls == ("http://a:1", "http://b:2") and cfg.aux_layer_ids == (1, 2, 3)
    assert "s3cret" not in repr(cfg)
    http = JsonHttp(timeout_s=1, connect_timeout_s=1, api_key="s3cret")
    assert http._session().headers["Authorization"] == "Bearer s3cret"
    http.close()
    with backend(sglang_servers) as b:
        assert b.capture([]) == []
        with pytest.raises(ValueError, match="at least one token"):
            b.capture([[1], []])
    assert sglang_servers["final"].stats()["generate_requests"] == 0
