"""The refresh summary: samples, tokens and wall time of every stage that fed one refresh,
read back from the Dagster instance (materialization metadata and step timings)."""

from dagster import AssetKey, AssetRecordsFilter, DagsterInstance

from assets.groups import DATA_ASSETS, REFRESH_ASSETS
from assets.partitions import step_key

# (samples, tokens) metadata keys per stage; "" where a stage has no such count
_COUNTS = {"rollout_snapshot": ("accepted", "tokens"),
           "tokenized_rollouts": ("samples", "tokens"),
           "hidden_state_shards": ("samples", "tokens"),
           "vocab_mapping": ("", "masked_tokens"),
           "drafter_checkpoint": ("samples", "tokens_trained"),
           "acceptance_eval": ("prompts", ""), "registered_drafter": ("", "")}


def refresh_summary(instance: DagsterInstance, step: int) -> str:
    """Markdown table: one row per stage; data stages summed over the window's RL steps
    (``window_steps`` of the refresh's ``vocab_mapping``)."""
    vocab, _ = _latest(instance, "vocab_mapping", step_key(step))
    window = list(vocab["window_steps"]) if vocab else [step]
    rows = ["| stage | RL steps | samples | tokens | wall s |", "|---|---|---|---|---|"]
    stages = [(a, window) for a in DATA_ASSETS] + [(a, [step]) for a in REFRESH_ASSETS
                                                   if a in _COUNTS]
    for asset, steps in stages:
        samples = tokens = seconds = 0.0
        for s in steps:
            meta, run_id = _latest(instance, asset, step_key(s))
            if meta is None:
                continue
            keys = _COUNTS[asset]
            samples += meta.get(keys[0], 0) if keys[0] else 0
            tokens += meta.get(keys[1], 0) if keys[1] else 0
            seconds += _step_seconds(instance, run_id, asset)
        span = f"{steps[0]}–{steps[-1]}" if len(steps) > 1 else str(steps[0])
        rows.append(f"| {asset} | {span} | {int(samples) if _COUNTS[asset][0] else '–'} | "
                    f"{int(tokens) if _COUNTS[asset][1] else '–'} | {seconds:.1f} |")
    return "\n".join(rows)


def _latest(instance: DagsterInstance, asset: str, partition: str):
    records = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=AssetKey(asset), asset_partitions=[partition]),
        limit=1).records
    if not records:
        return None, None
    event = records[0].event_log_entry
    meta = event.asset_materialization.metadata
    return {k: v.value for k, v in meta.items()}, event.run_id


def _step_seconds(instance: DagsterInstance, run_id: str, step: str) -> float:
    stats = instance.get_run_step_stats(run_id, step_keys=[step])
    return sum(s.end_time - s.start_time for s in stats if s.start_time and s.end_time)
