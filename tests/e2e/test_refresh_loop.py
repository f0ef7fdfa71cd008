"""The refresh loop, unattended (tests/e2e/loop.py): three refreshes driven by the sensors,
each gate outcome fixed by the setup. The tests read what the loop left behind and never
change it (the damaged-shard test works on a copy of its storage).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
from pathlib import Path

import pytest
import requests
from dagster import (
    AssetCheckKey,
    AssetCheckSeverity,
    AssetKey,
    RunsFilter,
    instance_for_test,
    materialize,
)

from aerie.demo import DEMO_INGEST_CONFIG, asset_events
from aerie.launch import LOCATION
from assets.groups import DATA_ASSETS, REFRESH_ASSETS
from assets.partitions import DECISION_TAG
from pipeline.capture.window import WindowError
from pipeline.evaluation.stage import read_report, tau_history
from pipeline.layout import chart_key
from pipeline.serving_now import read_serving
from pipeline.storage import Storage
from pipeline.training import stage as training_stage
from pipeline.training.config import TrainConfig
from resources.mlflow import TRAINING_VIEW, mlflow_from_environment
from tests.conftest import free_port, local_server, ver
from tests.e2e.loop import REFRESHES, Loop

pytestmark = pytest.mark.e2e


def _meta(loop: Loop, asset: str, partition: str) -> dict:
    """The metadata of the newest event (materialization or observation) of ``asset`` on
    ``partition``."""
    events = asset_events(loop.instance, asset, partition)
    assert events, f"no event of {asset} for {partition}"
    return events[0][1]


def test_sensor_ticks_drive_exactly_three_refreshes(loop):
    assert loop.refreshed == REFRESHES
    assert loop.sensor_ticks == ["skip", "run"] * 3
    # the refresh assets have a partition per refresh, none missing in between
    assert loop.instance.get_dynamic_partitions("refresh_steps") == REFRESHES
    # the partitions view: what serves changed at the first refresh only; the two refused
    # refreshes are observed decisions, their partitions not materialized
    assert loop.instance.get_materialized_partitions(AssetKey("serving_drafter")) == {
        REFRESHES[0]}
    observed = loop.instance.fetch_observations(AssetKey("serving_drafter"), limit=9).records
    assert sorted(r.partition_key for r in observed) == REFRESHES[1:]
    assert len(loop.instance.get_dynamic_partitions("rl_steps")) == 6


def _versions(loop: Loop) -> list[str]:
    return [_meta(loop, "registered_drafter", p)["version"] for p in loop.refreshed]


def test_every_cycle_registers_a_version(loop):
    assert _versions(loop) == ["1", "2", "3"]
    for partition in loop.refreshed:  # the K=2 window ending at the refresh step
        step = int(partition.rsplit("-", 1)[1])
        for asset in ("vocab_mapping", "drafter_checkpoint", "acceptance_eval",
                      "registered_drafter"):
            assert _meta(loop, asset, partition)["window_steps"] == [step - 1, step], asset


def test_the_gate_decides_every_cycle_as_set_up(loop):
    first, second, worse = (_meta(loop, "serving_drafter", p) for p in loop.refreshed)
    for d in (first, second, worse):  # the gate promotes iff the measured gain is enough
        decision = d["decision"]
        gain_ok = decision["candidate_tau"] >= decision["baseline_tau"] * (
            1 + decision["policy"]["min_relative_gain"])
        lo, _ = decision["gain_interval"]  # beyond the noise, too
        assert d["promoted"] is (gain_ok and lo > 0), d["reasons"]
    assert (first["action"], first["decision"]["baseline"]) == ("promoted", "no-drafter")
    assert (ver(first["champion"]), ver(first["previous_champion"])) == ("1", "none")
    assert (second["action"], second["decision"]["baseline"]) == ("refused", "champion")
    assert second["decision"]["champion_version"] == "1"
    assert "at least 1000.00% required" in second["reasons"]
    assert (worse["action"], worse["decision"]["baseline"]) == ("refused", "champion")
    assert worse["decision"]["candidate_tau"] < worse["decision"]["baseline_tau"]
    assert ver(second["champion"]) == ver(worse["champion"]) == "1"  # serving left as it was
    champion = mlflow_from_environment().champion()
    assert champion is not None and champion.version == "1"
    decided = {r.tags["dagster/partition"]: r.tags.get(DECISION_TAG)
               for r in loop.instance.get_runs(RunsFilter(job_name="drafter_refresh"))}
    assert decided == dict(zip(REFRESHES, ["promoted", "refused", "refused"], strict=True))
    assert second["reasons"].startswith("- gain:")  # the deciding reason first
    serving = read_serving(loop.storage, champion.model)
    assert serving.target is not None and serving.target.registry_version == "1"


def test_a_refresh_warm_starts_from_the_drafter_serving_before_it(loop):
    first, second = (_meta(loop, "drafter_checkpoint", p) for p in loop.refreshed[:2])
    assert first["warm_start_source"] == "none"  # nothing served yet
    assert second["warm_start"] == "warm"  # cycle 1 was promoted (asserted above)
    assert "drafters/step=000001#" in second["warm_start_source"]


def test_the_worse_cycle_was_really_worse_and_still_lossless(loop):
    report = read_report(loop.storage, 5)
    cand, champ = report.contestants["candidate"], report.contestants["champion"]
    assert cand.tau < champ.tau
    # measured where the rollouts were generated: the demo's RL samples at temperature 1
    assert report.regime == "T=1" and "step 5" in report.sampler_source
    assert report.checked_prompts >= 1
    assert all(c.outputs_match_baseline == report.checked_prompts
               and c.outputs_match_reference == report.reference["prompts"]
               for c in report.contestants.values())


def _evaluations(loop: Loop, asset: str, check: str) -> list:
    """The check's evaluations, oldest first, each with the partition of its run."""
    history = loop.instance.event_log_storage.get_asset_check_execution_history(
        AssetCheckKey(AssetKey(asset), check), limit=50)
    return [(loop.instance.get_run_by_id(h.run_id).tags.get("dagster/partition"), h.evaluation)
            for h in reversed(history) if h.evaluation is not None]


