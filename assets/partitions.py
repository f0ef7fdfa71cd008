"""RL steps as Dagster partitions: keys ``step-000120``, added by the snapshot sensor."""

from __future__ import annotations

from dagster import DynamicPartitionsDefinition

rl_steps = DynamicPartitionsDefinition(name="rl_steps")


def step_key(step: int) -> str:
    return f"step-{step:06d}"


def step_of(key: str) -> int:
    prefix, _, digits = key.partition("-")
    if prefix != "step" or not digits.isdigit():
        raise ValueError(f"partition key {key!r} is not of the form step-NNNNNN")
    return int(digits)
