"""The engine evaluators against contract servers they start themselves (SGLang's
``/generate``, vLLM's ``/v1/completions``): the same τ as the in-process engine on the same
prompts and sampler (the contract servers decode with Aerie's engine, so the counts must
agree exactly, per prompt), and every launch fault a named error or a failing lossless
check, never a report the gate could promote on."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from pipeline.checks import evaluation_sound
from pipeline.evaluation import stage
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.evaluators import Evaluator
from pipeline.evaluation.on_engine import DrafterNotDrafting
from pipeline.evaluation.servers import EngineDiedError, EngineServers, EngineStartError
from pipeline.evaluation.sglang_mode import SpeculativeConfigError
from pipeline.evaluation.stage import NO_DRAFTER, read_report
from pipeline.storage import Storage
from tests.evaluation.world import SETTINGS, eval_world, publish_drafter_dir
from tests.sglang_contract.drafters import save_copy_dflash, save_copy_drafter
from tests.training.world import tiny_target

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = (sys.executable, "-m", "tests.sglang_contract.server", "--model", "{policy_dir}",
          "--port", "{port}", "{speculative_args}")
LAUNCHES = {"sglang": LAUNCH,
            "vllm": (sys.executable, "-m", "tests.vllm_contract.completions_server",
                     "{policy_dir}", "--port", "{port}", "{speculative_args}")}
VERSIONS = {"sglang": "0.5.23", "vllm": "0.33.0"}
CONFIG = EvalConfig(max_prompts=6, max_new_tokens=12, **SETTINGS)


@dataclass(frozen=True)
class World:
    storage: Storage
    candidate: str
    champion: str
    logs: Path
    candidate_dir: Path


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    root = tmp_path_factory.mktemp("engine-eval")
    storage, target = eval_world(root / "storage", tie=True)  # a target that repeats
    vocab = target.config.vocab_size
    outputs = [list(range(vocab))]  # every token in the draft vocab
    drafters = {}
    for name, noise in (("candidate", 0.0), ("champion", 1.0)):  # noise: drafts worse
        local = save_copy_drafter(target, root / name, outputs, draft_vocab=vocab, noise=noise)
        drafters[name] = publish_drafter_dir(storage, local, f"drafters/{name}", 2,
                                             f"fp-{name}")
    return World(storage, drafters["candidate"], drafters["champion"], root / "logs",
                 root / "candidate")


def sglang(world: World, *extra: str, engine: str = "sglang", **kw) -> Evaluator:
    return Evaluator(engine, EngineServers(launch=LAUNCHES[engine] + extra, **{
        "log_dir": str(world.logs), "health_timeout_s": 120.0, **kw}))


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the template runs ``python -m tests.sglang_contract.server``


SAMPLED = {"temperature": 0.03, "top_p": 0.9}


@pytest.mark.parametrize(("kind", "sampler"), [("sglang", {}), ("sglang", SAMPLED),
                                               ("vllm", SAMPLED)],
                         ids=["sglang-greedy", "sglang-sampled", "vllm-sampled"])
def test_the_engines_counts_are_the_in_process_engines(world, kind, sampler):
    """Also the benchmark of docs/benchmarks.md#engine-judge (``pytest -s``: both lines)."""
    config = replace(CONFIG, **sampler)
    local = stage.run(world.storage, 2, world.candidate, world.champion, config)
    engine = stage.run(world.storage, 2, world.candidate, world.champion, config,
                       sglang(world, engine=kind))
    for r in (local, engine):
        print(f"{r.regime} {r.evaluator_kind}: " + ", ".join(
            f"{n} τ {c.tau:.4f} [{c.tau_interval[0]:.4f}, {c.tau_interval[1]:.4f}] over "
            f"{sum(p[1] for p in c.per_prompt)} passes"
            for n, c in r.contestants.items() if n != NO_DRAFTER) + f"; {r.seconds:.1f} s")

    assert engine.evaluator_kind == kind and local.evaluator_kind == "inprocess"
    assert engine.evaluator["version"] == VERSIONS[kind]
    served = engine.evaluator["server_args"]["model_path" if kind == "sglang" else "model"]
    assert Path(served, "config.json").is_file()  # the step's policy, fetched
    assert engine.fingerprint != local.fingerprint
    assert engine.sampler_key == local.sampler_key and engine.heldout_key == local.heldout_key
    assert engine.settings == local.settings
    for name in ("candidate", "champion", NO_DRAFTER):
        mine, theirs = local.contestants[name], engine.contestants[name]
        assert theirs.per_prompt == mine.per_prompt, name  # same seeds, same draws
        assert theirs.tau == mine.tau and theirs.tau_interval == mine.tau_interval
        assert theirs.outputs_match_baseline == engine.checked_prompts
    candidate = engine.contestants["candidate"]
    assert candidate.tau > engine.contestants["champion"].tau > 1.0
    assert candidate.acceptance.positions_observed is False  # SGLang reports totals only
    assert engine.reference == {"prompts": 0, "indices": local.reference["indices"]}
    assert engine.checked_prompts == (engine.heldout["prompts"] if not sampler
                                      else len(local.reference["indices"]))
    outcome = evaluation_sound(engine)
    assert outcome.passed, outcome.description
    assert f"on {kind}: the server without a drafter is the reference" in outcome.description
    assert read_report(world.storage, 2) == engine  # published, and idempotent:
    again = sglang(world, engine=kind, log_dir=str(world.logs / "again"))
    assert stage.run(world.storage, 2, world.candidate, world.champion, config,
                     again) == engine
    assert not (world.logs / "again").exists()  # no server was started
    assert not _contract_servers_running()


