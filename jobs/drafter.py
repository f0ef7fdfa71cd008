"""The drafter refresh job for one refresh step (partition = step): draft vocab, training,
acceptance evaluation, registration, gated promotion and storage retention.

Its default run config holds the training preset of the configured target family
(:data:`pipeline.training.config.FAMILY_PRESETS`; the demo family's by default) and the
drafter algorithm of ``AERIE_DRAFTER_ALGORITHM``, with the deployment's
``AERIE_REFRESH_RUN_CONFIG`` merged over them: the Launchpad shows it, and the
sensor's and the schedule's requests carry it (the daemon uses a request's own run config
whole, never the job's default, when the request has one).
"""

from dagster import define_asset_job

from assets.groups import REFRESH_ASSETS
from pipeline.training.config import FAMILY_PRESETS
from resources.mlflow import target_family_from_env
from resources.run_config import deep_merge, drafter_algorithm_from_env, run_config_from_env


def default_run_config(family: str) -> dict | None:
    preset = FAMILY_PRESETS.get(family)
    return {"ops": {"drafter_checkpoint": {"config": dict(preset)}}} if preset else None


DEFAULT_RUN_CONFIG = deep_merge(
    deep_merge(default_run_config(target_family_from_env()) or {}, drafter_algorithm_from_env()),
    run_config_from_env("AERIE_REFRESH_RUN_CONFIG")) or None

drafter_refresh = define_asset_job(
    "drafter_refresh", selection=list(REFRESH_ASSETS),
    tags={"aerie/serial": "drafter_refresh"},  # one at a time: see aerie/cli.py INSTANCE_YAML
    config=DEFAULT_RUN_CONFIG,
    description="Choose the draft vocab of the window ending at the partition's RL step, "
                "train and publish its drafter (EAGLE-3, 3.1 or DFlash; warm-started from the "
                "previous one of its algorithm), "
                "measure it against the champion on held-out prompts, register it in MLflow "
                "and promote it to serving if the acceptance gate passes; then delete the "
                "shards of RL steps older than the refresh policy's retain_steps, if set.")
