"""The definitions load (fast), renames of assets, checks, jobs or sensors fail loudly, and the
run-config mirrors of the stage configs keep the stages' defaults."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dagster import AssetKey

from assets.groups import DATA_ASSETS, MONITOR_ASSETS, REFRESH_ASSETS
from definitions import defs

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "matplotlib", "mlflow", "deepspeed", "pyarrow", "tokenizers")


def test_definitions_load_and_names_are_stable():
    repo = defs.get_repository_def()
    assert {k.to_user_string() for k in repo.asset_graph.get_all_asset_keys()} == {
        "rollout_snapshot", "tokenized_rollouts", "hidden_state_shards", "vocab_mapping",
        "drafter_checkpoint", "acceptance_eval", "registered_drafter", "serving_drafter",
        "storage_retention", "serving_acceptance"}
    assert {c.to_user_string() for c in repo.asset_graph.asset_check_keys} == {
        "rollout_snapshot:quarantine_ratio", "hidden_state_shards:shard_integrity",
        "vocab_mapping:vocab_coverage", "drafter_checkpoint:training_loss",
        "acceptance_eval:acceptance_lossless", "serving_drafter:serving_staleness",
        "serving_drafter:promotion_verified"}  # one check per meaning, one name per check
    assert {j.name for j in repo.get_all_jobs() if not j.name.startswith("__")} == {
        "ingest_step", "drafter_refresh", "promote_drafter_manually", "rollback_drafter",
        "ingest_dumps"}
    assert {s.name for s in repo.sensor_defs} == {"snapshot_sensor", "refresh_sensor",
                                                  "drift_sensor", "dump_sensor"}
    assert {s.name for s in repo.schedule_defs} == {"drafter_refresh_schedule"}
    assert set(defs.resources) == {"storage", "capture", "trainer", "mlflow", "serving",
                                  "refresh", "ingest", "evaluator"}


@pytest.mark.integration
def test_loading_the_definitions_imports_no_heavy_library():
    """torch, transformers, matplotlib & co. load in the runs that need them, not in every
    process that loads the code location (webserver, daemon, sensor ticks)."""
    probe = ("import json, sys, definitions; "
             f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert json.loads(out.splitlines()[-1]) == []


@pytest.mark.integration
def test_acceptance_eval_is_of_the_kind_of_the_engine_that_judges():
    """In process it is pytorch; with AERIE_EVALUATOR_KIND=vllm the catalog says vllm."""
    probe = ("import definitions; from dagster import AssetKey; print(sorted(definitions.defs"
             ".get_repository_def().asset_graph.get(AssetKey('acceptance_eval')).kinds))")
    env = {**os.environ, "AERIE_EVALUATOR_KIND": "vllm",
           "AERIE_EVALUATOR_VLLM_LAUNCH": '["vllm", "serve", "{policy_dir}", "--port", '
                                          '"{port}", "{speculative_args}"]'}
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                         text=True, check=True, env=env).stdout
    assert out.splitlines()[-1] == "['vllm']"
    graph = defs.get_repository_def().asset_graph
    assert graph.get(AssetKey("acceptance_eval")).kinds == {"pytorch"}


def test_refresh_assets_describe_their_window():
    graph = defs.get_repository_def().asset_graph
    for name in ("vocab_mapping", "drafter_checkpoint", "acceptance_eval",
                 "registered_drafter"):
        description = graph.get(AssetKey(name)).description
        assert "refresh_steps" in description and "s-K+1..s" in description, name
        assert "window_steps" in description, name


def every_field_changed(changed) -> bool:
    """``changed`` differs from its class's defaults in every field, so a round trip that
    dropped any field would show (a new field must be added to the probe to pass)."""
    default = type(changed)()
    same = [f.name for f in dataclasses.fields(changed)
            if getattr(changed, f.name) == getattr(default, f.name)]
    assert same == [], f"{type(changed).__name__}: the probe leaves {same} at the default"
    return True


def test_run_config_defaults_mirror_the_stage_configs():
    """Each asset's run config converts to its stage's config with the same defaults (the
    torch-free ``pipeline/<stage>/config.py``): no field is dropped on the way."""
    from assets.drafter import VocabRunConfig
    from assets.evaluation import EvalRunConfig
    from assets.shards import ShardsConfig
    from assets.tokenized import TokenizeRunConfig
    from pipeline.capture.config import ExtractConfig
    from pipeline.evaluation.config import EvalConfig
    from pipeline.tokenize.config import TokenizeConfig
    from pipeline.vocab.config import DEFAULT_DRAFT_VOCAB_SIZE
    from resources.serving import ServingResource

    assert ShardsConfig().to_core() == ExtractConfig()
    assert TokenizeRunConfig().to_core() == TokenizeConfig()
    # and every field is carried over, not only the defaults
    changed = ExtractConfig(token_budget=99, max_batch_size=3, shard_bytes=5,
                            row_group_bytes=7, compression="none", sort_by_length=False,
                            heldout_fraction=0.5, encoding="fp8")
    assert every_field_changed(changed)
    assert ShardsConfig(**dataclasses.asdict(changed)).to_core() == changed
    changed = TokenizeConfig(max_length=99, keep_tail=9, min_response_tokens=2,
                             rows_per_file=11, end_of_turn_tokens=("<x>",), max_examples=1)
    assert every_field_changed(changed)
    assert TokenizeRunConfig(**{**dataclasses.asdict(changed), "end_of_turn_tokens": ["<x>"]}
                             ).to_core() == changed
    core = EvalRunConfig().to_core(ServingResource())
    assert (core.max_prompts, core.max_new_tokens) == (EvalConfig().max_prompts,
                                                       EvalConfig().max_new_tokens)
    changed = EvalConfig(max_prompts=3, max_new_tokens=9, num_steps=2, eagle_topk=1,
                         num_draft_tokens=3, reference_prompts=2, temperature=0.7, top_p=0.9,
                         top_k=5, min_p=0.1, seed=4, device="auto", dtype="bfloat16",
                         confidence=0.9)
    assert every_field_changed(changed)
    assert EvalRunConfig(**dataclasses.asdict(changed)).to_core(ServingResource()) == changed
    assert VocabRunConfig().draft_vocab_size == DEFAULT_DRAFT_VOCAB_SIZE


def test_every_asset_has_an_owner_a_stage_and_every_trigger_a_description():
    specs = {spec.key.path[-1]: spec for spec in defs.resolve_all_asset_specs()}
    flow = (*DATA_ASSETS, *REFRESH_ASSETS, *MONITOR_ASSETS)
    stages = [specs[name].tags["aerie/stage"] for name in flow]
    assert stages == [str(n) for n in range(1, len(flow) + 1)]
    assert all(spec.owners == ["team:aerie"] for spec in specs.values())
    for sensor in defs.sensors:
        assert sensor.description and "runs" in sensor.description
    assert all(s.description for s in defs.schedules)
    assert all(defs.resolve_job_def(j).description for j in (
        "ingest_step", "drafter_refresh", "promote_drafter_manually", "rollback_drafter",
        "ingest_dumps"))


def test_every_asset_has_the_code_version_of_what_it_writes():
    """The catalog marks an asset whose output format changed: each code version names the
    schema versions of that asset's output (``assets/versions.py``)."""
    from pipeline.capture.shards import SHARD_SCHEMA_VERSION
    from pipeline.evaluation.stage import REPORT_SCHEMA_VERSION

    specs = {spec.key.path[-1]: spec for spec in defs.resolve_all_asset_specs()}
    assert {name: bool(spec.code_version) for name, spec in specs.items()} == {
        name: True for name in (*DATA_ASSETS, *REFRESH_ASSETS, *MONITOR_ASSETS)}
    assert specs["hidden_state_shards"].code_version.startswith(
        f"shards-{SHARD_SCHEMA_VERSION}.")  # the stage's own constant, not a copy
    assert specs["acceptance_eval"].code_version == f"report-{REPORT_SCHEMA_VERSION}"