@pytest.mark.parametrize(("kind", "fault", "error", "match"), [
    ("sglang", "no_spec", SpeculativeConfigError, "came up without speculative decoding"),
    ("vllm", "no_spec", SpeculativeConfigError, "no metrics.speculative_decoding"),
    ("sglang", "wrong_drafter", DrafterNotDrafting, "accepted no draft token"),
    ("vllm", "wrong_drafter", DrafterNotDrafting, "accepted no draft token"),
    ("sglang", "dies", EngineDiedError, "exited with status 3 while it was being measured"),
], ids=["sglang-no_speculation", "vllm-no_speculation", "sglang-wrong_drafter",
        "vllm-wrong_drafter", "sglang-dies_mid_evaluation"])
def test_a_misbehaving_server_is_a_named_error_and_nothing_is_published(
        world, kind, fault, error, match):
    config = replace(CONFIG, max_prompts=4, max_new_tokens=16, seed=len(fault))  # > 32
    before = read_report(world.storage, 2)  # verify passes
    with pytest.raises(error, match=match) as raised:
        stage.run(world.storage, 2, world.candidate, None, config,
                  sglang(world, "--launch-fault", fault, engine=kind))
    if kind == "sglang":  # vLLM's answers are judged by the client, not a server's label
        assert "sglang server for candidate" in str(raised.value)
    assert read_report(world.storage, 2) == before
    assert not _contract_servers_running()


def test_a_server_that_never_becomes_healthy_is_stopped_at_the_bound(world):
    config = replace(CONFIG, max_prompts=4, seed=11)
    with pytest.raises(EngineStartError, match=r"not healthy within 12 s \(last /health: "
                                               r"HTTP 503\)"):
        stage.run(world.storage, 2, world.candidate, None, config,
                  sglang(world, "--launch-fault", "unhealthy", health_timeout_s=12.0))
    with pytest.raises(EngineStartError, match="exited with status 2 before it was healthy"):
        stage.run(world.storage, 2, world.candidate, None, config,
                  sglang(world, "--no-such-flag"))
    assert not _contract_servers_running()


