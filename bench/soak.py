"""The soak: the whole loop over 100+ RL steps of a small world, with retention on, a
refresh every N steps (several promotions) and a rollback part way, measuring after every
step what a long-lived deployment accumulates. Retention prunes the old steps' policies and
ingestion runs too (``AERIE_PRUNE_POLICIES``, ``AERIE_PRUNE_HISTORY``) unless
``--no-prune``.

After each RL step is written, the sensors tick as the daemon would (``snapshot_sensor``
and its ``ingest_step`` run, then ``refresh_sensor`` or ``drift_sensor`` and their
``drafter_refresh``), every run executing in this process, so its resources are this
process's. Once ``--rollback-after`` promotions have happened, the ``rollback_drafter`` job
runs once (what ``aerie rollback`` runs). Per step it records:

- this process: open file descriptors, threads, child processes, resident memory;
- disk: bytes under each storage dataset (``policies/``, ``snapshots/``, ``shards/``, …),
  the training work root, the Dagster home and the MLflow home;
- database rows: every table of the Dagster instance's SQLite files (runs, event logs)
  and of MLflow's ``mlflow.db``, and the event logs' bytes;
- seconds: the step's write and its ticks.

It prints the first and last samples and, per measure, the growth per RL step over the first
and second halves of the run (equal: linear; a second half near 0: flat), and writes every
sample as JSON with ``--json``.

    python bench/soak.py --steps 104 --every 8 --window 4 --retain 6 --json /tmp/bench/soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.closed_loop import REPORTED_PROMPTS, SMALL_TRAIN  # noqa: E402
from bench.retention import tree_bytes  # noqa: E402
from resources.run_config import deep_merge  # noqa: E402

# a gate that promotes any strictly better drafter, so that a small world's refreshes,
# whose gains are a few percent, promote several times over the run
SOAK_TRAIN = deep_merge(SMALL_TRAIN, {"ops": {"serving_drafter": {"config": {
    "min_relative_gain": 0.0}}}})


def process_sample() -> dict[str, int]:
    """This process's descriptors, threads, children and memory (Linux ``/proc``)."""
    status = dict(line.split(":", 1) for line in
                  Path("/proc/self/status").read_text().splitlines() if ":" in line)
    me = str(os.getpid())
    children = 0
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # it ended while we looked
                continue
            children += fields[1] == me  # the parent's pid is the second field after the name
    kinds: dict[str, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed while we looked (the listing's own descriptor)
            continue
        kind = target.split(":", 1)[0] if ":" in target and not target.startswith("/") else \
            Path(target).suffix or Path(target).parent.name
        kinds[kind] = kinds.get(kind, 0) + 1
    return {"fds": len(os.listdir("/proc/self/fd")), "fd_kinds": kinds,
            "threads": threading.active_count(),
            "os_threads": int(status["Threads"]), "children": children,
            "rss_mib": int(status["VmRSS"].split()[0]) // 1024,
            "peak_rss_mib": int(status["VmHWM"].split()[0]) // 1024}


def sqlite_rows(files: list[Path]) -> dict[str, int]:
    """Rows per table summed over ``files`` (read-only; a file being written is skipped)."""
    rows: dict[str, int] = {}
    for path in files:
        if not path.exists():
            continue  # not created yet
        try:
            with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
                tables = [t for (t,) in db.execute(
                    "select name from sqlite_master where type = 'table'")]
                for table in tables:
                    (n,) = db.execute(f'select count(*) from "{table}"').fetchone()
                    rows[table] = rows.get(table, 0) + n
        except sqlite3.DatabaseError as e:
            print(f"  {path}: not read ({e})", file=sys.stderr)
    return rows


def disk_sample(home: Path) -> dict[str, int]:
    storage = home / "storage"
    out = {f"storage/{d.name}": tree_bytes(d) for d in sorted(storage.iterdir()) if d.is_dir()}
    out.update({"training": tree_bytes(home / "training"), "dagster": tree_bytes(home / "dagster"),
                "mlflow": tree_bytes(home / "mlflow"),
                "serving-cache": tree_bytes(home / "serving-cache")})
    return out


def rows_sample(home: Path) -> dict[str, int]:
    dagster = sorted((home / "dagster").rglob("*.db"))
    rows = {f"dagster.{t}": n for t, n in sqlite_rows(dagster).items()}
    rows.update({f"mlflow.{t}": n for t, n in
                 sqlite_rows([home / "mlflow" / "mlflow.db"]).items()})
    rows["dagster.db_files"] = len(dagster)
    return rows


def rollback(instance) -> str:
    """The ``rollback_drafter`` job, as ``aerie rollback`` runs it; returns its run id."""
    from dagster import RunRequest

    from aerie import launch

    config = {"ops": {"rollback_op": {"config": {"actor": "soak", "reason": "soak"}}},
              **launch.in_process(False)}
    return launch.execute(instance, "rollback_drafter", RunRequest(run_config=config), config,
                          {}).run_id


def champion(storage) -> str | None:
    from pipeline.release.mlflow_registry import model_name
    from pipeline.serving_now import read_serving

    now = read_serving(storage, model_name("demo"))
    return None if now is None or now.target is None else now.target.registry_version


def run(home: Path, steps: int, every: int, window: int, retain: int, rollback_after: int,
        prune: bool = True) -> dict:
    from dagster import DagsterInstance

    from aerie import cli
    from aerie.demo import RefreshLoop, refresh_outcomes, reported_records
    from pipeline.demo.config import DemoConfig
    from pipeline.demo.world import generate_world
    from pipeline.snapshot.writer import SnapshotWriter
    from pipeline.storage import Storage
    from resources.refresh import refresh_policy_from_env

    os.environ.update({"AERIE_RETAIN_STEPS": str(retain), "AERIE_REFRESH_EVERY": str(every),
                       "AERIE_REFRESH_WINDOW": str(window),
                       "AERIE_PRUNE_POLICIES": str(prune), "AERIE_PRUNE_HISTORY": str(prune)})
    # no length penalty: the responses stay long enough over 100 steps for the gate's
    # measurement floor (with the default penalty they shrink to a few tokens)
    world = DemoConfig.small(num_steps=steps, temperature=0.5, prompts_per_step=8,
                             length_penalty=0.0)
    started = time.perf_counter()
    cli.prepare_dagster_home()
    outputs = []
    generate_world(world, home / "demo-world", outputs.append, progress=False)
    world_s = time.perf_counter() - started
    storage = Storage((home / "storage").as_uri())
    writer = SnapshotWriter(storage)
    driver = RefreshLoop(DagsterInstance.get(), refresh_config=lambda step: SOAK_TRAIN,
                         policy=refresh_policy_from_env())
    samples, champions, rolled_back = [], [], None
    for out in outputs:
        t0 = time.perf_counter()
        records = reported_records(out, storage, world.max_new_tokens, REPORTED_PROMPTS)
        writer.write_step(out.step, records, out.policy_dir, out.policy_version,
                          sampling=out.sampling)
        t1 = time.perf_counter()
        refreshed = driver.after_step()
        now = champion(storage)
        if now is not None and (not champions or champions[-1] != now):
            champions.append(now)
        if rolled_back is None and len(champions) >= rollback_after:
            rolled_back = {"step": out.step, "from": now, "run": rollback(driver.instance)}
            rolled_back["to"] = champion(storage)
            champions.append(rolled_back["to"])
            print(f"step {out.step}: rolled back v{now} -> v{rolled_back['to']}")
        samples.append({"step": out.step, "write_s": round(t1 - t0, 2),
                        "ticks_s": round(time.perf_counter() - t1, 2), "refreshed": refreshed,
                        "champion": champion(storage), **process_sample(),
                        "disk": disk_sample(home), "rows": rows_sample(home)})
        s = samples[-1]
        print(f"step {out.step:>3}: {s['ticks_s']:>5.1f} s ticks, {s['fds']} fds "
              f"{s['fd_kinds']}, "
              f"{s['rss_mib']} MiB, champion v{s['champion']}"
              + (f", refreshed {refreshed}" if refreshed else ""), flush=True)
    outcomes = refresh_outcomes(driver.instance, driver.refreshed)
    return {"steps": steps, "every": every, "window": window, "retain_steps": retain,
            "prune": prune, "world_s": round(world_s, 1),
            "seconds": round(time.perf_counter() - started, 1),
            "refreshes": [{"partition": o.partition, "action": o.action, "version": o.version,
                           "candidate_tau": o.candidate_tau, "champion_tau": o.champion_tau,
                           "champion_after": o.champion_after} for o in outcomes],
            "triggers": dict(driver.triggers), "rollback": rolled_back, "champions": champions,
            "samples": samples}


def flat(sample: dict) -> dict[str, float]:
    out = {k: v for k, v in sample.items() if isinstance(v, int | float) and k != "step"}
    for group in ("disk", "rows"):
        out.update({f"{group}:{k}": v for k, v in sample[group].items()})
    return out


def growth(samples: list[dict]) -> dict[str, tuple[float, float, float, float]]:
    """Per measure: (first value, last value, growth per step over the first half, over the
    second half); measured from a quarter in, past the first refreshes' warm-up."""
    a, m, z = (flat(samples[i]) for i in (len(samples) // 4, len(samples) * 5 // 8, -1))
    n1 = samples[len(samples) * 5 // 8]["step"] - samples[len(samples) // 4]["step"]
    n2 = samples[-1]["step"] - samples[len(samples) * 5 // 8]["step"]
    first = flat(samples[0])
    return {k: (first.get(k, 0), z[k], (m.get(k, 0) - a.get(k, 0)) / n1, (z[k] - m.get(k, 0)) / n2)
            for k in z}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--home", type=Path, default=Path("/tmp/bench/soak"))
    p.add_argument("--steps", type=int, default=104)
    p.add_argument("--every", type=int, default=8, help="N: a refresh every N RL steps")
    p.add_argument("--window", type=int, default=4, help="K: RL steps a refresh trains on")
    p.add_argument("--retain", type=int, default=6, help="AERIE_RETAIN_STEPS (>= the window)")
    p.add_argument("--no-prune", dest="prune", action="store_false",
                   help="keep the old steps' policies and ingestion runs (AERIE_PRUNE_POLICIES, "
                        "AERIE_PRUNE_HISTORY off)")
    p.add_argument("--rollback-after", type=int, default=2,
                   help="roll back once this many drafters have served")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    shutil.rmtree(args.home, ignore_errors=True)
    args.home.mkdir(parents=True)
    os.environ.update({"AERIE_HOME": str(args.home), "DAGSTER_HOME": str(args.home / "dagster")})
    for var in ("AERIE_STORAGE_URL", "MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):
        os.environ.pop(var, None)
    report = run(args.home, args.steps, args.every, args.window, args.retain,
                 args.rollback_after, args.prune)
    report["command"] = " ".join(["python", "bench/soak.py", *(argv or sys.argv[1:])])
    report["growth"] = growth(report["samples"])
    print(f"\n{len(report['refreshes'])} refreshes: "
          + ", ".join(f"{r['partition']} {r['action']}" for r in report["refreshes"]))
    print(f"rollback: {report['rollback']}; {report['seconds']} s")
    print(f"{'measure':<44} {'step 0':>12} {'last':>12} {'/step, 1st':>11} {'/step, 2nd':>11}")
    for k, (first, last, g1, g2) in sorted(report["growth"].items()):
        if not (first or last):
            continue  # a table nothing writes
        print(f"{k:<44} {first:>12,.0f} {last:>12,.0f} {g1:>11,.1f} {g2:>11,.1f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
