"""The engine evaluators' pure parts: launch templates, engine totals as acceptance stats,
how each engine's answers are read, near-ties and the not-drafting rule (no server; the
servers themselves are in ``test_on_engine.py``)."""

from __future__ import annotations

import math

import pytest

from pipeline.argv_template import check_template, expand
from pipeline.capture.engine_http import TransientFailure
from pipeline.eagle3.spec import SpecParams
from pipeline.evaluation import on_engine
from pipeline.evaluation.engine_api import EngineRun
from pipeline.evaluation.evaluators import EVALUATORS, Evaluator, label
from pipeline.evaluation.metrics import AcceptanceStats
from pipeline.evaluation.on_engine import DrafterNotDrafting
from pipeline.evaluation.servers import EngineServers
from pipeline.evaluation.sglang_engine import SGLang, parse_plain
from pipeline.evaluation.sglang_mode import SpeculativeConfigError
from pipeline.evaluation.vllm_engine import VLLM, _parse, _request
from pipeline.sampling import GREEDY, SamplingParams, prompt_seed
from resources.evaluator import EngineServersConfig, EvaluatorResource
from tests.release.helpers import make_drafter_dir

pytestmark = pytest.mark.unit

TEMPLATE = ("sglang", "--model-path", "{policy_dir}", "--port", "{port}", "{speculative_args}")


def test_a_list_placeholder_expands_into_items_and_the_rest_are_formatted():
    flags = ["--speculative-algorithm", "EAGLE3"]
    assert expand(TEMPLATE, {"policy_dir": "/p", "port": 9}, {"speculative_args": flags}) == [
        "sglang", "--model-path", "/p", "--port", "9", *flags]
    assert expand(TEMPLATE, {"policy_dir": "/p", "port": 9}, {"speculative_args": []})[-1] \
        == "9"  # no drafter: no flags at all
    assert expand(["a{{b}}{port}"], {"port": 1}) == ["a{b}1"]


@pytest.mark.parametrize(("argv", "match"), [
    ((), "is empty"),
    (TEMPLATE[:-1], "must use {speculative_args}"),
    (TEMPLATE[:-1] + ("--x={speculative_args}",), "must stand alone"),
    (TEMPLATE + ("{secret}",), r"unknown placeholders \['secret'\]"),
    (TEMPLATE + ("{port!r}",), "must be a plain name"),
])
def test_a_template_that_cannot_start_a_contestant_is_refused_naming_why(argv, match):
    with pytest.raises(ValueError, match=match):
        check_template(argv, {"policy_dir", "port", "speculative_args"},
                       required=("policy_dir", "port", "speculative_args"),
                       lists=("speculative_args",), what="the template")


def test_engine_totals_are_stats_with_no_per_position_counts():
    stats = AcceptanceStats.from_totals(3, prompts=2, cycles=10, emitted_tokens=25)
    assert stats.tau == 2.5 and stats.server_accept_length == 2.7
    assert all(math.isnan(a) for a in stats.alpha)
    assert all(math.isnan(v) for v in stats.accept_length_histogram.values())
    assert stats.merge(AcceptanceStats.from_totals(3, prompts=1, cycles=2, emitted_tokens=2)
                       ).counts()["emitted_tokens"] == 27
    with pytest.raises(ValueError, match="more than num_steps"):
        AcceptanceStats.from_totals(3, prompts=1, cycles=2, emitted_tokens=9)
    with pytest.raises(ValueError, match="cannot merge"):
        stats.merge(AcceptanceStats(3))
    with pytest.raises(ValueError, match="carry no per-cycle counts"):
        AcceptanceStats(3, cycles=1, emitted_tokens=1, bonus_tokens=1, accept_hist=[1, 0, 0, 0],
                        positions_observed=False)


