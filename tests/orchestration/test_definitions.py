"""The definitions load, and renames of assets, checks, jobs or sensors fail loudly."""

from __future__ import annotations

from dagster import AssetKey

from definitions import defs


def test_definitions_load_and_names_are_stable():
    repo = defs.get_repository_def()
    assert {k.to_user_string() for k in repo.asset_graph.get_all_asset_keys()} == {
        "rollout_snapshot", "tokenized_rollouts", "hidden_state_shards", "vocab_mapping",
        "drafter_checkpoint", "acceptance_eval", "registered_drafter", "serving_drafter"}
    assert {c.name for c in repo.asset_graph.asset_check_keys} == {
        "quarantine_ratio", "shard_integrity", "vocab_coverage", "training_loss",
        "acceptance_lossless"}
    assert {j.name for j in repo.get_all_jobs() if not j.name.startswith("__")} == {
        "ingest_step", "drafter_refresh", "promote_drafter_manually", "rollback_drafter"}
    assert {s.name for s in repo.sensor_defs} == {"snapshot_sensor", "refresh_sensor"}
    assert {s.name for s in repo.schedule_defs} == {"drafter_refresh_schedule"}
    assert set(defs.resources) == {"storage", "capture", "trainer", "mlflow", "serving",
                                  "refresh"}
    for key in ("rollout_snapshot", "tokenized_rollouts", "hidden_state_shards",
                "vocab_mapping", "drafter_checkpoint", "acceptance_eval", "registered_drafter",
                "serving_drafter"):
        assert repo.asset_graph.get(AssetKey(key)).partitions_def.name == "rl_steps"
