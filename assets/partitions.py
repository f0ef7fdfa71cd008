"""RL steps as Dagster partitions: keys ``step-000120``, added by the snapshot sensor."""

from __future__ import annotations

from collections.abc import Iterable

from dagster import AssetKey, DynamicPartitionsDefinition

rl_steps = DynamicPartitionsDefinition(name="rl_steps")


def step_key(step: int) -> str:
    return f"step-{step:06d}"


def complete_partitions(instance, assets: Iterable[AssetKey | str]) -> set[str]:
    """Partitions in which every one of ``assets`` is materialized."""
    return set.intersection(*(instance.get_materialized_partitions(AssetKey.from_coercible(a))
                              for a in assets))


def step_of(key: str) -> int:
    prefix, _, digits = key.partition("-")
    if prefix != "step" or not digits.isdigit():
        raise ValueError(f"partition key {key!r} is not of the form step-NNNNNN")
    return int(digits)