def test_the_evaluators_are_registered_once_and_checked_when_built():
    assert set(EVALUATORS) == {"inprocess", "sglang", "vllm"}
    assert Evaluator().identity() is None  # in process: reports keep their fingerprints
    sglang = Evaluator("sglang", EngineServers(launch=TEMPLATE))
    assert sglang.identity()["kind"] == "sglang" and "sglang" not in str(
        sglang.identity()["launch_sha256"])  # a digest, never the command line
    assert sglang.identity() != Evaluator(
        "sglang", EngineServers(launch=TEMPLATE + ("--tp", "8"))).identity()
    with pytest.raises(ValueError, match="not one of"):
        Evaluator("trtllm")
    with pytest.raises(ValueError, match="sglang evaluator's launch template is empty"):
        Evaluator("sglang")
    assert label({"kind": "vllm", "version": "0.33.0"}) == "vllm 0.33.0"
    assert label({}) == "inprocess"


def test_the_resource_names_a_bad_template_with_an_example():
    bad = EvaluatorResource(kind="vllm", vllm=EngineServersConfig(launch=["vllm", "serve"]))
    problem = bad.problem()
    assert problem.startswith("resources.evaluator.config: the vllm evaluator's launch "
                              "template must use {policy_dir}, {port}, {speculative_args}")
    assert EvaluatorResource().problem() is None and EvaluatorResource().build().kind == \
        "inprocess"
    built = EvaluatorResource(kind="sglang", sglang=EngineServersConfig(
        launch=list(TEMPLATE), tie_nats=0.0)).build()
    assert built.servers.launch == TEMPLATE and built.servers.tie_nats == 0.0


def test_each_engine_gets_its_own_flags_and_vllm_refuses_a_tree(tmp_path):
    chain, d = SpecParams(3, 1, 4), make_drafter_dir(tmp_path / "d")
    assert SGLang().speculative_args(d, SpecParams(3, 2, 6)) == [
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(d),
        "--speculative-num-steps", "3", "--speculative-eagle-topk", "2",
        "--speculative-num-draft-tokens", "6"]
    flags = VLLM().speculative_args(d, chain)
    assert flags == ["--speculative-config",
                     f'{{"method":"eagle3","model":"{d}","num_speculative_tokens":3}}',
                     "--per-request-spec-decode-metrics", "summary"]
    with pytest.raises(SpeculativeConfigError, match="chain only"):
        VLLM().speculative_args(d, SpecParams(3, 2, 6))
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text('{"architectures": ["Medusa"]}')
    for engine in (SGLang(), VLLM()):
        with pytest.raises(SpeculativeConfigError, match=r"\['Medusa'\] name no drafter"):
            engine.speculative_args(tmp_path / "x", chain)


def test_a_vllm_request_sets_every_sampler_field_and_the_prompts_seed():
    sampled = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05)
    request = _request("m", [1, 2], 8, sampled, prompt_seed(3, 1))
    assert request == {"model": "m", "prompt": [1, 2], "max_tokens": 8, "n": 1,
                       "return_token_ids": True, "temperature": 0.7, "top_p": 0.9,
                       "top_k": 20, "min_p": 0.05, "seed": prompt_seed(3, 1)}
    assert _request("m", [1], 8, GREEDY, 0)["temperature"] == 0.0


def _answer(ids, spec=None):
    return {"choices": [{"token_ids": ids}],
            "metrics": None if spec is None else {"speculative_decoding": spec}}


def test_a_vllm_answer_gives_emitted_tokens_over_its_verify_passes():
    spec = {"num_spec_steps": 3, "num_spec_tokens": 3, "num_accepted_draft_tokens": 6}
    assert _parse(_answer([5, 6, 7, 8, 9, 10], spec), 8, 3) == ((5, 6, 7, 8, 9, 10), 3)
    assert _parse(_answer([5], {"num_spec_steps": 0, "num_spec_tokens": 3}), 8, 3) == \
        ((5,), 0)  # stopped at its prefill token
    assert _parse(_answer([5, 6]), 8, None) == ((5, 6), 1)
    with pytest.raises(SpeculativeConfigError, match="no metrics.speculative_decoding"):
        _parse(_answer([5, 6]), 8, 3)
    with pytest.raises(SpeculativeConfigError, match="it drafts"):
        _parse(_answer([5, 6], spec), 8, None)
    with pytest.raises(SpeculativeConfigError, match="num_spec_tokens 3 per pass, not the 5"):
        _parse(_answer([5, 6], spec), 8, 5)
    with pytest.raises(TransientFailure, match="from 1 verify passes of 3 draft tokens"):
        _parse(_answer(list(range(7)), {"num_spec_steps": 1, "num_spec_tokens": 3}), 8, 3)
    with pytest.raises(TransientFailure, match="return_token_ids"):
        _parse({"choices": [{"token_ids": None}]}, 8, 3)


