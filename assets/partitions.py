"""Partitions: one per RL step for the data path, one per refresh step for the refresh.

Both are dynamic and share the key format ``step-000120``:

- ``rl_steps``: the data assets (``rollout_snapshot`` → ``hidden_state_shards``); the
  snapshot sensor adds a key for every RL step the trainer completes.
- ``refresh_steps``: the refresh assets (``vocab_mapping`` → ``serving_drafter``); a key is
  added only for the steps a refresh runs at (every N RL steps: by the refresh sensor, the
  schedule, ``aerie demo``), so the refresh assets show no missing partitions in between and
  a backfill over refresh partitions trains once per refresh, not once per RL step.

Dagster has no "last K partitions of another definition" mapping, so a refresh partition
``step-s`` depends on the data assets without an explicit mapping: Dagster links it to the RL
step of the same key (the window's newest step); the whole window s-K+1..s it read is in its
metadata (``window_steps``).
"""

from __future__ import annotations

from collections.abc import Iterable

from dagster import AssetKey, DynamicPartitionsDefinition

from assets.groups import DATA_ASSETS

REFRESH_STEP_TAG = "aerie/refresh_step"  # on every refresh run: the step it refreshes at
TRIGGER_TAG = "aerie/refresh_trigger"  # on every refresh run: cadence | drift | schedule
DECISION_TAG = "aerie/decision"  # on a refresh run once decided: promoted | refused |
# already_champion | rolled_back (the run list shows what a green run decided)

rl_steps = DynamicPartitionsDefinition(name="rl_steps")
refresh_steps = DynamicPartitionsDefinition(name="refresh_steps")


def step_key(step: int) -> str:
    return f"step-{step:06d}"


def complete_partitions(instance, assets: Iterable[AssetKey | str]) -> set[str]:
    """Partitions in which every one of ``assets`` is materialized."""
    return set.intersection(*(instance.get_materialized_partitions(AssetKey.from_coercible(a))
                              for a in assets))


def ingested_steps(instance) -> list[int]:
    """RL steps whose whole data path (snapshot, tokens, shards) is materialized."""
    return sorted(step_of(k) for k in complete_partitions(instance, DATA_ASSETS))


def ensure_partition(instance, partitions_def: DynamicPartitionsDefinition, key: str) -> None:
    """Add ``key`` to ``partitions_def`` on ``instance`` unless it is there already."""
    if not instance.has_dynamic_partition(partitions_def.name, key):
        instance.add_dynamic_partitions(partitions_def.name, [key])


def step_of(key: str) -> int:
    prefix, _, digits = key.partition("-")
    if prefix != "step" or not digits.isdigit():
        raise ValueError(f"partition key {key!r} is not of the form step-NNNNNN")
    return int(digits)


def refresh_triggers(instance) -> dict[int, str]:
    """What asked for the refresh of each refresh step (its newest run's trigger tag)."""
    from dagster import RunsFilter

    runs = instance.get_runs(filters=RunsFilter(job_name="drafter_refresh"))
    return {int(r.tags[REFRESH_STEP_TAG]): r.tags.get(TRIGGER_TAG, "manual")
            for r in reversed(runs) if REFRESH_STEP_TAG in r.tags}
