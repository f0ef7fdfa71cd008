"""Dagster and MLflow state under concurrent load: SQLite (the embedded default) against
PostgreSQL (a multi-host deployment), side by side in one run.

For each backend, ``--workers`` processes at once (as run workers on several hosts would):

- **registry**: ``--registry-ops`` MLflow registry operations in all, each a new model
  version with lineage tags (under the promotion lock: a lock file for SQLite, the
  PostgreSQL lease for PostgreSQL, as each is deployed), a tag write, an alias move and a
  search (the calls a refresh and a promotion make), through
  :class:`~pipeline.release.mlflow_registry.DrafterRegistry`;
- **runs**: ``--runs`` Dagster runs in all (a 3-op job that logs and materializes an
  asset), ``execute_in_process`` against one instance.

It counts the operations that failed with SQLite's ``database is locked`` (and any other
error, by type) and the wall time. PostgreSQL is Debian's server, started on 127.0.0.1 for
the run (``bench/local_postgres.py``); SQLite files live in a temporary directory.

    python bench/state_backends.py --json /tmp/bench/state_backends.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


def _classify(errors: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for e in errors:
        kind = "database is locked" if "database is locked" in e else e.split(":", 1)[0]
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def lineage(fingerprint: str, step: int) -> dict:
    """A complete lineage record of a registered drafter (what a refresh records)."""
    return {"fingerprint": fingerprint, "drafter_uri": f"file:///d/{fingerprint}",
            "rl_step": step, "rl_step_window": [step - 1, step],
            "policy_uri": f"file:///policy/{step}", "policy_sha256": "ab" * 32,
            "shard_manifest_sha256": {str(step): f"{step:064x}"},
            "aux_layer_ids": [1, 3, 4], "vocab_mapping_key": "cd" * 32, "tau": 2.5,
            "alpha": [0.8, 0.6, 0.4], "dagster_run_id": "bench"}


def registry_worker(job: dict) -> dict:
    from pipeline.release.mlflow_registry import DrafterRegistry

    registry = DrafterRegistry.connect(job["tracking"], job["family"],
                                       artifact_location=job["artifacts"],
                                       lock_url=job["lock_url"], lock_path=job["lock_path"])
    done, errors = 0, []
    for i in range(job["ops"]):
        try:
            fingerprint = uuid.uuid4().hex
            version = registry.register(None, f"file:///drafters/{fingerprint}",
                                        lineage(fingerprint, 10 + i)).version.version
            registry.set_tags(version, {"bench": job["worker"]})
            registry.set_alias(f"w{job['worker']}", version)
            registry.find_version(fingerprint)
            done += 1
        except Exception as e:  # counted by type: the measurement
            errors.append(f"{type(e).__name__}: {e}")
    return {"done": done, "errors": errors}


def run_worker(job: dict) -> dict:
    os.environ["DAGSTER_HOME"] = job["home"]
    from dagster import AssetMaterialization, DagsterInstance, op
    from dagster import job as dagster_job

    @op
    def first(context) -> int:
        context.log.info("first")
        return 1

    @op
    def second(context, x: int) -> int:
        context.log_event(AssetMaterialization("bench_asset", metadata={"x": x}))
        return x + 1

    @op
    def third(context, x: int) -> None:
        context.log.info(f"third {x}")

    @dagster_job
    def bench_job():
        third(second(first()))

    done, errors = 0, []
    with DagsterInstance.get() as instance:
        for _ in range(job["runs"]):
            try:
                ok = bench_job.execute_in_process(instance=instance,
                                                  raise_on_error=False).success
                if ok:
                    done += 1
                else:
                    errors.append("RunFailed: a step failed")
            except Exception as e:  # counted by type: the measurement
                errors.append(f"{type(e).__name__}: {e}".splitlines()[0])
    return {"done": done, "errors": errors}


def _spread(total: int, workers: int) -> list[int]:
    return [total // workers + (1 if i < total % workers else 0) for i in range(workers)]


def measure(pool, worker, jobs: list[dict]) -> dict:
    start = time.perf_counter()
    results = pool.map(worker, jobs)
    seconds = time.perf_counter() - start
    errors = [e for r in results for e in r["errors"]]
    return {"done": sum(r["done"] for r in results), "seconds": round(seconds, 2),
            "errors": _classify(errors), "first_error": errors[0][:300] if errors else None}


def backend_state(name: str, root: Path, server) -> tuple[str, str]:
    """(MLflow tracking URI, DAGSTER_HOME) of backend ``name``."""
    home = root / name / "dagster"
    home.mkdir(parents=True)
    if name == "sqlite":
        (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
        return f"sqlite:///{root / name / 'mlflow.db'}", str(home)
    dagster_url = server.new_database("dagster").replace("postgresql://",
                                                          "postgresql+psycopg2://", 1)
    (home / "dagster.yaml").write_text(
        f"telemetry:\n  enabled: false\nstorage:\n  postgres:\n    postgres_url: "
        f"{dagster_url}\n")
    return server.new_database("mlflow"), str(home)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--registry-ops", type=int, default=100)
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    from bench.local_postgres import PostgresServer
    from pipeline.release.mlflow_registry import DrafterRegistry

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = PostgresServer(port)
    root = Path(tempfile.mkdtemp(prefix="aerie-state-bench-"))
    report = {"workers": args.workers, "registry_ops": args.registry_ops, "runs": args.runs}
    ctx = multiprocessing.get_context("spawn")
    try:
        with ctx.Pool(args.workers) as pool:
            for name in ("sqlite", "postgres"):
                tracking, home = backend_state(name, root, server)
                artifacts = (root / name / "artifacts").as_uri()
                family = f"bench{uuid.uuid4().hex[:6]}"
                DrafterRegistry.connect(tracking, family, artifact_location=artifacts) \
                    .ensure_model()  # the schema, once, before the load
                registry = measure(pool, registry_worker, [
                    {"tracking": tracking, "family": family, "artifacts": artifacts,
                     "ops": n, "worker": w,
                     # the promotion lock of each deployment: a file on one host, the lease
                     "lock_path": str(root / name / "promotion.lock"),
                     "lock_url": tracking if name == "postgres" else None}
                    for w, n in enumerate(_spread(args.registry_ops, args.workers))])
                from dagster import DagsterInstance

                DagsterInstance.from_config(home).dispose()  # the schema, once, before the load
                runs = measure(pool, run_worker, [
                    {"home": home, "runs": n} for n in _spread(args.runs, args.workers)])
                report[name] = {"registry": registry, "runs": runs}
                print(f"{name:9s} registry {registry['done']}/{args.registry_ops} ok in "
                      f"{registry['seconds']} s, errors {registry['errors']}; runs "
                      f"{runs['done']}/{args.runs} ok in {runs['seconds']} s, errors "
                      f"{runs['errors']}", flush=True)
    except Exception:
        traceback.print_exc()
        raise
    finally:
        server.stop()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
