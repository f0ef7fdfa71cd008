"""Aerie's Dagster definitions: assets, checks, jobs, sensors and resources."""

import warnings

from dagster import BetaWarning, Definitions

from assets.drafter import drafter_checkpoint, vocab_mapping
from assets.evaluation import acceptance_eval
from assets.groups import DATA_ASSETS, MONITOR_ASSETS, REFRESH_ASSETS
from assets.monitor import serving_acceptance
from assets.release import registered_drafter, serving_drafter
from assets.retention import storage_retention
from assets.shards import hidden_state_shards
from assets.snapshots import rollout_snapshot
from assets.tokenized import tokenized_rollouts
from jobs.drafter import drafter_refresh
from jobs.ingest import dump_sensor, ingest_dumps
from jobs.refresh import drafter_refresh_schedule, drift_sensor, refresh_sensor
from jobs.release import promote_drafter_manually, rollback_drafter
from jobs.snapshots import ingest_step, snapshot_sensor
from resources.capture import capture_from_env
from resources.evaluator import evaluator_from_env
from resources.ingest import ingest_from_env
from resources.mlflow import mlflow_from_env
from resources.refresh import refresh_policy_from_env
from resources.serving import serving_from_env, serving_kind
from resources.storage import storage_from_env
from resources.trainer import trainer_from_env

FLOW = (rollout_snapshot, tokenized_rollouts, hidden_state_shards, vocab_mapping,
        drafter_checkpoint, acceptance_eval, registered_drafter, serving_drafter,
        storage_retention, serving_acceptance)
OWNERS = ["team:aerie"]
# Dagster 1.13 rebuilds every sensor with its beta `owners` parameter, set or not (Aerie sets
# none): a warning on every load that a newcomer reads as an error about their setup
warnings.filterwarnings("ignore", message="Parameter `owners` of initializer "
                        "`SensorDefinition.__init__` is currently in beta", category=BetaWarning)
SERVING = serving_from_env()
SERVED = ("serving_drafter", "serving_acceptance")  # kinds: the engine the deployment serves
EVALUATOR = evaluator_from_env()
JUDGE = EVALUATOR.build().engine  # acceptance_eval's kind when an engine judges


def _conventions(spec):
    """Owner and flow position of every asset (the catalog filters and sorts by them); the
    serving assets' kind is the serving mode's engine (``manifest`` when a file hands the
    drafter over); ``acceptance_eval``'s is the engine that judges when it is not Aerie's."""
    name = spec.key.path[-1]
    stage = f"{(DATA_ASSETS + REFRESH_ASSETS + MONITOR_ASSETS).index(name) + 1}"
    kinds = {serving_kind(SERVING.mode)} if name in SERVED else spec.kinds
    if name == "acceptance_eval" and JUDGE:
        kinds = {JUDGE}
    tags = {k: v for k, v in spec.tags.items()  # Dagster keeps kinds as tags too
            if kinds == spec.kinds or not k.startswith("dagster/kind/")}
    return spec.replace_attributes(owners=OWNERS, kinds=kinds, tags={
        **tags, "aerie/stage": stage,
        "aerie/partitioned_by": "refresh_step" if name in REFRESH_ASSETS else "rl_step"})


defs = Definitions(
    assets=[a.map_asset_specs(_conventions) for a in FLOW],
    jobs=[ingest_step, drafter_refresh, promote_drafter_manually, rollback_drafter,
          ingest_dumps],
    sensors=[snapshot_sensor, refresh_sensor, drift_sensor, dump_sensor],
    schedules=[drafter_refresh_schedule],
    # every resource from the deployment's environment (docs/reference/configuration.md); run config
    # overrides field by field
    resources={"storage": storage_from_env(), "capture": capture_from_env(),
               "trainer": trainer_from_env(), "mlflow": mlflow_from_env(),
               "serving": SERVING, "refresh": refresh_policy_from_env(),
               "ingest": ingest_from_env(), "evaluator": EVALUATOR},
)
