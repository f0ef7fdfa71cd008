"""The drafter refresh job for one refresh step (partition = step): draft vocab, training,
acceptance evaluation, registration and gated promotion."""

from dagster import define_asset_job

from assets.groups import REFRESH_ASSETS

drafter_refresh = define_asset_job(
    "drafter_refresh", selection=list(REFRESH_ASSETS),
    tags={"aerie/serial": "drafter_refresh"},  # one at a time: see jobs/cli.py INSTANCE_YAML
    description="Choose the draft vocab of the window ending at the partition's RL step, "
                "train and publish its EAGLE-3 drafter (warm-started from the previous one), "
                "measure it against the champion on held-out prompts, register it in MLflow "
                "and promote it to serving if the acceptance gate passes.")
