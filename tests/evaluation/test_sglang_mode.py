"""SGLang mode of acceptance evaluation: ``measure_server_acceptance`` against the contract
server's speculative endpoints (Aerie's engine behind SGLang's HTTP contract), compared
count for count with the in-process engine; scale-out, refusals, retries, bad answers."""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests
import torch

from pipeline.capture.engine_http import EngineRequestError, TransientFailure
from pipeline.eagle3.export import load_drafter
from pipeline.eagle3.model import Eagle3Drafter
from pipeline.eagle3.spec import SpecParams
from pipeline.evaluation.engine import CycleTrace, EvalRun, evaluate
from pipeline.evaluation.sglang_mode import (
    ServerAcceptance,
    ServerAcceptanceError,
    SpeculativeConfigError,
    measure_server_acceptance,
    parse_spec_response,
)
from pipeline.sampling import SamplingParams
from tests.sglang_contract import fixtures
from tests.sglang_contract.drafters import (
    CHAIN,
    MAX_NEW,
    save_copy_drafter,
    spec_flags,
)
from tests.sglang_contract.fixtures import VOCAB, ContractServer

pytestmark = pytest.mark.integration

TREE = SpecParams(3, 2, 6)
FAST = {"timeout": 60.0, "retries": 1, "backoff_s": 0.01}


@dataclass(frozen=True)
class World:
    target: torch.nn.Module
    drafter: Eagle3Drafter
    drafter_dir: Path
    prompts: list[list[int]]
    eos: int
    servers: dict[str, ContractServer]
    runs: dict[SpecParams, tuple[EvalRun, list[CycleTrace]]] = field(default_factory=dict)

    def url(self, name: str) -> str:
        return self.servers[name].url


def pick_eos(outputs: list[list[int]]) -> int:
    """A token the greedy target emits exactly once, late in some output: one prompt stops
    on it mid-cycle, the others run to ``max_new_tokens``."""
    flat = [t for o in outputs for t in o]
    late = sorted(t for o in outputs for t in o[3:] if flat.count(t) == 1)
    assert late, "the tiny target emits no token exactly once"
    return late[0]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    torch.set_num_threads(1)
    work = tmp_path_factory.mktemp("sglang_mode")
    model_dir, drafter_dir = work / "target", work / "drafter"
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist()
               for n in (1, 2, 5, 9, 3, 14, 20, 7)]
    made: dict[str, object] = {}

    def prepare() -> None:
        target = fixtures.tiny_llama().eval()
        baseline = evaluate(target, None, prompts, max_new_tokens=MAX_NEW).outputs
        made["eos"] = eos = pick_eos(baseline)
        target.config.eos_token_id = target.generation_config.eos_token_id = eos
        save_copy_drafter(target, drafter_dir, baseline)
        fixtures.save_model(target, model_dir)

    endpoints = {
        "chain": spec_flags(CHAIN, drafter_dir),
        "chain_b": spec_flags(CHAIN, drafter_dir),
        "tree": spec_flags(TREE, drafter_dir),
        "tree_b": spec_flags(TREE, drafter_dir),
        "lagging": spec_flags(CHAIN, drafter_dir, interval=40),  # SGLang's default interval
        "plain": {"mode": "final"},
        "aux_capture": {"mode": "aux"},  # EAGLE3 algorithm, no draft model
    }
    with fixtures.contract_process(work, model_dir, endpoints, prepare) as servers:
        from transformers import LlamaForCausalLM

        target = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        drafter = load_drafter(drafter_dir, target.get_input_embeddings())
        yield World(target, drafter, drafter_dir, prompts, made["eos"], servers)


@pytest.fixture
def servers(world):
    for server in world.servers.values():
        server.reset()
    yield world.servers
    for server in world.servers.values():
        server.reset()


def in_process(world: World, params: SpecParams) -> tuple[EvalRun, list[CycleTrace]]:
    """The engine on the same target, drafter, prompts and settings (once per settings)."""
    if params not in world.runs:
        trace: list[CycleTrace] = []
        run = evaluate(world.target, world.drafter, world.prompts, params,
                       max_new_tokens=MAX_NEW, eos_token_id=world.eos, trace=trace)
        world.runs[params] = run, trace
    return world.runs[params]


# ---- equivalence with the in-process engine ----------------------------------------------