def test_checks_ran_on_every_stage_of_every_cycle(loop):
    expected = {("hidden_state_shards", "shard_integrity"), ("vocab_mapping", "vocab_coverage"),
                ("drafter_checkpoint", "training_loss"),
                ("acceptance_eval", "acceptance_lossless")}
    for asset, check in expected:
        evaluations = [e for _, e in _evaluations(loop, asset, check)]
        assert evaluations, (asset, check)
        if check != "training_loss":  # the one-step worse cycle may not fall: a warning
            assert all(e.passed for e in evaluations), (asset, check)


def test_a_promotion_never_verified_leaves_its_check_not_evaluated(loop):
    """The loop's rollouts carry no speculative counters, so v1 is never judged: its
    ``promotion_verified`` was planned in every refresh and never evaluated (not green)."""
    history = loop.instance.event_log_storage.get_asset_check_execution_history(
        AssetCheckKey(AssetKey("serving_drafter"), "promotion_verified"), limit=50)
    assert len(history) == len(REFRESHES)
    assert {h.status.value for h in history} == {"PLANNED"}  # no result ever came
    assert all(loop.instance.get_run_by_id(h.run_id).is_success for h in history)  # so
    # the UI shows it skipped: planned, in a run that finished without it


def test_the_staleness_check_follows_the_serving_drafter(loop):
    """Champion v1 (window 0..1) serves through all three refreshes: 0, 2, then 4 RL steps
    behind; its τ at promotion and as the champion of each later report."""
    partitions, evaluations = zip(*_evaluations(loop, "serving_drafter", "serving_staleness"),
                                  strict=True)
    assert list(partitions) == REFRESHES
    metas = [{k: v.value for k, v in e.metadata.items()} for e in evaluations]
    assert [m["steps_behind"] for m in metas] == [0, 2, 4]
    assert [m["last_tau_step"] for m in metas] == [1, 3, 5]
    reports = [read_report(loop.storage, s) for s in (1, 3, 5)]
    assert metas[0]["tau_at_promotion"] == metas[0]["last_tau"] == reports[0].contestants[
        "candidate"].tau
    assert metas[2]["last_tau"] == reports[2].contestants["champion"].tau
    for e, m in zip(evaluations, metas, strict=True):
        assert e.severity == AssetCheckSeverity.WARN
        assert e.passed is (m["steps_behind"] <= 8 and m.get("tau_drop", 0) <= 0.10)


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", data[16:24])


