"""``aerie``: the command line of the embedded default.

``aerie demo`` plays both sides on one machine: the demo RL world (the user's RL trainer,
writing snapshots through the writer API) and Aerie's Dagster jobs on a persistent sqlite
instance under ``$AERIE_HOME/dagster``, so the runs can be inspected later with
``aerie ui``. The sensor is ticked in-process, exactly as the daemon would tick it, and its
run requests are executed; partitions that are already materialized are skipped.
"""

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from pipeline.records import to_json

log = logging.getLogger("aerie")


# The embedded default's instance: no telemetry; at most one drafter_refresh run at a time
# (however launched: sensor, schedule, UI), which the queued run coordinator enforces; and at
# most one step of the pool "promotion" at a time (serving_drafter, the manual override, the
# rollback), which every executor enforces (Dagster 1.13 sets no per-pool limit in
# dagster.yaml: `pools: default_limit` applies to every pool without one, and "promotion" is
# Aerie's only pool; `dagster instance concurrency set promotion 1` sets it explicitly).
INSTANCE_YAML = """telemetry:
  enabled: false
concurrency:
  runs:
    tag_concurrency_limits:
      - key: aerie/serial
        value: drafter_refresh
        limit: 1
  pools:
    default_limit: 1
"""


def _prepare_dagster_home() -> Path:
    from resources.home import dagster_home

    home = Path(os.environ.setdefault("DAGSTER_HOME", str(dagster_home())))
    home.mkdir(parents=True, exist_ok=True)
    config = home / "dagster.yaml"
    if not config.exists():
        config.write_text(INSTANCE_YAML)
    else:
        _add_missing_limits(config)
    return home


def _add_missing_limits(config: Path) -> None:
    """An instance written by an older Aerie lacks the refresh serial limit or the promotion
    pool limit: add what is missing, keep every value already set."""
    import yaml

    current = yaml.safe_load(config.read_text()) or {}
    if "run_queue" in current or "run_coordinator" in current:
        log.warning("%s configures runs its own way; add the concurrency limits of "
                    "jobs/cli.py INSTANCE_YAML yourself", config)
        return
    wanted = yaml.safe_load(INSTANCE_YAML)["concurrency"]
    concurrency = current.setdefault("concurrency", {})
    changed = False
    for key, value in wanted.items():
        section = concurrency.setdefault(key, {})
        for name, setting in value.items():
            if name not in section:
                section[name] = setting
                changed = True
    if changed:
        config.write_text(yaml.safe_dump(current, sort_keys=False))
        log.info("%s: added Aerie's concurrency limits", config)


def generate_demo_world(force: bool = False, config=None) -> dict:
    """Run the demo RL world once; its report is written last, so a crash re-runs it.

    ``config`` is a :class:`pipeline.demo.world.DemoConfig` (default: the full demo world).
    """
    from pipeline.demo.world import DemoConfig, generate_world
    from pipeline.snapshot.writer import SnapshotWriter
    from resources.home import aerie_home
    from resources.storage import storage_from_environment

    work_dir = aerie_home() / "demo-world"
    report_path = work_dir / "world.json"
    if report_path.exists() and not force:
        log.info("demo world already generated (%s)", report_path)
        return json.loads(report_path.read_text())
    writer = SnapshotWriter(storage_from_environment())

    def publish(out) -> None:
        writer.write_step(out.step, out.records, out.policy_dir, out.policy_version)

    report = generate_world(config or DemoConfig(), work_dir, on_step=publish, progress=True)
    text = to_json(report)
    report_path.write_text(text)
    return json.loads(text)


def run_pipeline() -> list[str]:
    """Tick the snapshot sensor once and execute its run requests on the local instance."""
    from dagster import DagsterInstance, build_sensor_context

    from definitions import defs
    from jobs.snapshots import snapshot_sensor

    instance = DagsterInstance.get()
    result = snapshot_sensor(build_sensor_context(
        instance=instance, resources={"storage": defs.resources["storage"]}))
    return execute_tick(instance, "ingest_step", result, DEMO_INGEST_CONFIG)


def execute_tick(instance, job_name: str, result, run_config: dict | None = None) -> list[str]:
    """Apply a sensor tick's partition requests and execute its run requests, as the daemon
    does with a tick's result (``result`` may be a SkipReason or a lone RunRequest)."""
    from dagster import RunRequest

    for add in getattr(result, "dynamic_partitions_requests", None) or []:
        instance.add_dynamic_partitions(add.partitions_def_name, list(add.partition_keys))
    requests = [result] if isinstance(result, RunRequest) else \
        getattr(result, "run_requests", None)
    return execute_requests(instance, job_name, requests, run_config)


