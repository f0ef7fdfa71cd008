"""The closed loop on the demo world: acceptance observed per RL step against the offline τ
at each refresh, and which trigger asked for each refresh.

The drift world: the small demo world (8 prompts of 4 rollouts per RL step, sampled at
T = 0.5) whose RL learning rate jumps 30x at step 6 while the length penalty rises from
0.03 to 0.1 (a training instability). The trainer
reports the speculative counters of the first rollout of each prompt with the drafter
serving now (:mod:`pipeline.demo.speculation`); after every step the sensors tick as the
daemon would: ``snapshot_sensor`` (ingest, ``serving_acceptance``), ``refresh_sensor``
(every N = 6), then, where that did not refresh, ``drift_sensor`` (a fall of more than 10%
over one RL step). It prints
the table of observed τ per step and drafter, the offline τ of each refresh, the triggers,
and writes the loop's chart.

    python bench/closed_loop.py --home /tmp/bench/closed-loop \\
        --json /tmp/bench/closed_loop.json --chart docs/img/closed_loop.png

The e2e test ``tests/e2e/test_drift_loop.py`` runs the same loop (:func:`run`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.demo.config import DemoConfig  # noqa: E402
from resources.refresh import RefreshPolicyResource  # noqa: E402

DRIFT_WORLD = DemoConfig.small(num_steps=11, temperature=0.5, prompts_per_step=8,
                               shift_step=6, shift_rl_lr=3e-3, shift_length_penalty=0.1)
DRIFT_POLICY = RefreshPolicyResource(every=6, window=2, max_tau_drop_percent=10,
                                     drift_window=1, drift_rearm_percent=5,
                                     drift_cooldown_steps=2, drift_min_cycles=50)
# what a small world's refresh trains with: from scratch the demo drafter needs ~20 steps
# before its first accepted draft; a few hundred verify passes per evaluation, not thousands
SMALL_TRAIN = {"ops": {
    "drafter_checkpoint": {"config": {"lr": 3e-3, "epochs": 15, "micro_batch_size": 8}},
    "serving_drafter": {"config": {"min_cycles": 20}},
}}
REPORTED_PROMPTS = 8  # prompts per RL step whose first rollout carries counters


@dataclass
class ClosedLoop:
    home: Path
    instance: object  # the DagsterInstance
    storage: object  # the Storage root
    triggers: dict[str, str]  # refresh partition -> what requested it
    drift_ticks: list[tuple[int, str]]  # (RL step, "run" or why the drift sensor skipped)
    seconds: float


def run(home: Path, world: DemoConfig = DRIFT_WORLD,
        policy: RefreshPolicyResource = DRIFT_POLICY) -> ClosedLoop:
    """The loop under ``home`` (``AERIE_HOME`` and ``DAGSTER_HOME`` must point there)."""
    from dagster import DagsterInstance

    from aerie import cli
    from aerie.demo import RefreshLoop, reported_records
    from pipeline.demo.world import generate_world
    from pipeline.snapshot.writer import SnapshotWriter
    from pipeline.storage import Storage

    started = time.perf_counter()
    cli.prepare_dagster_home()
    outputs = []
    generate_world(world, home / "demo-world", outputs.append, progress=False)
    storage = Storage((home / "storage").as_uri())
    writer = SnapshotWriter(storage)
    driver = RefreshLoop(DagsterInstance.get(), refresh_config=lambda step: SMALL_TRAIN,
                         policy=policy)
    ticks = []
    for out in outputs:
        records = reported_records(out, storage, world.max_new_tokens, REPORTED_PROMPTS)
        writer.write_step(out.step, records, out.policy_dir, out.policy_version,
                          sampling=out.sampling)
        seen = len(driver.drift_ticks)
        driver.after_step()
        ticks += [(out.step, t) for t in driver.drift_ticks[seen:]]
    return ClosedLoop(home, driver.instance, storage, dict(driver.triggers), ticks,
                      time.perf_counter() - started)


def summary(loop: ClosedLoop) -> dict:
    """Per RL step the observed τ per drafter; per refresh the offline τ and trigger."""
    from pipeline.evaluation.stage import read_report
    from pipeline.monitor.observed import observed_series

    steps = [{"step": o.step, "rollouts": o.rollouts, "with_counters": o.with_counters,
              "versions": {v.drafter_version: {"tau": v.tau, "low": v.tau_low,
                                               "high": v.tau_high, "verify_ct": v.verify_ct}
                           for v in o.versions}} for o in observed_series(loop.storage)]
    refreshes = []
    for partition, trigger in sorted(loop.triggers.items()):
        step = int(partition.split("-")[1])
        report = read_report(loop.storage, step)
        refreshes.append({"step": step, "trigger": trigger, **{
            f"{name}_tau": c.tau for name, c in report.contestants.items()}})
    return {"steps": steps, "refreshes": refreshes, "drift_ticks": loop.drift_ticks,
            "seconds": round(loop.seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", type=Path, default=Path("/tmp/bench/closed-loop"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--chart", type=Path)
    args = parser.parse_args()
    shutil.rmtree(args.home, ignore_errors=True)
    args.home.mkdir(parents=True)
    os.environ["AERIE_HOME"] = str(args.home)
    os.environ["DAGSTER_HOME"] = str(args.home / "dagster")
    for var in ("AERIE_STORAGE_URL", "MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):
        os.environ.pop(var, None)
    loop = run(args.home)
    out = summary(loop)
    for s in out["steps"]:
        cells = ", ".join(f"v{v}: τ {x['tau']:.3f} [{x['low']:.3f}, {x['high']:.3f}] over "
                          f"{x['verify_ct']} passes" for v, x in s["versions"].items()
                          if x["tau"] is not None) or "no drafter serving"
        print(f"RL step {s['step']:>2}: {cells}")
    for r in out["refreshes"]:
        print(f"refresh at step {r['step']} ({r['trigger']}): offline τ candidate "
              f"{r['candidate_tau']:.3f}, champion {r.get('champion_tau') or float('nan'):.3f}")
    print(f"{out['seconds']} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    if args.chart:
        from assets.loop_chart import publish_loop_chart
        from pipeline.release.mlflow_registry import model_name

        key = publish_loop_chart(loop.storage, model_name("demo"), DRIFT_WORLD.num_steps - 1,
                                 loop.instance)
        args.chart.parent.mkdir(parents=True, exist_ok=True)
        args.chart.write_bytes(loop.storage.read_bytes(key))


if __name__ == "__main__":
    main()