def test_metadata_links_stored_charts_and_the_event_log_stays_small(loop):
    evaluation = _meta(loop, "acceptance_eval", "step-000005")
    # the τ chart of the last refresh draws a point per refresh
    history = tau_history(loop.storage)
    assert sorted(history["candidate"]) == [1, 3, 5] and sorted(history["champion"]) == [3, 5]
    registry = mlflow_from_environment()
    candidate = registry.find_version(read_report(loop.storage, 5).contestants[
        "candidate"].fingerprint)
    ui = os.environ["AERIE_MLFLOW_UI_URL"]  # the session's (tests/conftest.py)
    run_page = f"{ui}/#/experiments/{registry.runs.experiment_id()}/runs/"
    for chart, name, logged in (("acceptance_per_position", "alpha", "acceptance_per_position"),
                                ("tau_over_rl_steps", "tau", "offline_tau_over_rl_steps")):
        assert evaluation[chart] == (f"{run_page}{candidate.run_id}/artifactPath/charts/"
                                     f"{logged}.png?{TRAINING_VIEW}")  # its training run
        assert f"charts/{logged}.png" in registry.runs.charts(candidate.run_id)
        assert _png_size(loop.storage.local_path(chart_key(5, name))) == (600, 320)  # stored
    curve = _meta(loop, "drafter_checkpoint", "step-000003")["training_curve"]
    assert curve.startswith(run_page) and curve.endswith(
        f"/artifactPath/charts/training_curve.png?{TRAINING_VIEW}")
    assert _png_size(loop.storage.local_path(chart_key(3, "training_curve")))[0] == 600
    loop_chart = _meta(loop, "serving_drafter", "step-000005")["loop_chart"]
    assert loop_chart == (f"{run_page}{candidate.run_id}/artifactPath/charts/"
                          f"tau_over_rl_steps.png?{TRAINING_VIEW}")
    sizes = {}
    for asset in (*DATA_ASSETS, *REFRESH_ASSETS):
        records = loop.instance.fetch_materializations(AssetKey(asset), limit=100).records
        assert records, asset
        for r in records:
            text = json.dumps({k: str(v.value)
                               for k, v in r.asset_materialization.metadata.items()})
            assert "base64" not in text and "data:image" not in text, asset
            sizes[asset] = max(len(text), sizes.get(asset, 0))
    assert max(sizes.values()) < 12_000, sizes  # numbers, tables and links: no images


def test_metadata_has_stage_counts(loop):
    shards = _meta(loop, "hidden_state_shards", "step-000005")
    assert shards["samples"] > 0 and shards["tokens"] > 0 and shards["seconds"] > 0
    summary = _meta(loop, "serving_drafter", "step-000005")["refresh_summary"].splitlines()
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]]
            for r in summary[2:]}
    assert list(rows) == ["rollout_snapshot", "tokenized_rollouts", "hidden_state_shards",
                          "vocab_mapping", "drafter_checkpoint", "acceptance_eval",
                          "registered_drafter"]
    assert rows["hidden_state_shards"][:3] == ["4–5", str(sum(
        _meta(loop, "hidden_state_shards", f"step-00000{s}")["samples"] for s in (4, 5))),
        str(sum(_meta(loop, "hidden_state_shards", f"step-00000{s}")["tokens"]
                for s in (4, 5)))]
    assert all(float(r[-1]) > 0 for r in rows.values())  # wall time of every stage


@pytest.fixture
def storage_copy(loop, tmp_path) -> Storage:
    """A private copy of the loop's storage, for tests that damage data."""
    shutil.copytree(loop.home / "storage", tmp_path / "storage")
    return Storage((tmp_path / "storage").as_uri())


