"""What ``aerie demo`` prints at the end, from the gate's outcomes: the refresh table (the
deciding reason of each), how each champion went stale, and which refresh is the bad one."""

from aerie import cli
from aerie.demo import RefreshOutcome
from aerie.status import refresh_table, staleness_lines
from pipeline.serving_now import drafter_name


def outcome(step: int, version: str, tau: float, champion: float | None, action: str,
            *reasons: str) -> RefreshOutcome:
    return RefreshOutcome(f"step-{step:06d}", [step - 3, step - 2, step - 1, step], version,
                          f"{version}f00dcafe1234", tau, champion, 1.0, action, version,
                          list(reasons))


OUTCOMES = [
    outcome(3, "1", 2.2, None, "promoted", "format: passed", "gain: beats no drafter"),
    outcome(7, "2", 2.4, 2.13, "promoted", "format: passed", "gain: beats v1"),
    outcome(11, "3", 1.1, 2.2, "refused", "gain: worse than v2"),
    outcome(15, "4", 2.9, 2.05, "promoted", "gain: beats v2"),
]


def test_the_table_has_a_row_and_the_deciding_reason_per_refresh():
    lines = refresh_table(OUTCOMES).splitlines()
    assert len(lines) == 2 + 2 * len(OUTCOMES)
    assert lines[2].split()[:5] == ["3", "0–3", "v1", "(1f00dcaf)", "2.20"]
    assert lines[3].strip() == "gain: beats no drafter"  # not the format check's line
    assert lines[6].split()[-1] == "refused" and lines[7].strip() == "gain: worse than v2"


def test_staleness_follows_each_champion_until_the_next_promotion():
    assert staleness_lines(OUTCOMES) == [
        "v1: τ 2.20 at promotion (steps 0–3), then 2.13 on steps 4–7",
        "v2: τ 2.40 at promotion (steps 4–7), then 2.20 on steps 8–11, 2.05 on steps 12–15"]


def test_the_bad_refresh_is_the_second_to_last_of_three_or_more():
    assert cli.bad_refresh_step(20, 4) == 15  # refreshes at 3, 7, 11, 15, 19
    assert cli.bad_refresh_step(6, 2) == 3  # 1, 3, 5
    assert cli.bad_refresh_step(20, 10) is None  # two refreshes: nothing to show it against


def test_a_note_marks_its_refresh():
    lines = refresh_table(OUTCOMES, {"step-000011": "(bad)"}).splitlines()
    assert lines[6].endswith("refused (bad)") and not lines[4].endswith("(bad)")


def test_one_way_of_naming_a_drafter():
    assert drafter_name("3", "0123456789abcdef") == "v3 (01234567)"
    assert drafter_name(None, None) == drafter_name("none", "") == "none"


def test_aerie_ui_starts_mlflow_where_the_links_point(monkeypatch, tmp_path):
    for var in ("MLFLOW_TRACKING_URI", "AERIE_MLFLOW_UI_URL", "AERIE_MLFLOW_ARTIFACT_LOCATION"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AERIE_HOME", str(tmp_path))
    command, url = cli.mlflow_ui_command(tmp_path / "mlflow")
    assert url == "http://127.0.0.1:5000" and command[8:10] == ["--workers", "1"]
    assert command[:4] == [str(tmp_path / "mlflow"), "server", "--backend-store-uri",
                           f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}"]
    assert command[4:8] == ["--host", "127.0.0.1", "--port", "5000"]
    monkeypatch.setenv("AERIE_MLFLOW_UI_URL", "http://127.0.0.1:5123")
    assert cli.mlflow_ui_command(tmp_path / "mlflow")[0][4:8] == [
        "--host", "127.0.0.1", "--port", "5123"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert cli.mlflow_ui_command(tmp_path / "mlflow") is None  # a server is its own UI


def test_a_chart_link_names_the_run_and_the_artifact_not_a_path():
    from resources.mlflow import MlflowResource

    resource = MlflowResource(ui_url="http://127.0.0.1:5123/")
    assert resource.artifact_link("7", "abc123", "charts/a b.png") == (
        "http://127.0.0.1:5123/#/experiments/7/runs/abc123/artifactPath/charts/a%20b.png"
        "?workflowType=machine_learning")  # MLflow 3's model-training view, not GenAI