def test_output_that_is_not_lossless_fails_the_check_that_blocks_promotion(world):
    config = replace(CONFIG, max_prompts=4, max_new_tokens=10, seed=12)
    report = stage.run(world.storage, 2, world.candidate, None, config,
                       sglang(world, "--launch-fault", "lossy"))
    outcome = evaluation_sound(report)
    assert not outcome.passed
    wanted = f"candidate: 0/{report.checked_prompts} prompts match greedy decoding"
    assert wanted in outcome.description


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_a_divergence_at_the_targets_top_two_is_a_near_tie_within_the_bound(world, kind):
    """The tied target's log-probabilities are all close: a greedy output that ends on the
    target's second choice (the ``near_tie`` fault) is a near-tie at the default bound, and a
    failure when none is tolerated."""
    config = replace(CONFIG, max_prompts=4, max_new_tokens=10, seed=14)
    fault = ("--launch-fault", "near_tie")
    report = stage.run(world.storage, 2, world.candidate, None, config,
                       sglang(world, *fault, engine=kind))
    candidate = report.contestants["candidate"]
    assert candidate.ties == report.checked_prompts - candidate.outputs_match_baseline > 0
    outcome = evaluation_sound(report)
    assert outcome.passed and f"at {kind} near-ties" in outcome.description
    if kind == "vllm":
        return  # the bound is the engine-independent part: checked once, on sglang
    strict = stage.run(world.storage, 2, world.candidate, None, config,
                       sglang(world, *fault, engine=kind, tie_nats=0.0))
    assert strict.contestants["candidate"].ties == 0
    assert not evaluation_sound(strict).passed


def test_a_vllm_server_in_dev_mode_that_loads_another_drafter_is_refused(world,
                                                                          monkeypatch):
    """The template overrides the drafter (argparse keeps the last flag): the dev-mode
    ``/server_info`` names the other one."""
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    other = '{{"method":"eagle3","model":"%s","num_speculative_tokens":3}}' % (
        world.candidate_dir.parent / "champion")  # braces doubled: literal in a template
    with pytest.raises(SpeculativeConfigError, match="vllm server for candidate loaded the "
                                                     "drafter .*champion, not the one"):
        stage.run(world.storage, 2, world.candidate, None, replace(CONFIG, seed=15),
                  sglang(world, "--speculative-config", other, engine="vllm"))
    assert not _contract_servers_running()


def test_vllm_refuses_a_tree_before_any_server_starts(world):
    config = replace(CONFIG, num_steps=3, eagle_topk=2, num_draft_tokens=6, seed=13)
    with pytest.raises(SpeculativeConfigError, match="vLLM drafts EAGLE-3 as a chain only"):
        stage.run(world.storage, 2, world.candidate, None, config,
                  sglang(world, engine="vllm", log_dir=str(world.logs / "tree")))
    assert not list((world.logs / "tree").glob("*.log"))


def test_a_template_that_cannot_start_a_contestant_is_refused_before_anything_runs():
    with pytest.raises(ValueError, match="must use {speculative_args}"):
        Evaluator("sglang", EngineServers(launch=("sglang", "--model-path", "{policy_dir}",
                                                  "--port", "{port}")))
    with pytest.raises(ValueError, match="must stand alone"):
        Evaluator("sglang", EngineServers(launch=LAUNCH[:-1] + ("x{speculative_args}",)))
    with pytest.raises(ValueError, match="unknown placeholders"):
        Evaluator("sglang", EngineServers(launch=LAUNCH + ("{drafter}",)))