def test_a_damaged_shard_is_refused_by_training_and_repaired_by_a_rerun(storage_copy,
                                                                        tmp_path):
    from assets.shards import hidden_state_shards
    from assets.snapshots import rollout_snapshot
    from assets.tokenized import tokenized_rollouts
    from resources.capture import CaptureResource
    from resources.storage import StorageResource

    shard = sorted(storage_copy.local_path("shards/step=000005").glob("*.parquet"))[0]
    good = shard.read_bytes()
    shard.write_bytes(good[:100] + bytes([good[100] ^ 1]) + good[101:])
    with pytest.raises(WindowError, match=shard.name):  # no refresh trains on it
        training_stage.run(storage_copy, 5, TrainConfig(max_steps=1), work_root=tmp_path / "t")
    with instance_for_test() as instance:
        instance.add_dynamic_partitions("rl_steps", ["step-000005"])
        rerun = materialize(  # what re-running the step's ingest_step does
            [rollout_snapshot, tokenized_rollouts, hidden_state_shards], instance=instance,
            partition_key="step-000005", run_config=DEMO_INGEST_CONFIG,
            resources={"storage": StorageResource(url=storage_copy.root_url),
                       "capture": CaptureResource()})
    meta = {e.asset_key.path[0]: e.materialization.metadata
            for e in rerun.get_asset_materialization_events()}
    assert set(meta) == set(DATA_ASSETS)  # the earlier stages re-validated too
    (evaluation,) = [e for e in rerun.get_asset_check_evaluations()
                     if e.check_name == "shard_integrity"]
    assert evaluation.passed
    shards = meta["hidden_state_shards"]
    assert shards["shards_reused"].value == shards["shards"].value - 1  # only the damaged one
    assert shard.read_bytes() == good


# --- The UI: dagster-webserver on the loop's instance, driven by headless Chromium ----------

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
GROUPS = {"data": ("rollout_snapshot", "tokenized_rollouts", "hidden_state_shards"),
          "drafter": ("vocab_mapping", "drafter_checkpoint", "acceptance_eval"),
          "release": ("registered_drafter", "serving_drafter", "storage_retention")}


@pytest.fixture(scope="module")
def webserver(loop, tmp_path_factory):
    """``dagster-webserver`` on 127.0.0.1 over the loop's instance; stopped by PID. Dagster's
    first-visit community dialog is marked seen, as closing it does (GraphQL ``setNuxSeen``):
    it opens a second after a page loads and would take the clicks meant for the page."""
    port = free_port()
    exe = Path(sys.executable).with_name("dagster-webserver")
    with local_server([str(exe), "-h", "127.0.0.1", "-p", str(port), "-w", "workspace.yaml"],
                      tmp_path_factory.mktemp("web") / "webserver.log", [port], timeout=180,
                      group=True, cwd=Path(__file__).parents[2], env=os.environ):
        url = f"http://127.0.0.1:{port}"
        seen = requests.post(f"{url}/graphql", json={"query": "mutation { setNuxSeen }"},
                             timeout=30)
        assert seen.ok and "errors" not in seen.json(), seen.text
        yield url


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        message = "Debian chromium + chromium-driver not installed (apt-get install chromium " \
                  "chromium-driver)"
        if os.environ.get("AERIE_REQUIRE_BROWSER"):
            pytest.fail(message)  # CI installs them: a missing browser is a failure there
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--window-size=1600,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _wait_text(driver, text: str, timeout: float = 120):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(ec.presence_of_element_located(
        (By.XPATH, f"//*[normalize-space()={json.dumps(text)}]")))


@pytest.fixture
def looked_at(browser, tmp_path_factory, request):
    """The browser; if the test fails, a screenshot of the page it was on is saved (path in
    the failure report and under $AERIE_UI_SCREENSHOTS when set)."""
    yield browser
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        folder = Path(os.environ.get("AERIE_UI_SCREENSHOTS") or tmp_path_factory.mktemp("ui"))
        folder.mkdir(parents=True, exist_ok=True)
        shot = folder / f"{request.node.name}.png"
        browser.save_screenshot(str(shot))
        report.sections.append(("screenshot", f"{shot} ({browser.current_url})"))


def test_ui_job_pages_list_the_runs(loop, webserver, looked_at):
    """Runs created by the sensors' ticks are listed on their job pages (the code location's
    runs), each refresh run by its id."""
    for job in ("ingest_step", "drafter_refresh"):
        runs = loop.instance.get_runs(RunsFilter(job_name=job))
        assert len(runs) == (6 if job == "ingest_step" else 3)
        looked_at.get(f"{webserver}/locations/{LOCATION}/jobs/{job}/runs")
        for run in runs:
            _wait_text(looked_at, run.run_id[:8])