def test_the_graph_closes_the_loop():
    """Observed acceptance reads whichever drafter serves: an edge from every refresh's
    ``serving_drafter``; retention follows the registration, whatever the gate decides."""
    graph = defs.get_repository_def().asset_graph
    parents = {k.to_user_string() for k in graph.get(AssetKey("serving_acceptance")).parent_keys}
    assert parents == {"rollout_snapshot", "serving_drafter"}
    assert {k.to_user_string() for k in graph.get(AssetKey("storage_retention")).parent_keys
            } == {"registered_drafter"}


@pytest.mark.integration
def test_the_embedded_workspace_loads_from_any_directory(tmp_path, monkeypatch):
    """``aerie ui`` serves ``$DAGSTER_HOME/workspace.yaml``: the code location ``aerie`` from
    the installed ``definitions`` module, whatever the working directory."""
    from aerie import cli

    monkeypatch.setenv("AERIE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home" / "dagster"))
    home = cli.prepare_dagster_home()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run(
        [str(Path(sys.executable).with_name("dagster")), "definitions", "validate", "-w",
         str(home / "workspace.yaml")], cwd=elsewhere, capture_output=True, text=True,
        timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Validation successful for code location aerie" in done.stderr + done.stdout


def test_the_cli_loads_the_definitions_the_workspace_names():
    """The CLI never imports ``definitions``: it loads the module the workspaces name (the
    checkout's and the embedded one), as Dagster does."""
    import yaml

    from aerie import launch

    for text in ((ROOT / "workspace.yaml").read_text(), launch.WORKSPACE_YAML):
        (location,) = yaml.safe_load(text)["load_from"]
        module = location["python_module"]
        assert (module["module_name"], module["attribute"]) == (
            launch.DEFINITIONS_MODULE, launch.DEFINITIONS_ATTRIBUTE)
    assert launch.definitions() is defs
