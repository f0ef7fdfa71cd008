"""The MLflow resource: turns configuration and environment into a :class:`DrafterRegistry`.

Embedded default (no configuration): sqlite tracking + registry at
``$AERIE_HOME/mlflow/mlflow.db``, artifacts under ``$AERIE_HOME/mlflow/artifacts``, the
promotion lock at ``$AERIE_HOME/mlflow/promotion-<model>.lock``. Several hosts: the
promotion lease in PostgreSQL (``AERIE_PROMOTION_LOCK_URL``, or a ``postgresql://``
tracking URI), see :mod:`pipeline.release.lease`. A server is one URL
(``tracking_uri="http://mlflow:5000"``); artifacts may go to ``s3://...`` with
``s3_endpoint_url`` for MinIO/moto.

Secrets never pass through this resource: MLflow reads ``MLFLOW_TRACKING_TOKEN``,
``MLFLOW_TRACKING_USERNAME``/``PASSWORD`` and ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``
from the environment itself. ``build`` sets ``MLFLOW_DISABLE_TELEMETRY=true`` unless the
environment already says otherwise, and exports ``s3_endpoint_url`` as
``MLFLOW_S3_ENDPOINT_URL`` (the only way MLflow's S3 artifact store takes an endpoint) and
the client's HTTP bounds as MLflow's own ``MLFLOW_HTTP_REQUEST_TIMEOUT`` and
``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` (read from them too). With MLflow's defaults (8
attempts of up to 120 s, backing off up to 256 s) a server that stops answering or resets
every connection held a registration past the fault campaign's 60 s bound
(tests/reliability/test_fault_campaign.py); with these (60 s, 3 retries) it fails named
within about 4 minutes, and is retried.
"""


import logging
import os
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from dagster import ConfigurableResource
from pydantic import Field

from pipeline.release.mlflow_registry import DrafterRegistry, model_name
from resources.env import resource_from_env
from resources.home import aerie_home

_ENV = {
    "tracking_uri": "MLFLOW_TRACKING_URI",
    "registry_uri": "MLFLOW_REGISTRY_URI",
    "artifact_location": "AERIE_MLFLOW_ARTIFACT_LOCATION",
    "s3_endpoint_url": "MLFLOW_S3_ENDPOINT_URL",
    "target_family": "AERIE_TARGET_FAMILY",
    "ui_url": "AERIE_MLFLOW_UI_URL",
    "dagster_ui_url": "AERIE_DAGSTER_UI_URL",
    "lock_url": "AERIE_PROMOTION_LOCK_URL",
    "lock_dir": "AERIE_PROMOTION_LOCK_DIR",
    "lock_timeout_s": "AERIE_PROMOTION_LOCK_TIMEOUT_S",
    "request_timeout_s": "MLFLOW_HTTP_REQUEST_TIMEOUT",
    "request_retries": "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
}
log = logging.getLogger(__name__)
# MLflow 3's UI opens every page in its GenAI view (traces, "Evaluation runs") unless the URL
# asks for the model-training one; its toggle remembers the choice only per browser
TRAINING_VIEW = "workflowType=machine_learning"
_SECRETS = ("tracking_uri", "registry_uri", "lock_url")  # database URLs may hold a password


def mlflow_home() -> Path:
    return aerie_home() / "mlflow"