def _contract_servers_running() -> list[int]:
    """PIDs of contract servers started by evaluation templates that are still alive."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (b"tests.sglang_contract.server" in cmd and b"--wait-for-model" not in cmd) \
                or b"tests.vllm_contract.completions_server" in cmd:
            found.append(int(pid))
    return found


def test_the_gate_decides_a_refresh_on_sglang_through_dagster(world, tmp_path):
    """acceptance_eval -> registered_drafter -> serving_drafter materialized by Dagster with
    the evaluator resource set to sglang: the report is SGLang's, and the gate promotes on
    it (the candidate drafts; no drafter serves yet)."""
    from dagster import instance_for_test, materialize

    from assets.evaluation import acceptance_eval
    from assets.release import registered_drafter, serving_drafter
    from pipeline.release.mlflow_registry import model_name
    from pipeline.serving_now import read_serving
    from resources.evaluator import EngineServersConfig, EvaluatorResource
    from resources.mlflow import MlflowResource
    from resources.refresh import RefreshPolicyResource
    from resources.serving import ServingResource
    from resources.storage import StorageResource
    from tests.release.helpers import as_refresh

    as_refresh(world.storage, 2, world.candidate, "c" * 64)
    family = f"engine{os.getpid()}"
    resources = {
        "storage": StorageResource(url=world.storage.url()),
        "mlflow": MlflowResource(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                                 artifact_location=(tmp_path / "artifacts").as_uri(),
                                 target_family=family, lock_dir=str(tmp_path / "locks"),
                                 lock_timeout_s=30),
        "serving": ServingResource(), "refresh": RefreshPolicyResource(),
        "evaluator": EvaluatorResource(kind="sglang", sglang=EngineServersConfig(
            launch=list(LAUNCH), health_timeout_s=120, log_dir=str(world.logs)))}
    run_config = {"ops": {"acceptance_eval": {"config": {"max_prompts": 4,
                                                         "max_new_tokens": 10, "seed": 21}},
                          "serving_drafter": {"config": {"min_cycles": 10}}}}
    with instance_for_test() as instance:
        instance.add_dynamic_partitions("refresh_steps", ["step-000002"])
        result = materialize([acceptance_eval, registered_drafter, serving_drafter],
                             partition_key="step-000002", instance=instance,
                             resources=resources, run_config=run_config)
    assert result.success
    (evaluated,) = result.asset_materializations_for_node("acceptance_eval")
    assert evaluated.metadata["evaluator"].value == "sglang 0.5.23"
    report = read_report(world.storage, 2)
    assert report.evaluator_kind == "sglang" and report.contestants["candidate"].tau > 2
    (served,) = result.asset_materializations_for_node("serving_drafter")
    assert served.metadata["action"].value == "promoted"
    assert read_serving(world.storage, model_name(family)).target.fingerprint == "c" * 64
    assert not _contract_servers_running()


def test_aerie_eval_measures_a_drafter_directory_on_sglang(world, monkeypatch, capsys):
    import json

    from aerie import cli

    monkeypatch.setenv("AERIE_STORAGE_URL", world.storage.url())
    monkeypatch.setenv("AERIE_EVALUATOR_SGLANG_LAUNCH", json.dumps(LAUNCH))
    monkeypatch.setenv("AERIE_EVALUATOR_SGLANG_HEALTH_TIMEOUT_S", "120")
    assert cli.main(["eval", str(world.candidate_dir), "--evaluator", "sglang", "--step", "2",
                     "--window", "2", "--prompts", "4", "--max-new-tokens", "10",
                     "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert measured["evaluator"] == "sglang 0.5.23"
    drafter = measured["contestants"]["drafter"]
    assert drafter["outputs_match_baseline"] == measured["lossless_prompts"] > 0
    row = measured["rows"][1]  # SGLang reports totals: no α per position
    assert row["tau"] > 2 and row["alpha"] == [None] * measured["settings"]["num_steps"]
    monkeypatch.setenv("AERIE_EVALUATOR_SGLANG_LAUNCH", json.dumps(LAUNCH[:-1]))
    assert cli.main(["eval", str(world.candidate_dir), "--evaluator", "sglang"]) == 2
    assert "must use {speculative_args}" in capsys.readouterr().err
    assert not _contract_servers_running()


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_a_dflash_candidate_is_judged_on_the_engines_as_in_process(world, kind, tmp_path):
    """A DFlash drafter launched with DFlash's flags (SGLang reports its forced one step;
    vLLM drafts block - 1 tokens) counts what the in-process engine counts, prompt by
    prompt, against an EAGLE-3 champion."""
    target = tiny_target(seed=4, tie=True)  # the world's
    local_dir = save_copy_dflash(target, tmp_path / "dflash", block_size=6)
    candidate = publish_drafter_dir(world.storage, local_dir, "drafters/dflash", 2, "fp-dflash")
    sampled = replace(CONFIG, **SAMPLED)
    local = stage.run(world.storage, 2, candidate, world.champion, sampled)
    engine = stage.run(world.storage, 2, candidate, world.champion, sampled,
                       sglang(world, engine=kind, log_dir=str(tmp_path / "logs")))
    assert local.contestants["candidate"].settings == \
        engine.contestants["candidate"].settings == \
        {"num_steps": 5, "eagle_topk": 1, "num_draft_tokens": 6}  # its block's chain
    assert engine.settings == local.settings and engine.settings["num_steps"] == 3  # EAGLE's
    for name in ("candidate", "champion", NO_DRAFTER):
        assert engine.contestants[name].per_prompt == local.contestants[name].per_prompt
    assert engine.contestants["candidate"].tau > 1.0
    outcome = evaluation_sound(engine)
    assert outcome.passed, outcome.description
    assert not _contract_servers_running()