def test_sampled_counts_equal_the_in_process_engine_at_the_same_seeds(world, servers):
    """The client sends each prompt the engine's own seed as ``sampling_seed``: two servers
    sampling at T=0.8 top-k 20 give the in-process engine's counts, prompt by prompt."""
    sampler = SamplingParams(0.8, top_k=20)
    got = measure_server_acceptance([world.url("tree"), world.url("tree_b")], world.prompts,
                                    MAX_NEW, concurrency=3, return_outputs=True,
                                    sampler=sampler, seed=11, **FAST)
    run = evaluate(world.target, world.drafter, world.prompts, TREE, max_new_tokens=MAX_NEW,
                   eos_token_id=world.eos, sampler=sampler, seed=11)
    assert [list(o) for o in got.outputs] == run.outputs
    assert run.outputs != in_process(world, TREE)[0].outputs  # sampled, not greedy
    assert [tuple(p) for p in run.per_prompt] == list(got.per_prompt)
    assert got.tau == run.stats.tau and got.sampler == sampler.to_dict()
    again = measure_server_acceptance(world.url("tree"), world.prompts, MAX_NEW,
                                      sampler=sampler, seed=12, **FAST)
    assert again.per_prompt != got.per_prompt  # another seed, other draws


@pytest.mark.parametrize(("name", "params"), [("chain", CHAIN), ("tree", TREE)])
def test_server_counts_equal_the_in_process_engine(world, servers, name, params):
    got = measure_server_acceptance(world.url(name), world.prompts, MAX_NEW, concurrency=3,
                                    return_outputs=True, **FAST)
    run, _ = in_process(world, params)
    stats = run.stats
    # The drafter is neither useless nor perfect, some prompt stops on EOS mid-cycle.
    assert 1.3 < stats.tau < params.num_steps + 1
    assert 0 < got.stopped < got.requests
    assert [list(o) for o in got.outputs] == run.outputs
    assert (got.requests, got.completion_tokens, got.spec_verify_ct) == (
        stats.prompts, stats.generated_tokens, stats.cycles)
    assert got.accept_length == stats.server_accept_length
    assert got.tau == stats.tau
    # SGLang's avg_spec_accept_length counts accepted drafts + bonus, not the prefill token:
    # it is tau (exactly, with the counters folded after every verify pass).
    assert got.server_info_accept_length == stats.tau
    assert got.accept_length == pytest.approx(got.tau + got.requests / got.spec_verify_ct)
    assert got.spec_params == params
    assert got.draft_model_path == str(world.drafter_dir) and got.sglang_version == "0.5.23"


def test_two_servers_sum_to_the_counts_of_one(world, servers):
    one = measure_server_acceptance([world.url("chain")], world.prompts, MAX_NEW, **FAST)
    two = measure_server_acceptance(f"{world.url('chain')}, {world.url('chain_b')}/",
                                    world.prompts, MAX_NEW, concurrency=4, **FAST)
    assert two.urls == (world.url("chain"), world.url("chain_b"))
    assert (two.requests, two.completion_tokens, two.spec_verify_ct, two.stopped) == (
        one.requests, one.completion_tokens, one.spec_verify_ct, one.stopped)
    assert two.accept_length == one.accept_length
    assert [c.requests for c in two.per_server] == [4, 4]  # round-robin
    assert sum(c.completion_tokens for c in two.per_server) == two.completion_tokens
    assert sum(c.spec_verify_ct for c in two.per_server) == two.spec_verify_ct
    assert servers["chain_b"].stats()["generate_requests"] == 4
    assert two.server_info_accept_length == pytest.approx(one.server_info_accept_length)
    for c in two.per_server:  # each server's own average is its own share's tau
        assert c.server_info_accept_length == pytest.approx(
            (c.completion_tokens - c.requests) / c.spec_verify_ct)


def test_server_info_average_folds_every_interval_and_flush_resets_it(world, servers):
    """SGLang folds its counters into the reported average every decode_log_interval
    batches (40): the average covers the first multiple of 40 verify passes only; a second
    run, after the flush, reports the same value."""
    _, trace = in_process(world, CHAIN)
    folded = len(trace) // 40 * 40
    assert 40 <= folded < len(trace)
    want = sum(len(c.emitted) for c in trace[:folded]) / folded
    for _ in range(2):
        got = measure_server_acceptance(world.url("lagging"), world.prompts, MAX_NEW,
                                        concurrency=1, **FAST)
        assert got.server_info_accept_length == pytest.approx(want)
    assert got.server_info_accept_length != pytest.approx(got.tau)  # it lags
    few = measure_server_acceptance(world.url("lagging"), world.prompts[:2], MAX_NEW, **FAST)
    assert few.spec_verify_ct < 40 and few.server_info_accept_length is None


