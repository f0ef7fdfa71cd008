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
    """RL steps whose whole data path (snapshot, tokens, shards) is materialized (a key not
    of the form ``step-NNNNNN`` is no RL step: :func:`odd_partition_keys` reports it)."""
    found = (parse_step(k) for k in complete_partitions(instance, DATA_ASSETS))
    return sorted(s for s in found if s is not None)


def odd_partition_keys(instance) -> list[str]:
    """Keys of ``rl_steps`` and ``refresh_steps`` that are not ``step-NNNNNN`` (a typo in the
    UI, a script's key): Aerie never made them, the sensors skip them and say so."""
    return sorted({k for p in (rl_steps, refresh_steps)
                   for k in instance.get_dynamic_partitions(p.name) if parse_step(k) is None})


def odd_keys_note(odd: list[str], shown: int = 5) -> str:
    """One line naming (at most ``shown``, shortened) the odd partition keys skipped."""
    names = ", ".join(repr(k[:40]) for k in odd[:shown])
    more = f" and {len(odd) - shown} more" if len(odd) > shown else ""
    return (f"skipped {len(odd)} partition keys not of the form step-NNNNNN (not made by "
            f"Aerie; delete them in the UI when unwanted): {names}{more}")


def ensure_partition(instance, partitions_def: DynamicPartitionsDefinition, key: str) -> None:
    """Add ``key`` to ``partitions_def`` on ``instance`` unless it is there already."""
    if not instance.has_dynamic_partition(partitions_def.name, key):
        instance.add_dynamic_partitions(partitions_def.name, [key])


def parse_step(key: str) -> int | None:
    """The RL step of partition key ``step-NNNNNN`` exactly as :func:`step_key` writes it;
    None for any other key."""
    prefix, _, digits = key.partition("-")
    if prefix != "step" or not (digits.isascii() and digits.isdigit()):
        return None
    return int(digits) if step_key(int(digits)) == key else None


def parse_step_tag(value: str | None) -> int | None:
    """An RL step written in a run tag (``aerie/refresh_step``); None when it is not one."""
    return int(value) if value and value.isascii() and value.isdigit() else None


def step_of(key: str) -> int:
    """The RL step of an asset's own partition key; a :class:`ValueError` naming the key for
    any other (a run on a key Aerie never made)."""
    step = parse_step(key)
    if step is None:
        raise ValueError(f"partition key {key[:80]!r} is not of the form step-NNNNNN")
    return step


def refresh_triggers(instance) -> dict[int, str]:
    """What asked for the refresh of each refresh step (its newest run's trigger tag)."""
    from dagster import RunsFilter

    runs = instance.get_runs(filters=RunsFilter(job_name="drafter_refresh"))
    tagged = ((parse_step_tag(r.tags.get(REFRESH_STEP_TAG)), r) for r in reversed(runs))
    return {step: r.tags.get(TRIGGER_TAG, "manual") for step, r in tagged if step is not None}
