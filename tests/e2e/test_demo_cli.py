"""``aerie demo`` end to end on a small demo world, then the day-to-day commands on its state:
the trainer writes a step, the sensors' ticks ingest it and refresh every step, each run is
created as the daemon would create it; ``aerie status``, ``promote`` and ``rollback`` read
and change what serves."""

from __future__ import annotations

import json

import pytest
from dagster import AssetKey, DagsterInstance, RunsFilter

from aerie import cli
from aerie.launch import LOCATION, REPOSITORY
from pipeline.demo.config import DemoConfig
from pipeline.evaluation.stage import read_report
from pipeline.serving_now import read_serving
from pipeline.snapshot.stage import completed_steps, read_accepted
from pipeline.storage import Storage
from resources.refresh import RefreshPolicyResource
from tests.e2e.loop import TRAIN

pytestmark = pytest.mark.e2e

WORLD = DemoConfig.small(num_steps=6)
POLICY = RefreshPolicyResource(every=2, window=2)  # a window of 6 prompts holds one out
# TRAIN: a small world needs more epochs than the demo family's preset to learn anything
REFRESHES = ["step-000001", "step-000003", "step-000005"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    home = tmp_path_factory.mktemp("demo") / "home"
    with pytest.MonkeyPatch.context() as mp:
        for var in ("AERIE_STORAGE_URL", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID",
                    "AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI",
                    "AERIE_CACHE_DIR"):
            mp.delenv(var, raising=False)
        mp.setenv("AERIE_HOME", str(home))
        mp.setenv("DAGSTER_HOME", str(home / "dagster"))
        cli.prepare_dagster_home()
        report, outcomes = cli.run_demo(WORLD, POLICY, progress=False, refresh_config=TRAIN)
        yield home, report, outcomes


def test_every_step_is_ingested_and_refreshed_as_it_lands(demo):
    home, report, outcomes = demo
    assert len(report["steps"]) == 6
    assert (home / "dagster" / "dagster.yaml").exists()  # all state in one directory
    storage = Storage((home / "storage").as_uri())
    assert completed_steps(storage) == list(range(6))
    per_step = WORLD.prompts_per_step * WORLD.samples_per_prompt
    for step in range(6):
        table = read_accepted(storage, step)
        assert table.num_rows == per_step  # the demo trainer writes only valid records
        assert set(table.column("trainer_step").to_pylist()) == {step}
    instance = DagsterInstance.get()
    assert instance.get_dynamic_partitions("refresh_steps") == REFRESHES
    assert [o.partition for o in outcomes] == REFRESHES
    assert [o.version for o in outcomes] == ["1", "2", "3"]
    for o in outcomes:
        report = read_report(storage, int(o.partition[-6:]))
        assert all(c.outputs_match_baseline == report.heldout["prompts"]
                   for c in report.contestants.values())  # lossless on the demo policy
        assert o.reasons  # a decision says why
        if o.action == "promoted":  # only a drafter that beats what serves
            assert o.candidate_tau > (o.champion_tau or o.no_drafter_tau), o
        else:
            assert o.action == "refused", o
    assert outcomes[0].action == "promoted"  # nothing served yet: a drafter that drafts wins
    assert (home / "mlflow" / "mlflow.db").exists()  # the registry lives in the home


def test_the_bad_refresh_is_refused(demo):
    _, _, outcomes = demo
    assert cli.bad_refresh_step(WORLD.num_steps, POLICY.every) == 3
    bad = outcomes[1]
    assert bad.action == "refused"
    assert bad.candidate_tau <= (bad.champion_tau or bad.no_drafter_tau)


def test_runs_are_created_as_the_daemon_creates_them(demo):
    """Each run carries the code location's origin and the sensor that asked for it; the job
    page's query (job name and repository label) finds every one."""
    instance = DagsterInstance.get()
    label = {".dagster/repository": f"{REPOSITORY}@{LOCATION}"}
    for job, count, sensor in (("ingest_step", 6, "snapshot_sensor"),
                               ("drafter_refresh", 3, "refresh_sensor")):
        runs = instance.get_runs(RunsFilter(job_name=job, tags=label))
        assert len(runs) == count == len(instance.get_runs(RunsFilter(job_name=job))), job
        for run in runs:
            assert run.remote_job_origin.location_name == LOCATION
            assert run.tags["dagster/sensor_name"] == sensor
            assert run.job_code_origin is not None


def test_every_tick_is_in_the_sensors_tick_history(demo):
    """The Automation page of each sensor lists its ticks: one per RL step, the ones that
    launched runs naming them."""
    from aerie.launch import tick_ids

    instance = DagsterInstance.get()
    for sensor, job, launching in (("snapshot_sensor", "ingest_step", 6),
                                   ("refresh_sensor", "drafter_refresh", 3)):
        ticks = instance.get_ticks(*tick_ids(instance, sensor))
        assert len(ticks) >= 6, sensor  # a tick after every step (a second demo adds more)
        ran = [run_id for t in ticks for run_id in t.run_ids]
        assert sorted(ran) == sorted(r.run_id for r in instance.get_runs(
            RunsFilter(job_name=job)))
        assert len([t for t in ticks if t.run_ids]) == launching


def test_refreshes_train_with_the_demo_familys_preset(demo):
    """The sensor's requests carry the job's default run config (what the Launchpad shows);
    the test's TRAIN and the bad refresh's settings are merged over it."""
    from jobs.drafter import DEFAULT_RUN_CONFIG
    from jobs.refresh import refresh_request

    preset = {"lr": 1e-3, "epochs": 3, "micro_batch_size": 8}
    assert DEFAULT_RUN_CONFIG == {"ops": {"drafter_checkpoint": {"config": preset}}}
    assert refresh_request(3, 2).run_config["ops"] == {
        "drafter_checkpoint": {"config": preset}, "vocab_mapping": {"config": {
            "window": 2, "draft_vocab_size": 32000, "min_coverage": 0.9}}}
    specs = {p.parent.name.split("-")[0]: json.loads(p.read_text())["config"]
             for p in (demo[0] / "training").glob("step=*/spec.json")}
    assert sorted(specs) == ["step=000001", "step=000003", "step=000005"]
    for step, config in specs.items():
        expected = {"lr": 3e-3, "epochs": 15, "micro_batch_size": 8}  # TRAIN over the preset
        if step == "step=000003":  # the bad one: two steps from scratch
            expected = {"max_steps": 2}
        assert {k: config[k] for k in expected} == expected, step


def test_status_promote_and_rollback(demo, capfd):
    storage = Storage((demo[0] / "storage").as_uri())
    champion = read_serving(storage, "aerie-drafter-demo").target
    assert cli.main(["status"]) == 0
    out = capfd.readouterr().out
    assert f"serving now:  v{champion.registry_version} ({champion.fingerprint[:8]})" in out
    assert "last refresh: step-000005: run" in out
    assert "observed:     " in out  # the serving drafter as the RL engine reports it
    other = next(o.version for o in demo[2] if o.version != champion.registry_version)
    assert cli.main(["promote", other, "--actor", "ci", "--reason", "test"]) == 0
    assert read_serving(storage, "aerie-drafter-demo").target.registry_version == other
    printed = capfd.readouterr()
    assert f"serving now:  v{other} (" in printed.out
    # quiet by default: the run's result, not Dagster's event log or alembic's migrations
    assert "STEP_START" not in printed.err + printed.out and "alembic" not in printed.err
    assert len((printed.out + printed.err).splitlines()) < 15
    assert cli.main(["rollback", "--actor", "ci"]) == 0
    assert read_serving(storage, "aerie-drafter-demo").target.registry_version == \
        champion.registry_version
    events = DagsterInstance.get().fetch_materializations(AssetKey("serving_drafter"),
                                                          limit=2).records
    actions = [e.asset_materialization.metadata["action"].value for e in events]
    assert actions == ["rolled_back", "forced"]  # both recorded, newest first


def test_eval_measures_the_serving_drafter_on_the_demo_state(demo, capfd):
    storage = Storage((demo[0] / "storage").as_uri())
    served = read_serving(storage, "aerie-drafter-demo")
    assert cli.main(["eval", "--serving", "--window", str(WORLD.num_steps), "--prompts", "4",
                     "--max-new-tokens", "16", "--device", "cpu", "--json"]) == 0
    measured = json.loads(capfd.readouterr().out)
    assert measured["step"] == WORLD.num_steps - 1 and measured["prompts"] >= 1
    assert measured["settings"]["num_steps"] == served.settings.num_steps
    drafter = measured["contestants"]["drafter"]
    assert (drafter["uri"], drafter["fingerprint"]) == (served.target.drafter_uri,
                                                        served.target.fingerprint)
    assert drafter["outputs_match_baseline"] == measured["lossless_prompts"]
    assert cli.main(["eval", "--serving", "--window", str(WORLD.num_steps), "--prompts", "4",
                     "--max-new-tokens", "16", "--device", "cpu"]) == 0
    table = capfd.readouterr().out
    assert "drafter" in table and "interval" in table and "α per position" in table


def test_a_second_demo_reuses_the_world_and_runs_nothing(demo):
    instance = DagsterInstance.get()
    before = len(instance.get_runs())
    report, outcomes = cli.run_demo(WORLD, POLICY, progress=False, refresh_config=TRAIN)
    assert report == demo[1] and [o.partition for o in outcomes] == REFRESHES
    assert len(instance.get_runs()) == before


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("aerie 0.")
