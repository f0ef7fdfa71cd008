"""Aerie's Dagster definitions: assets, checks, jobs, sensors and resources."""

from dagster import Definitions

from assets.snapshots import rollout_snapshot
from jobs.snapshots import ingest_snapshot, snapshot_sensor
from resources.storage import storage_from_env

defs = Definitions(
    assets=[rollout_snapshot],
    jobs=[ingest_snapshot],
    sensors=[snapshot_sensor],
    resources={"storage": storage_from_env()},
)
