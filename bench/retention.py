"""Storage retention over the demo run: bytes of hidden-state shards written, reclaimed and
left, with ``retain_steps`` = ``--retain`` and the refresh policy's defaults (every 4, window
4), in a fresh ``AERIE_HOME``.

Runs ``aerie demo``'s loop (20 RL steps, a refresh every 4), then reads every
``hidden_state_shards`` and ``storage_retention`` materialization back from the instance and
sums what is on disk under ``shards/`` and the training work root. Prints one table; writes
it as JSON with ``--json``.

    python bench/retention.py --retain 4 --json /tmp/bench/retention.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def tree_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.exists() else 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--retain", type=int, default=4)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    home = Path(tempfile.mkdtemp(prefix="aerie-retention-"))
    os.environ.update({"AERIE_HOME": str(home), "AERIE_RETAIN_STEPS": str(args.retain),
                       "DAGSTER_HOME": str(home / "dagster")})
    from dagster import AssetKey, DagsterInstance

    from aerie.cli import prepare_dagster_home, run_demo
    from pipeline.demo.config import DemoConfig
    from resources.refresh import refresh_policy_from_env

    prepare_dagster_home()
    policy = refresh_policy_from_env()
    started = time.perf_counter()
    run_demo(DemoConfig(), policy, progress=False)
    seconds = time.perf_counter() - started
    instance = DagsterInstance.get()

    def metadata(asset: str) -> list[dict]:
        records = instance.fetch_materializations(AssetKey(asset), limit=10_000).records
        return [{k: v.value for k, v in r.event_log_entry.asset_materialization.metadata.items()}
                for r in records]

    shards = metadata("hidden_state_shards")
    retention = metadata("storage_retention")
    written = sum(m["bytes"] for m in shards)
    freed = sum(m["shard_bytes_freed"] for m in retention)
    work_freed = sum(m["work_bytes_freed"] for m in retention)
    left = tree_bytes(home / "storage" / "shards")
    report = {
        "command": " ".join(["python", "bench/retention.py", *(argv or sys.argv[1:])]),
        "retain_steps": args.retain, "every": policy.every, "window": policy.window,
        "rl_steps": len(shards), "refreshes": len(retention),
        "shard_bytes_written": written, "shard_bytes_reclaimed": freed,
        "shard_bytes_left": left, "work_bytes_reclaimed": work_freed,
        "work_bytes_left": tree_bytes(home / "training"),
        "steps_deleted": sorted(s for m in retention for s in m.get("deleted", [])),
        "demo_seconds": round(seconds, 1)}
    for key, value in report.items():
        print(f"{key:<22} {value}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