def test_ui_runs_page_marks_the_refused_refreshes(loop, webserver, looked_at, tmp_path):
    looked_at.get(f"{webserver}/locations/{LOCATION}/jobs/drafter_refresh/runs")
    tag = "//*[contains(normalize-space(.), '{}') and not(*[contains(normalize-space(.), '{}')])]"
    for decision, count in (("refused", 2), ("promoted", 1)):
        text = f"{DECISION_TAG}: {decision}"
        _wait_xpath(looked_at, tag.format(text, text))
        assert len(looked_at.find_elements("xpath", tag.format(text, text))) == count
    _save(looked_at, tmp_path, "runs_decisions.png")


def test_ui_partitions_view_marks_the_refused_refreshes(loop, webserver, looked_at, tmp_path):
    """The partitions view of ``serving_drafter`` shows the promoting refresh materialized and
    the two refused ones not (what serves did not change); a refused partition's events hold
    its decision, and the asset's page leads with the champion's promotion."""
    looked_at.get(f"{webserver}/assets/serving_drafter?view=partitions")
    _wait_text(looked_at, "Materialized (1)")
    _wait_text(looked_at, "Missing (2)")
    _save(looked_at, tmp_path, "partitions_view.png")
    looked_at.get(f"{webserver}/assets/serving_drafter?view=events&partition={REFRESHES[-1]}")
    _wait_text(looked_at, "refused")  # the third refresh, built to be worse
    _wait_xpath(looked_at, "//*[contains(text(), 'is worse than champion v1')]")  # its reason
    _save(looked_at, tmp_path, "partition_events_refused.png")
    looked_at.get(f"{webserver}/assets/serving_drafter")
    _wait_text(looked_at, "action")
    _wait_text(looked_at, "promoted")  # the newest materialization: the champion's


def test_ui_shows_promotion_verified_not_evaluated(loop, webserver, looked_at, tmp_path):
    """v1 was never judged (no speculative counters in the loop's rollouts): the checks tab
    shows ``promotion_verified`` skipped, not passed, beside the evaluated staleness check."""
    looked_at.get(f"{webserver}/assets/serving_drafter?view=checks")
    # the list entry of one check: holds its name and a status, not the other check's name
    entry = ("//*[.//*[normalize-space()='{0}'] and .//*[normalize-space()='{1}'] and "
             "not(.//*[normalize-space()='{2}'])]")
    _wait_xpath(looked_at, entry.format("promotion_verified", "Skipped", "serving_staleness"))
    _wait_xpath(looked_at, entry.format("serving_staleness", "Succeeded", "promotion_verified"))
    assert not looked_at.find_elements("xpath", entry.format(
        "promotion_verified", "Succeeded", "serving_staleness"))
    _save(looked_at, tmp_path, "checks_not_evaluated.png")


def test_ui_shows_the_asset_graph(loop, webserver, browser, tmp_path):
    for group, assets in GROUPS.items():
        browser.get(f"{webserver}/locations/{LOCATION}/asset-groups/{group}")
        for name in assets:
            _wait_text(browser, name)  # a node of the group's lineage graph
        if group == "drafter":
            _wait_text(browser, "hidden_state_shards")  # the edges in and out of the group
            _wait_text(browser, "registered_drafter")
            shot = tmp_path / "asset_graph.png"
            assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000


@pytest.fixture(scope="module")
def mlflow_ui(loop, tmp_path_factory):
    """The MLflow UI over the loop's store, as ``aerie ui`` starts it; stopped by PID."""
    from aerie.cli import mlflow_ui_command

    command, url = mlflow_ui_command(Path(sys.executable).with_name("mlflow"))
    assert url == os.environ["AERIE_MLFLOW_UI_URL"]  # where the loop's links point
    port = int(url.rsplit(":", 1)[1])
    with local_server(command, tmp_path_factory.mktemp("mlflow") / "mlflow.log", [port],
                      timeout=180, group=True, env=os.environ):
        yield url


