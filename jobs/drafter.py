"""The drafter refresh job: draft vocab + training for one refresh step (partition = step)."""

from dagster import define_asset_job

DRAFTER_ASSETS = ("vocab_mapping", "drafter_checkpoint")

train_drafter = define_asset_job(
    "train_drafter", selection=list(DRAFTER_ASSETS),
    description="Choose the draft vocab of the window ending at the partition's RL step and "
                "train, export and publish its EAGLE-3 drafter (warm-started from the "
                "previous one).")