def test_a_plain_sglang_answer_is_one_forward_per_token_and_must_not_draft():
    body = {"output_ids": [4, 5, 6], "meta_info": {"completion_tokens": 3}}
    assert parse_plain(body, 8).output_ids == (4, 5, 6)
    with pytest.raises(SpeculativeConfigError, match="it drafts"):
        parse_plain({**body, "meta_info": {"completion_tokens": 3, "spec_verify_ct": 1}}, 8)
    with pytest.raises(TransientFailure, match="completion_tokens"):
        parse_plain({"output_ids": [], "meta_info": {"completion_tokens": 0}}, 8)


class FakeEngine:
    """``top2`` answers from a table: (prefix) -> [(token, logprob), ...]."""

    def __init__(self, table):
        self.table, self.asked = table, []

    def top2(self, url, ids, *, timeout):
        self.asked.append(tuple(ids))
        return self.table[tuple(ids)]


def test_a_divergence_is_a_near_tie_only_at_the_top_two_within_the_bound():
    ids = [[1], [2], [3], [4]]
    expected = {0: (7, 8, 9), 1: (7, 8), 2: (7, 8, 9), 3: (7, 8)}
    got = {0: (7, 8, 10),  # at the top two, 0.3 apart: a tie
           1: (7, 5),  # the emitted token is not the runner-up: no tie
           2: (7, 8),  # stopped earlier: never a tie
           3: (7, 8)}  # equal
    engine = FakeEngine({(1, 7, 8): [(9, -0.9), (10, -1.2)],
                         (2, 7): [(8, -0.1), (6, -0.2)]})
    servers = EngineServers(launch=TEMPLATE)
    assert on_engine._near_ties(engine, "u", ids, got, expected, servers) == 1
    assert engine.asked == [(1, 7, 8), (2, 7)]
    assert on_engine._near_ties(engine, "u", ids, got, expected,
                                EngineServers(launch=TEMPLATE, tie_nats=0.2)) == 0
    assert on_engine._near_ties(FakeEngine({}), "u", ids, got, expected,
                                EngineServers(launch=TEMPLATE, tie_nats=0.0)) == 0


def test_a_drafter_that_accepts_nothing_in_enough_passes_is_not_drafting():
    idle = EngineRun(((16, 16), (16, 16)), ((1,) * 17, (1,) * 17))
    with pytest.raises(DrafterNotDrafting, match="accepted no draft token in 32 verify") as e:
        on_engine._check_drafting("sglang server for candidate", idle, "candidate")
    assert "champion: none" not in str(e.value)
    with pytest.raises(DrafterNotDrafting, match="against no drafter .acceptance_eval's "
                                                 "champion: none"):
        on_engine._check_drafting("sglang server for champion", idle, "champion")
    on_engine._check_drafting("few passes", EngineRun(((31, 31),), ((1,) * 32,)), "candidate")
    on_engine._check_drafting("one accept", EngineRun(((17, 16), (16, 16)),
                                                      ((1,) * 18, (1,) * 17)), "candidate")


def test_a_server_logs_secrets_are_redacted_before_an_error_quotes_them():
    from pipeline.evaluation.servers import redact

    log = ("ServerArgs(model_path='/m', api_key='sk-1', tp_size=8)\n"
           "non-default args: {'hf_token': 'hf_2', 'port': 1}\n"
           "argv: --api-key s3 --port 9 password=p4 token: t5")
    cleaned = redact(log)
    assert not any(secret in cleaned for secret in ("sk-1", "hf_2", "s3 ", "p4", "t5"))
    assert "model_path='/m'" in cleaned and "tp_size=8" in cleaned and "--port 9" in cleaned