# ---- refusals, retries, bad answers ------------------------------------------------------


@pytest.mark.parametrize("name", ["plain", "aux_capture"])
def test_a_server_without_an_eagle3_drafter_is_refused(world, servers, name):
    with pytest.raises(SpeculativeConfigError) as err:
        measure_server_acceptance(world.url(name), world.prompts, MAX_NEW, **FAST)
    message = str(err.value)
    assert world.url(name) in message
    assert "--speculative-algorithm EAGLE3" in message
    assert "--speculative-draft-model-path" in message
    assert servers[name].stats()["generate_requests"] == 0


def test_servers_with_different_settings_are_not_summed(world, servers):
    with pytest.raises(SpeculativeConfigError, match="disagree") as err:
        measure_server_acceptance([world.url("chain"), world.url("tree")], world.prompts,
                                  MAX_NEW, **FAST)
    assert world.url("tree") in str(err.value)
    assert servers["chain"].stats()["generate_requests"] == 0


def test_a_busy_server_refuses_the_flush_and_the_run_stops(world, servers):
    server = servers["chain"]
    server.set_faults("slow", count=1, delay_s=30.0)  # holds one request in flight
    holder = threading.Thread(target=requests.post, args=(f"{server.url}/generate",), kwargs={
        "json": {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2,
                                                           "temperature": 0}},
        "timeout": 60})
    holder.start()
    try:
        deadline = time.monotonic() + 10
        while server.stats()["generate_requests"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(EngineRequestError, match="flush_cache refused") as err:
            measure_server_acceptance(server.url, world.prompts, MAX_NEW, **FAST)
        assert server.url in str(err.value) and "failed after 2 attempt" in str(err.value)
        assert server.stats()["generate_requests"] == 1  # nothing sent after the refusal
    finally:
        server.reset()  # releases the slow reply
        holder.join(timeout=30)


def test_a_transient_http_500_is_retried(world, servers):
    servers["chain"].set_faults("http500", count=1)
    got = measure_server_acceptance(world.url("chain"), world.prompts, MAX_NEW, concurrency=2,
                                    **FAST)
    stats = in_process(world, CHAIN)[0].stats
    assert (got.completion_tokens, got.spec_verify_ct) == (stats.generated_tokens,
                                                           stats.cycles)
    assert servers["chain"].stats() == {"generate_requests": len(world.prompts) + 1,
                                        "samples": len(world.prompts), "faults_injected": 1}


def test_a_missing_spec_verify_ct_names_the_url_and_the_prompt(world, servers):
    assert len(in_process(world, CHAIN)[0].outputs[1]) > 1
    server = servers["chain"]
    server.set_faults("omit_spec", count=-1, every=2)  # the 2nd request: prompt 1
    with pytest.raises(ServerAcceptanceError) as err:
        measure_server_acceptance(server.url, world.prompts, MAX_NEW, concurrency=1,
                                  timeout=60.0, retries=0)
    assert err.value.url == server.url and err.value.prompt == 1
    message = str(err.value)
    assert "prompt 1" in message and server.url in message
    assert "no meta_info.spec_verify_ct" in message


def test_a_persistent_short_answer_fails_after_the_retries(world, servers):
    server = servers["chain"]
    server.set_faults("short_output", count=-1)
    with pytest.raises(ServerAcceptanceError, match="failed after 2 attempt") as err:
        measure_server_acceptance(server.url, world.prompts[:1], MAX_NEW, **FAST)
    assert err.value.prompt == 0 and "output_ids for completion_tokens" in str(err.value)
    assert server.stats()["generate_requests"] == 2


# ---- the contract server's speculative endpoint ------------------------------------------


def test_speculative_endpoint_speaks_sglangs_shapes(world, servers):
    url = world.url("tree")
    greedy = {"max_new_tokens": 6, "temperature": 0}
    single = requests.post(f"{url}/generate", timeout=30, json={
        "input_ids": world.prompts[3], "sampling_params": greedy}).json()
    meta = single["meta_info"]
    assert meta["completion_tokens"] == len(single["output_ids"]) == 6
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["spec_accept_length"] == 6 / meta["spec_verify_ct"]
    assert meta["spec_num_correct_drafts"] == 6 - 1 - meta["spec_verify_ct"]
    assert meta["spec_num_proposed_drafts"] == meta["spec_verify_ct"] * (TREE.num_draft_tokens
                                                                         - 1)
    batched = requests.post(f"{url}/generate", timeout=30, json={
        "input_ids": world.prompts[:2], "sampling_params": {**greedy, "ignore_eos": True}})
    assert [o["output_ids"] for o in batched.json()] == [
        o[:6] for o in in_process(world, TREE)[0].outputs[:2]]
    sampled = requests.post(f"{url}/generate", timeout=30, json={  # SGLang's default: T=1
        "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4}})
    assert sampled.status_code == 200 and sampled.json()["meta_info"]["completion_tokens"] == 4
    bad = requests.post(f"{url}/generate", timeout=30, json={
        "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4, "top_p": 0}})
    assert bad.status_code == 400 and "sampling.top_p" in bad.json()["error"]["message"]
    info = requests.get(f"{url}/server_info", timeout=30).json()
    assert (info["speculative_algorithm"], info["speculative_num_steps"],
            info["speculative_eagle_topk"], info["speculative_num_draft_tokens"]) == (
        "EAGLE3", 3, 2, 6)
    assert info["internal_states"][0]["avg_spec_accept_length"] >= 1.0
    assert requests.post(f"{url}/flush_cache", timeout=30).status_code == 200
    info = requests.get(f"{url}/server_info", timeout=30).json()
    assert "avg_spec_accept_length" not in info["internal_states"][0]


# ---- units (no server) -------------------------------------------------------------------


def answer(completion: int, verify: int | None, outputs: int | None = None,
           reason: str = "length") -> dict:
    meta = {"completion_tokens": completion, "finish_reason": {"type": reason}}
    if verify is not None:
        meta["spec_verify_ct"] = verify
    return {"output_ids": list(range(completion if outputs is None else outputs)),
            "meta_info": meta}


def test_answers_are_validated():
    ok = parse_spec_response([answer(5, 2)], max_new_tokens=8, num_steps=3)
    assert (ok.completion_tokens, ok.spec_verify_ct, ok.stopped) == (5, 2, False)
    # Stopped at the prefill token: no verify pass, and SGLang may omit the key.
    first = parse_spec_response(answer(1, None, reason="stop"), max_new_tokens=8, num_steps=3)
    assert (first.spec_verify_ct, first.stopped) == (0, True)
    bad = [(answer(5, None), "no meta_info.spec_verify_ct"),
           (answer(5, 0), "spec_verify_ct 0"),
           (answer(9, 3), r"completion_tokens 9 is not in \[1, max_new_tokens=8\]"),
           (answer(0, 0), "completion_tokens 0"),
           (answer(5, 2, outputs=4), "4 output_ids for completion_tokens 5"),
           (answer(8, 1), "7 tokens from 1 verify passes"),
           (answer(5, True), "spec_verify_ct True"),
           ({"text": ""}, "no meta_info")]
    for body, reason in bad:
        with pytest.raises(TransientFailure, match=reason):
            parse_spec_response(body, max_new_tokens=8, num_steps=3)


def test_server_acceptance_round_trips_through_json(world, servers):
    got = measure_server_acceptance(world.url("chain"), world.prompts[:3], MAX_NEW,
                                    return_outputs=True, **FAST)
    raw = json.loads(json.dumps(got.to_dict()))
    assert raw["accept_length"] == got.accept_length and raw["schema_version"] == 2
    assert ServerAcceptance.from_dict(raw) == got
    old = {k: v for k, v in raw.items() if k not in ("sampler", "per_prompt")}
    assert ServerAcceptance.from_dict({**old, "schema_version": 1}).sampler == \
        SamplingParams().to_dict()  # a schema-1 record was greedy
    with pytest.raises(ValueError, match="disagrees"):
        ServerAcceptance.from_dict({**raw, "spec_verify_ct": raw["spec_verify_ct"] + 1})
    with pytest.raises(ValueError, match="unknown"):
        ServerAcceptance.from_dict({**raw, "extra": 1})
    empty = ServerAcceptance.from_dict({**raw, "spec_verify_ct": 0, "accept_length": None,
                                        "tau": None})
    assert math.isnan(empty.accept_length)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="max_new_tokens must be >= 2"):
        measure_server_acceptance("http://127.0.0.1:1", [[1]], 1)
    with pytest.raises(ValueError, match="http"):
        measure_server_acceptance("127.0.0.1:1", [[1]], 4)
    with pytest.raises(ValueError, match="at least one token"):
        measure_server_acceptance("http://127.0.0.1:1", [[1], []], 4)
