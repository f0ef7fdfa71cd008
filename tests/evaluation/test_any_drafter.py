"""``aerie eval``: any drafter directory measured against a committed step's policy, on the
held-out prompts, with the evaluation stage's contest (pipeline.evaluation.any_drafter)."""

from __future__ import annotations

import json

import pytest
import torch

from aerie.cli import main
from pipeline.evaluation import stage
from pipeline.evaluation.any_drafter import measure_drafter
from pipeline.evaluation.config import EvalConfig
from pipeline.verified import fetch
from tests.evaluation.world import SETTINGS, STEPS, eval_world, publish_drafter

pytestmark = pytest.mark.integration

CONFIG = EvalConfig(max_prompts=4, max_new_tokens=8, **SETTINGS)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("any-drafter")
    storage, target = eval_world(root / "storage")
    prefix = publish_drafter(storage, target, step=2, seed=1, tmp=root)
    return storage, prefix, fetch(storage, prefix, kind="drafter_checkpoint", label="drafter")


def test_a_drafter_directory_measures_as_the_stage_measures_it(world):
    storage, prefix, directory = world
    ours = measure_drafter(storage, 2, directory, STEPS, CONFIG)
    report = stage.run(storage, 2, prefix, config=CONFIG)
    assert list(ours.contestants) == ["no_drafter", "drafter"]
    assert ours.prompts == report.heldout["prompts"] and ours.window == STEPS
    for mine, theirs in (("drafter", "candidate"), ("no_drafter", "no_drafter")):
        got, want = ours.contestants[mine], report.contestants[theirs]
        assert got.per_prompt == want.per_prompt
        assert got.tau_interval == want.tau_interval
        assert got.outputs_match_baseline == want.outputs_match_baseline == ours.prompts
    row = {r["contestant"]: r for r in ours.rows()}["drafter"]
    assert row["tau"] == round(report.contestants["candidate"].tau, 4)
    assert len(row["alpha"]) == SETTINGS["num_steps"]


def test_a_directory_without_weights_is_refused_by_name(world, tmp_path):
    storage, _, directory = world
    (tmp_path / "config.json").write_bytes((directory / "config.json").read_bytes())
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        measure_drafter(storage, 2, tmp_path, STEPS, CONFIG)


def test_the_cli_prints_tau_interval_and_alpha(world, monkeypatch, capsys):
    storage, _, directory = world
    monkeypatch.setenv("AERIE_STORAGE_URL", storage.root_url)
    torch.set_num_threads(1)
    args = ["eval", str(directory), "--window", "2", "--prompts", "4", "--max-new-tokens",
            "8", "--device", "cpu"]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "policy of RL step 2" in table and "steps 1..2" in table
    lines = {line.split()[0]: line for line in table.splitlines() if line}
    assert {"no_drafter", "drafter"} <= set(lines)
    assert main([*args, "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert measured["window"] == [1, 2] and set(measured["contestants"]) == {
        "no_drafter", "drafter"}
    rows = {r["contestant"]: r for r in measured["rows"]}
    assert rows["no_drafter"]["tau"] == 1.0 and rows["drafter"]["tau"] >= 1.0
    assert rows["drafter"]["matches_greedy"] == f"{measured['prompts']}/{measured['prompts']}"
    with pytest.raises(SystemExit):
        main(["eval", "--window", "0"])
    assert "must be at least 1" in capsys.readouterr().err
    assert main(["eval", str(directory), "--step", "9"]) == 1
    assert "no step in 9..9" in capsys.readouterr().err


def test_the_cli_measures_what_serves_now_at_its_settings(world, monkeypatch, capsys,
                                                          tmp_path):
    from pipeline.eagle3.spec import SpecParams
    from pipeline.release.ledger import ServingLedger
    from pipeline.serving_now import ServingTarget

    storage, prefix, _ = world
    monkeypatch.setenv("AERIE_STORAGE_URL", storage.root_url)
    monkeypatch.setenv("AERIE_HOME", str(tmp_path / "home"))
    torch.set_num_threads(1)
    args = ["eval", "--serving-name", "eval-test", "--window", "2", "--prompts", "4",
            "--max-new-tokens", "8", "--device", "cpu", "--json"]
    assert main(args) == 2
    assert "serving eval-test: nothing was ever published" in capsys.readouterr().err
    served = SpecParams(2, 1, 3)
    ServingLedger(storage, "eval-test").publish(
        ServingTarget(prefix, "fp-1", "eval-test", "1"), served, mode="manifest",
        reason="test")
    assert main(args) == 0
    measured = json.loads(capsys.readouterr().out)
    assert measured["settings"]["num_steps"] == 2
    assert measured["settings"]["num_draft_tokens"] == 3
    drafter = measured["contestants"]["drafter"]
    assert (drafter["uri"], drafter["fingerprint"]) == (prefix, "fp-1")
    assert main(["eval", "--serving", str(tmp_path)]) == 2  # a directory and --serving
    assert "not both" in capsys.readouterr().err
