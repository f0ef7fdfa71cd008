"""docs/deploy.md, run as written: every shell block labelled ``cpu`` runs, every ``cpu
service`` starts and answers, against a real PostgreSQL server, an S3 server (moto) and this
checkout. Only the example's hosts, ports and paths change: ``0.0.0.0`` → ``127.0.0.1``, the
services' ports → free ports, ``/etc/aerie`` and ``/srv/aerie`` → temporary directories, and
the environment file's values → the local servers'."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg2
import pytest
import requests

from tests.conftest import free_port, s3_options

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "deploy.md"
LABELS = ("cpu", "cpu service", "install", "gpu")


def blocks() -> list[tuple[str, str]]:
    """(label, body) of every ``sh`` block of the guide, in order."""
    found = []
    for body in re.findall(r"```sh\n(.*?)```", GUIDE.read_text(), re.S):
        first, _, rest = body.partition("\n")
        label = first.removeprefix("#").strip()
        found.append((label, rest))
    return found


def test_every_block_says_where_it_runs():
    labels = [label.split(" (")[0] for label, _ in blocks()]
    unknown = [label for label in labels
               if not (label in LABELS or label.startswith("cpu service "))]
    assert unknown == [] and labels.count("cpu") >= 5


class Deployment:
    """The local stand-ins for the guide's hosts, and the substitutions."""

    def __init__(self, tmp_path: Path, postgres, moto_endpoint: str):
        self.tmp = tmp_path
        self.etc, self.srv = tmp_path / "etc", tmp_path / "srv"
        self.etc.mkdir()
        self.ports = {"mlflow": free_port(), "dagster-webserver": free_port()}
        suffix = uuid.uuid4().hex[:8]
        self.user, self.password = f"deploy_{suffix}", f"pw-{uuid.uuid4().hex}"
        self.dagster_db, self.mlflow_db = f"dagster_{suffix}", f"mlflow_{suffix}"
        self.bucket = f"aerie-deploy-{suffix}"
        opts = s3_options(moto_endpoint)
        import s3fs

        s3fs.S3FileSystem(key=opts["key"], secret=opts["secret"],
                          endpoint_url=moto_endpoint).mkdir(self.bucket)
        mlflow_url = f"http://127.0.0.1:{self.ports['mlflow']}"
        self.values = {
            "AERIE_PG_HOST": "127.0.0.1", "AERIE_PG_PORT": str(postgres.port),
            "AERIE_PG_USER": self.user, "PGPASSWORD": self.password,
            "AERIE_DAGSTER_DB": self.dagster_db, "AERIE_MLFLOW_DB": self.mlflow_db,
            "AERIE_PROMOTION_LOCK_URL":
                f"postgresql://{self.user}@127.0.0.1:{postgres.port}/{self.mlflow_db}",
            "AERIE_STORAGE_URL": f"s3://{self.bucket}/aerie",
            "AWS_ACCESS_KEY_ID": opts["key"], "AWS_SECRET_ACCESS_KEY": opts["secret"],
            "AWS_ENDPOINT_URL": moto_endpoint, "MLFLOW_S3_ENDPOINT_URL": moto_endpoint,
            "MLFLOW_TRACKING_URI": mlflow_url, "AERIE_MLFLOW_UI_URL": mlflow_url,
            "AERIE_MLFLOW_ARTIFACTS": f"s3://{self.bucket}/mlflow",
            "AERIE_MLFLOW_ALLOWED_HOSTS": f"127.0.0.1:{self.ports['mlflow']},127.0.0.1",
            "AERIE_DAGSTER_UI_URL": f"http://127.0.0.1:{self.ports['dagster-webserver']}",
        }
        self.admin_url = postgres.url("postgres")
        self.services: list[subprocess.Popen] = []

    def localize(self, text: str) -> str:
        text = text.replace("/etc/aerie", str(self.etc)).replace("/srv/aerie", str(self.srv))
        text = text.replace("0.0.0.0", "127.0.0.1")
        text = re.sub(r"--port 5000\b", f"--port {self.ports['mlflow']}", text)
        return re.sub(r"-p 3000\b", f"-p {self.ports['dagster-webserver']}", text)

    def write_env_file(self) -> None:
        """``deploy/aerie.env.example``, filled in with the local values."""
        lines, written = [], set()
        for line in (ROOT / "deploy" / "aerie.env.example").read_text().splitlines():
            key = line.removeprefix("# ").split("=", 1)[0]  # commented-out settings too
            if "=" in line and key in self.values:
                line = f"{key}={self.values[key]}"
                written.add(key)
            lines.append(self.localize(line))
        assert written == set(self.values), set(self.values) - written  # all in the example
        (self.etc / "aerie.env").write_text("\n".join(lines) + "\n")

    def environment(self) -> dict[str, str]:
        clean = {k: v for k, v in os.environ.items()
                 if not k.startswith(("AERIE_", "MLFLOW_", "AWS_", "DAGSTER_", "PG"))}
        bin_dir = str(Path(sys.executable).parent)
        return {**clean, "PATH": f"{bin_dir}:{clean.get('PATH', '')}",
                "AERIE_PG_ADMIN_URL": self.admin_url, "MLFLOW_DISABLE_TELEMETRY": "true"}

    def script(self, prelude: str, body: str) -> list[str]:
        return ["bash", "-euo", "pipefail", "-c", self.localize(f"{prelude}\n{body}")]

    def run(self, prelude: str, body: str) -> subprocess.CompletedProcess:
        done = subprocess.run(self.script(prelude, body), cwd=ROOT, env=self.environment(),
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{body}\n--- stdout\n{done.stdout}\n--- stderr\n" \
                                     f"{done.stderr}"
        return done

    def start(self, name: str, prelude: str, body: str) -> None:
        log = open(self.tmp / f"{name}.log", "wb")
        proc = subprocess.Popen(self.script(prelude, f"exec {body.strip()}"), cwd=ROOT,
                                env=self.environment(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.services.append(proc)
        ready = {"mlflow": self._http_ready(f"{self.values['MLFLOW_TRACKING_URI']}/health"),
                 "dagster-webserver": self._http_ready(
                     f"{self.values['AERIE_DAGSTER_UI_URL']}/server_info"),
                 "dagster-daemon": self._daemon_ready}[name]
        deadline = time.monotonic() + 180
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{name} did not come up:\n"
                                     f"{(self.tmp / f'{name}.log').read_text()[-3000:]}")
            time.sleep(0.25)

    @staticmethod
    def _http_ready(url: str):
        def ready() -> bool:
            try:
                return requests.get(url, timeout=2).status_code == 200
            except requests.RequestException:
                return False
        return ready

    def _daemon_ready(self) -> bool:
        """The daemon wrote heartbeats into the Dagster database."""
        try:
            conn = psycopg2.connect(host="127.0.0.1", port=self.values["AERIE_PG_PORT"],
                                    user=self.user, password=self.password,
                                    dbname=self.dagster_db)
        except psycopg2.OperationalError:
            return False
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT count(*) FROM daemon_heartbeats")
                return cur.fetchone()[0] > 0
        except psycopg2.Error:
            return False
        finally:
            conn.close()

    def stop(self) -> None:
        for proc in reversed(self.services):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)
            except ProcessLookupError:
                pass


@pytest.mark.e2e
def test_the_guide_runs_as_written(tmp_path, postgres, moto_endpoint):
    deployment = Deployment(tmp_path, postgres, moto_endpoint)
    deployment.write_env_file()
    prelude, outputs = "", []
    try:
        for label, body in blocks():
            if label == "cpu":
                outputs.append(deployment.run(prelude, body))
                if "aerie.env" in body:  # the environment every later command loads
                    prelude = body
            elif label.startswith("cpu service "):
                deployment.start(label.removeprefix("cpu service "), prelude, body)
    finally:
        deployment.stop()
    status = outputs[-1].stdout
    assert "no drafter" in status.lower() or "nothing" in status.lower(), status
    conn = psycopg2.connect(host="127.0.0.1", port=postgres.port, user=deployment.user,
                            password=deployment.password, dbname=deployment.mlflow_db)
    with conn.cursor() as cur:  # MLflow's store is the guide's database
        cur.execute("SELECT count(*) FROM alembic_version")
        assert cur.fetchone()[0] == 1
    conn.close()


def test_the_docker_run_launcher_passes_every_variable_of_the_environment_file():
    import yaml

    block = re.search(r"```yaml\n(# docker.*?)```", GUIDE.read_text(), re.S).group(1)
    launcher = yaml.safe_load(block)["run_launcher"]
    example = (ROOT / "deploy" / "aerie.env.example").read_text()
    variables = re.findall(r"^(?:# )?([A-Z][A-Z0-9_]+)=", example, re.M)
    assert launcher["class"] == "DockerRunLauncher"
    assert launcher["config"]["env_vars"] == variables


def test_the_deployed_instance_keeps_the_embedded_defaults_limits():
    """deploy/dagster.yaml sets the same concurrency limits as the embedded default's
    instance (one refresh at a time, one promotion step at a time)."""
    import yaml

    from aerie.cli import INSTANCE_YAML

    deployed = yaml.safe_load((ROOT / "deploy" / "dagster.yaml").read_text())
    assert deployed["concurrency"] == yaml.safe_load(INSTANCE_YAML)["concurrency"]
    assert deployed["storage"]["postgres"]["postgres_db"]["scheme"] == "postgresql+psycopg2"