def execute_requests(instance, job_name: str, requests, run_config: dict | None = None,
                     ) -> list[str]:
    """Execute run requests in this process, as the daemon would launch them.

    ``run_config`` is deep-merged over each request's own. The request's partition is added
    to the job's dynamic partitions if missing (a daemon refuses a request for an unknown
    partition; a tick adds it first, see :func:`execute_tick`). Partitions whose job assets
    are all materialized already are skipped (what the daemon's run-key dedup does across
    restarts). Returns the partitions that ran.
    """
    from assets.partitions import complete_partitions, ensure_partition
    from definitions import defs

    job = defs.resolve_job_def(job_name)
    done = complete_partitions(instance, job.asset_layer.executable_asset_keys)
    ran = []
    for request in requests or []:
        if request.partition_key in done:
            log.info("%s %s: already materialized", job_name, request.partition_key)
            continue
        ensure_partition(instance, job.partitions_def, request.partition_key)
        outcome = job.execute_in_process(
            instance=instance, partition_key=request.partition_key, tags=request.tags,
            run_config=deep_merge(request.run_config or {}, run_config or {}),
            raise_on_error=True)
        log.info("%s %s: run %s succeeded", job_name, request.partition_key, outcome.run_id)
        ran.append(request.partition_key)
    return ran


def deep_merge(base: dict, over: dict) -> dict:
    """``base`` with ``over`` merged in, recursively for nested dicts (run configs)."""
    out = dict(base)
    for k, v in over.items():
        both = isinstance(v, dict) and isinstance(out.get(k), dict)
        out[k] = deep_merge(out[k], v) if both else v
    return out


# The demo world has 16 prompts per RL step: hold out a fifth of them (not the library's 5%)
# so that evaluation has a few dozen prompts no drafter ever trained on.
DEMO_INGEST_CONFIG = {"ops": {"hidden_state_shards": {"config": {"heldout_fraction": 0.2}}}}

# The demo drafter trains from scratch on a few thousand tokens: the library defaults (lr
# 1e-4, one epoch) are tuned for warm-started refreshes on real data and learn nothing here.
DEMO_TRAIN_CONFIG = {"ops": {
    "drafter_checkpoint": {"config": {"lr": 1e-3, "epochs": 3, "micro_batch_size": 8}},
}}


def train_newest(run_config: dict | None = None) -> str | None:
    """Materialize ``drafter_refresh`` for the newest ingested step (skipped if done)."""
    from dagster import DagsterInstance

    from assets.partitions import ensure_partition, ingested_steps, refresh_steps, step_key
    from jobs.refresh import refresh_request

    instance = DagsterInstance.get()
    ingested = ingested_steps(instance)
    if not ingested:
        return None
    newest = step_key(ingested[-1])
    ensure_partition(instance, refresh_steps, newest)  # as the refresh sensor's tick adds it
    execute_requests(instance, "drafter_refresh", [refresh_request(ingested[-1])],
                     DEMO_TRAIN_CONFIG if run_config is None else run_config)
    return newest


def _print_drift(report: dict) -> None:
    steps = report.get("steps") or []
    if not steps:
        return
    cols = ["accuracy", "mean_response_tokens", "mean_reward", "kl_to_step0",
            "top1_agreement_with_step0"]
    print("step  " + "  ".join(f"{c:>24}" for c in cols))
    for row in steps:
        metrics = row.get("metrics", row)
        print(f"{row.get('step', '?'):>4}  " + "  ".join(
            f"{metrics.get(c, float('nan')):>24.4f}" for c in cols))


def cmd_demo(args: argparse.Namespace) -> int:
    _prepare_dagster_home()
    t0 = time.perf_counter()
    report = generate_demo_world(force=args.regenerate)
    t1 = time.perf_counter()
    _print_drift(report)
    ran = run_pipeline()
    t2 = time.perf_counter()
    trained = train_newest()
    t3 = time.perf_counter()
    print(f"demo world: {t1 - t0:.1f}s; ingest: {len(ran)} steps in {t2 - t1:.1f}s; "
          f"drafter for {trained}: {t3 - t2:.1f}s (DAGSTER_HOME={os.environ['DAGSTER_HOME']})")
    return 0


def cmd_ui(args: argparse.Namespace) -> int:
    _prepare_dagster_home()
    exe = Path(sys.executable).with_name("dagster")
    os.execv(str(exe), [str(exe), "dev", "-w", "workspace.yaml", "-h", "127.0.0.1",
                        "-p", str(args.port)])
    return 0  # unreachable


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aerie", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="generate the demo RL world and run the pipeline on it")
    demo.add_argument("--regenerate", action="store_true",
                      help="generate the demo world again even if it exists")
    demo.set_defaults(func=cmd_demo)
    ui = sub.add_parser("ui", help="open the Dagster UI on the embedded default's instance")
    ui.add_argument("--port", type=int, default=3000)
    ui.set_defaults(func=cmd_ui)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