def test_ui_opens_a_chart_in_one_click(loop, webserver, mlflow_ui, browser, tmp_path):
    """The metadata panel links the charts (no inline images); one click on a link opens the
    PNG the MLflow UI serves from the candidate's training run: the 600 px chart."""
    from selenium.webdriver.common.by import By

    browser.get(f"{webserver}/assets/acceptance_eval?partition=step-000005")
    _wait_text(browser, "acceptance_per_position")
    _wait_text(browser, "window_steps")
    link = _wait_xpath(browser, f"//a[starts-with(@href, '{mlflow_ui}/#/experiments/') and "
                                "contains(@href, 'charts/acceptance_per_position.png')]")
    assert not [img for img in browser.find_elements(By.CSS_SELECTOR, "img")
                if (img.get_attribute("src") or "").startswith("data:")]
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", link)
    _save(browser, tmp_path, "acceptance_metadata.png")
    dagster_tab, before = browser.current_window_handle, set(browser.window_handles)
    link.click()  # Dagster opens URL metadata in a new tab
    (opened,) = [h for h in browser.window_handles if h not in before]
    browser.switch_to.window(opened)
    try:  # MLflow's run page in the model-training view, the chart previewed
        _wait_contains(browser, "charts/acceptance_per_position.png")
        assert _image_width(browser, 600) == 600
        _save(browser, tmp_path, "mlflow_chart.png")
    finally:
        browser.close()
        browser.switch_to.window(dagster_tab)


def test_ui_mlflow_opens_the_refresh_experiment_on_its_training_runs(loop, mlflow_ui,
                                                                     browser, tmp_path):
    """A fresh browser opening Aerie's link to the experiment lands on the model-training
    view: the runs of the three refreshes, not MLflow 3's GenAI traces overview."""
    from selenium.webdriver.support.ui import WebDriverWait

    from resources.mlflow import mlflow_resource_from_environment

    resource = mlflow_resource_from_environment()
    link = resource.experiment_link(resource.build().runs.experiment_id())
    assert link.startswith(mlflow_ui)
    browser.get(link)
    WebDriverWait(browser, 120).until(lambda d: d.title.startswith("Runs"))  # not Overview
    for partition in REFRESHES:
        _wait_contains(browser, f"drafter-{partition}")
    _save(browser, tmp_path, "mlflow_experiment.png")


def test_ui_mlflow_version_shows_a_few_tags(loop, mlflow_ui, browser, tmp_path):
    """The champion's version page: the headline tags, one lineage record and one tag per
    decision, not a field per row (35 rows before)."""
    from resources.mlflow import mlflow_resource_from_environment

    resource = mlflow_resource_from_environment()
    registry = resource.build()
    tags = registry.get_version("1").tags
    assert len(tags) <= 10, sorted(tags)
    browser.get(resource.version_link(registry.model_name, "1"))
    for name in ("fingerprint", "lineage", "gate.1", "gate.decision"):
        _wait_text(browser, name)  # a row of the tags table
    assert not browser.find_elements("xpath", "//*[normalize-space()='gate.1.actor']")
    _save(browser, tmp_path, "mlflow_version.png")


def test_ui_checkpoint_metadata_leads_with_the_numbers(loop, webserver, browser, tmp_path):
    """``drafter_checkpoint``: the algorithm and the rounded numbers first, the plumbing in
    one details table."""
    browser.get(f"{webserver}/assets/drafter_checkpoint?partition={REFRESHES[-1]}")
    for key in ("algorithm", "final_loss", "details"):
        _wait_text(browser, key)
    _save(browser, tmp_path, "checkpoint_metadata.png")


def _image_width(driver, width: int, timeout: float = 120) -> int:
    """``width`` once an image of that natural width has loaded on the page."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(lambda d: d.execute_script(
        "for (const i of document.images) { if (i.complete && i.naturalWidth === "
        "arguments[0]) return arguments[0]; } return 0;", width))


def _save(browser, tmp_path, name: str) -> None:
    """A screenshot of the page, kept under $AERIE_UI_SCREENSHOTS when set."""
    folder = Path(os.environ.get("AERIE_UI_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(folder / name)) and (folder / name).stat().st_size > 10_000


def _wait_xpath(driver, xpath: str, timeout: float = 120):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(ec.presence_of_element_located(
        (By.XPATH, xpath)))


def _wait_contains(driver, text: str, timeout: float = 120):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(ec.presence_of_element_located(
        (By.XPATH, f"//*[contains(text(), {json.dumps(text)})]")))