class MlflowResource(ConfigurableResource):
    """Where drafters are tracked and registered (MLflow 3, aliases not stages)."""

    tracking_uri: str | None = Field(
        default=None, description="MLflow tracking URI (server URL or sqlite:///...); unset: "
                                  "sqlite at $AERIE_HOME/mlflow/mlflow.db")
    registry_uri: str | None = Field(
        default=None, description="model registry URI; unset: the tracking URI")
    artifact_location: str | None = Field(
        default=None, description="artifact root for new experiments (file:// or s3://); "
                                  "unset: $AERIE_HOME/mlflow/artifacts with the embedded "
                                  "sqlite store, the server's default with a server")
    s3_endpoint_url: str | None = Field(
        default=None, description="S3 endpoint for s3:// artifacts (MinIO, moto)")
    target_family: str = Field(
        default="demo", description="target model family; one registered model per family "
                                    "(aerie-drafter-<family>)")
    lock_url: str | None = Field(
        default=None, description="PostgreSQL URL of the promotion lease that holds across "
                                  "hosts (set it through AERIE_PROMOTION_LOCK_URL, password "
                                  "in PGPASSWORD); unset: the tracking URI when it is "
                                  "postgresql://, else a lock file on this host")
    lock_dir: str | None = Field(
        default=None, description="directory of the one-host promotion lock files; unset: "
                                  "$AERIE_HOME/mlflow")
    lock_timeout_s: float = Field(default=120.0, description="wait for the promotion lock")
    request_timeout_s: int = Field(
        default=60, ge=1, description="seconds MLflow's client waits for each answer of an "
                                      "MLflow server (MLflow's own default: 120); raise it "
                                      "when drafters upload through a slow artifact proxy")
    request_retries: int = Field(
        default=3, ge=0, description="retries of a failed request to an MLflow server, "
                                     "backing off 2, 4, 8 s (MLflow's own default: 7, "
                                     "about 4 minutes of backoff alone)")
    ui_url: str | None = Field(
        default=None, description="where users open MLflow, for the links in Dagster's "
                                  "metadata; unset: the tracking URI when it is http(s), else "
                                  "http://127.0.0.1:5000 (mlflow ui)")
    dagster_ui_url: str = Field(
        default="http://127.0.0.1:3000", description="where users open Dagster, for the "
                                                     "links on MLflow runs")

    def mlflow_ui(self) -> str:
        if self.ui_url:
            return self.ui_url.rstrip("/")
        tracking = urlsplit(self.resolved_tracking_uri())
        if tracking.scheme not in ("http", "https"):
            return "http://127.0.0.1:5000"
        host = tracking.netloc.rpartition("@")[2]  # never a user:password into a link
        return urlunsplit(tracking._replace(netloc=host)).rstrip("/")

    def _page(self, route: str) -> str:
        """A page of the MLflow UI, in its model-training view."""
        return f"{self.mlflow_ui()}/#/{route}?{TRAINING_VIEW}"

    def experiment_link(self, experiment_id: str) -> str:
        """The MLflow UI page of the refresh experiment: its training runs."""
        return self._page(f"experiments/{experiment_id}")

    def run_link(self, experiment_id: str, run_id: str) -> str:
        """The MLflow UI page of a run."""
        return self._page(f"experiments/{experiment_id}/runs/{run_id}")

    def artifact_link(self, experiment_id: str, run_id: str, path: str) -> str:
        """An artifact of a run (a chart) opened in the MLflow UI's run page, previewed: one
        click from Dagster's metadata, and still right after the state moves (it names the
        run, not a file). The server's own ``get-artifact`` would download it instead."""
        return self._page(f"experiments/{experiment_id}/runs/{run_id}/artifactPath/"
                          f"{quote(path, safe='/')}")

    def version_link(self, model: str, version: str) -> str:
        return self._page(f"models/{model}/versions/{version}")

    @staticmethod
    def user() -> str:
        """Who runs the training (MLflow's ``mlflow.user``): the login name, or the uid in a
        container that has none."""
        import getpass

        try:
            return getpass.getuser()
        except (KeyError, OSError):
            return f"uid-{os.getuid()}"

    def dagster_run_link(self, run_id: str) -> str:
        return f"{self.dagster_ui_url.rstrip('/')}/runs/{run_id}"

    def resolved_tracking_uri(self) -> str:
        if self.tracking_uri:
            return self.tracking_uri
        return f"sqlite:///{mlflow_home() / 'mlflow.db'}"

    def resolved_artifact_location(self) -> str | None:
        if self.artifact_location:
            return self.artifact_location
        if self.resolved_tracking_uri().startswith("sqlite:"):
            return (mlflow_home() / "artifacts").as_uri()
        return None  # the server decides (e.g. mlflow-artifacts:/ with --serve-artifacts)

    def build(self, family: str | None = None) -> DrafterRegistry:
        """The registry of ``family`` (default: ``target_family``)."""
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        # MLflow's client reads its HTTP settings from these variables at every request
        os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(self.request_timeout_s)
        os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = str(self.request_retries)
        if self.s3_endpoint_url:
            os.environ["MLFLOW_S3_ENDPOINT_URL"] = self.s3_endpoint_url
        tracking = self.resolved_tracking_uri()
        if tracking.startswith("sqlite:"):
            Path(tracking.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        family = family or self.target_family
        lock_dir = Path(self.lock_dir) if self.lock_dir else mlflow_home()
        return DrafterRegistry.connect(
            tracking, family, registry_uri=self.registry_uri,
            artifact_location=self.resolved_artifact_location(),
            lock_path=lock_dir / f"promotion-{model_name(family)}.lock",
            lock_url=self.resolved_lock_url(), lock_timeout_s=self.lock_timeout_s)

    def resolved_lock_url(self) -> str | None:
        """The lease's database: ``lock_url``, else a PostgreSQL tracking store's (its
        SQLAlchemy driver suffix dropped: the lease speaks libpq). The value never appears
        in an error: it may hold a password."""
        url = self.lock_url or self.resolved_tracking_uri()
        scheme, sep, rest = url.partition("://")
        if sep and scheme.split("+")[0] in ("postgresql", "postgres"):
            return f"postgresql://{rest}"
        if self.lock_url:
            got = f"scheme {scheme!r}" if sep else "no URL scheme"
            raise ValueError(f"lock_url / AERIE_PROMOTION_LOCK_URL must be a postgresql:// "
                             f"URL, got {got}")
        if url.startswith(("http://", "https://")):
            log.warning("promotions are locked on this host only: MLflow is a server and "
                        "AERIE_PROMOTION_LOCK_URL is not set; set it to a PostgreSQL "
                        "database every promoting host reaches (docs/deploy.md)")
        return None


def target_family_from_env() -> str:
    """``AERIE_TARGET_FAMILY`` (default ``demo``): read when the definitions load, for the
    refresh job's training preset."""
    return os.environ.get("AERIE_TARGET_FAMILY") or "demo"


def mlflow_from_env() -> MlflowResource:
    """A resource configured by the variables that are set; the URLs that may carry a
    password as ``EnvVar``s (resolved by Dagster at run time, never copied into run
    config)."""
    return resource_from_env(MlflowResource, "", names=_ENV, secrets=_SECRETS)


def mlflow_resource_from_environment() -> MlflowResource:
    """The resource outside Dagster (the CLI), values read from the environment."""
    return resource_from_env(MlflowResource, "", names=_ENV, secrets=_SECRETS,
                             outside_dagster=True)


def mlflow_from_environment() -> DrafterRegistry:
    """The same registry built outside Dagster (the CLI)."""
    return mlflow_resource_from_environment().build()
