"""``aerie``: the command line of the embedded default.

``aerie demo`` plays both sides on one machine: the demo RL world (the user's RL trainer,
writing one snapshot per RL step through the writer API) and Aerie's refresh loop on a
persistent sqlite Dagster instance under ``$AERIE_HOME/dagster``: after every step it ticks
the snapshot sensor and the refresh sensor as the daemon would and runs what they request
(:mod:`aerie.demo`), so the drafter is refreshed every N steps and the gate decides each
refresh. ``aerie eval`` measures any drafter directory against a committed step's policy
(:mod:`pipeline.evaluation.any_drafter`). ``aerie ingest`` writes an RL framework's dump
directory as snapshots (:mod:`jobs.ingest`). ``aerie status`` says what serves now and
``aerie serving-args ENGINE`` the flags that launch an engine on it; ``aerie promote`` and
``aerie rollback`` run the override and rollback jobs; ``aerie ui`` opens the Dagster UI on
the same instance.
"""

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline.records import to_json

VERSION_TAG = "aerie/cli"  # runs the CLI launched itself: the command

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


def prepare_dagster_home() -> Path:
    """``$DAGSTER_HOME`` (default ``$AERIE_HOME/dagster``) with Aerie's ``dagster.yaml``
    and the workspace of the code location ``aerie``."""
    from aerie.launch import workspace_file
    from resources.home import dagster_home

    home = Path(os.environ.setdefault("DAGSTER_HOME", str(dagster_home())))
    home.mkdir(parents=True, exist_ok=True)
    config = home / "dagster.yaml"
    if not config.exists():
        config.write_text(INSTANCE_YAML)
    else:
        _add_missing_limits(config)
    workspace_file(home)
    return home


def _add_missing_limits(config: Path) -> None:
    """An instance written by an older Aerie lacks the refresh serial limit or the promotion
    pool limit: add what is missing, keep every value already set."""
    import yaml

    current = yaml.safe_load(config.read_text()) or {}
    if "run_queue" in current or "run_coordinator" in current:
        log.warning("%s configures runs its own way; add the concurrency limits of "
                    "aerie/cli.py INSTANCE_YAML yourself", config)
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


def generate_demo_world(force: bool = False, config=None, after_step=None,
                        progress: bool = True) -> dict:
    """Run the demo RL world once; its report is written last, so a crash re-runs it.

    ``config`` is a :class:`pipeline.demo.world.DemoConfig` (default: the full demo world);
    ``after_step(out)`` is called once each step is written (the refresh loop's ticks).
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
    from aerie.demo import DEMO_REPORTED_PROMPTS, reported_records

    config = config or DemoConfig()
    storage = storage_from_environment()
    writer = SnapshotWriter(storage)

    def publish(out) -> None:
        records = reported_records(out, storage, config.max_new_tokens,
                                   DEMO_REPORTED_PROMPTS)
        writer.write_step(out.step, records, out.policy_dir, out.policy_version,
                          sampling=out.sampling)
        if after_step is not None:
            after_step(out)

    report = generate_world(config, work_dir, on_step=publish,
                            progress=progress)
    text = to_json(report)
    report_path.write_text(text)
    return json.loads(text)


def _print_drift(report: dict) -> None:
    steps = report.get("steps") or []
    if not steps:
        return
    cols = {"accuracy": "accuracy", "mean_response_tokens": "response tokens",
            "kl_to_step0": "KL to step 0", "top1_agreement_with_step0": "top-1 = step 0"}
    print("\nThe policy drifts under RL (the demo trainer's own metrics):")
    print("step  " + "  ".join(f"{c:>15}" for c in cols.values()))
    for row in steps:
        metrics = row.get("metrics", row)
        print(f"{row.get('step', '?'):>4}  " + "  ".join(
            f"{metrics.get(c, float('nan')):>15.4f}" for c in cols))


# The demo's one deliberately bad refresh: two optimizer steps from scratch, so that the gate
# has a worse drafter to refuse (labelled as such in the summary).
BAD_REFRESH = {"ops": {"drafter_checkpoint": {"config": {"warm_start": "none",
                                                          "max_steps": 2}}}}


def bad_refresh_step(num_steps: int, every: int) -> int | None:
    """The RL step of the demo's bad refresh: the second to last refresh, when there are at
    least three (a promotion before it and a refresh after it). Refreshes land on steps
    every-1, 2·every-1, …"""
    refreshes = num_steps // every
    return (refreshes - 1) * every - 1 if refreshes >= 3 else None


def run_demo(world_config, policy, *, regenerate: bool = False, verbose: bool = False,
             progress: bool = True, refresh_config: dict | None = None) -> tuple[dict, list]:
    """The demo: the world's RL steps, each followed by the refresh loop's ticks. Returns the
    world's report and the gate's outcome of every refresh on the instance.
    Every refresh trains with the demo family's preset whatever ``AERIE_TARGET_FAMILY``
    says (the library defaults learn nothing on the demo world); ``refresh_config`` is
    merged over it (the bad refresh's settings on top)."""
    from dagster import DagsterInstance
    from tqdm import tqdm

    from aerie.demo import RefreshLoop, refresh_outcomes
    from assets.partitions import refresh_steps
    from jobs.drafter import default_run_config
    from pipeline.serving_now import drafter_name
    from resources.run_config import deep_merge

    bad = bad_refresh_step(world_config.num_steps, policy.every)
    base = deep_merge(default_run_config("demo"), refresh_config or {})
    loop = RefreshLoop(DagsterInstance.get(), verbose=verbose, policy=policy,
                       refresh_config=lambda step: deep_merge(
                           base, BAD_REFRESH if step == bad else {}))

    def after_step(out) -> None:
        ran = loop.after_step()
        line = f"RL step {out.step:>2} written and ingested"
        for o in refresh_outcomes(loop.instance, ran):
            line += (f"; refresh: {drafter_name(o.version, o.fingerprint)} τ "
                     f"{o.candidate_tau:.2f} → {o.action}")
        tqdm.write(line)

    report = generate_demo_world(force=regenerate, config=world_config,
                                 after_step=after_step, progress=progress)
    loop.after_step()  # a reused world: ingest and refresh whatever is left
    partitions = loop.instance.get_dynamic_partitions(refresh_steps.name)
    return report, refresh_outcomes(loop.instance, partitions)


def cmd_demo(args: argparse.Namespace) -> int:
    from aerie.demo import DEMO_SERVING
    from aerie.status import canary_lines, canary_records, refresh_table, staleness_lines
    from pipeline.demo.config import DemoConfig
    from resources.refresh import refresh_policy_from_env

    for variable, value in DEMO_SERVING.items():  # the user's own settings win
        os.environ.setdefault(variable, value)
    home = prepare_dagster_home()
    world_config, policy = DemoConfig(), refresh_policy_from_env()
    print(f"Aerie demo: the demo RL trainer writes {world_config.num_steps} RL steps; after "
          f"each one Aerie ingests it and, every {policy.every} steps, refreshes the drafter "
          f"on the last {policy.window} steps.\n(state: {home.parent})")
    t0 = time.perf_counter()
    report, outcomes = run_demo(world_config, policy, regenerate=args.regenerate,
                                verbose=args.verbose)
    seconds = time.perf_counter() - t0
    _print_drift(report)
    regimes = sorted({o.regime for o in outcomes}) or ["greedy"]
    print(f"\nRefreshes (every {policy.every} RL steps, each trained on the last "
          f"{policy.window}; τ = tokens per draft-verify cycle on held-out prompts, "
          f"{' / '.join(regimes)} as the rollouts were sampled):")
    bad = bad_refresh_step(world_config.num_steps, policy.every)
    notes = {f"step-{bad:06d}": "(the demo's deliberately bad refresh)"} if bad else {}
    print(refresh_table(outcomes, notes))
    records = canary_records(_registry_and_storage()[0], outcomes)
    canaries = canary_lines(records)
    if canaries:
        print("\nCanaries (half of the rollout servers first, judged on the RL engine's "
              "counters):")
        print("\n".join(f"  {line}" for line in canaries))
    stale = staleness_lines(outcomes, frozenset(
        v for v, r in records.items() if r.get("state") == "promoted"))
    if stale:
        print("\nThe serving drafter goes stale as the policy drifts (its τ on each later "
              "window):")
        print("\n".join(f"  {line}" for line in stale))
    if bad is not None:
        print(f"(the refresh at step {bad} is deliberately bad: 2 training steps from "
              "scratch, to show the gate refusing a worse drafter)")
    _print_where_to_look(outcomes)
    print(f"\ndemo: {seconds:.0f} s")
    return 0


def _print_where_to_look(outcomes) -> None:
    from resources.mlflow import mlflow_resource_from_environment
    from resources.storage import storage_from_environment

    print("\nWhere to look:")
    print("  aerie status                  what serves now, staleness, the last decision")
    print("  aerie ui                      then http://127.0.0.1:3000/locations/aerie/jobs/"
          "drafter_refresh (a run per refresh), the asset serving_drafter (every decision)")
    if outcomes:
        step = int(outcomes[-1].partition.rsplit("-", 1)[1])
        from pipeline.layout import chart_key

        print(f"  τ over RL steps               "
              f"{storage_from_environment().url(chart_key(step, 'tau'))}")
    mlflow = mlflow_resource_from_environment()
    print(f"  MLflow (aerie ui starts it)   "
          f"{mlflow.experiment_link(mlflow.build().runs.experiment_id())}")


def cmd_ui(args: argparse.Namespace) -> int:
    """``dagster dev`` on the embedded default's instance and, unless MLflow is a server of
    its own (an http(s) tracking URI) or ``--no-mlflow``, ``mlflow server`` on its store at
    the address the links in Dagster's metadata point to; both stop together."""
    from aerie.launch import workspace_file

    home = prepare_dagster_home()
    bin_dir = Path(sys.executable).parent
    dagster = [str(bin_dir / "dagster"), "dev", "-w", str(workspace_file(home)),
               "-h", "127.0.0.1", "-p", str(args.port)]
    mlflow = None if args.no_mlflow else mlflow_ui_command(bin_dir / "mlflow")
    children = []
    quiet = {**os.environ, "PYTHONWARNINGS": FRAMEWORK_WARNINGS}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the children too
    try:
        if mlflow is not None:
            print(f"MLflow UI: {mlflow[1]}")
            children.append(subprocess.Popen(mlflow[0], env=quiet, start_new_session=True))
        print(f"Dagster UI: http://127.0.0.1:{args.port}")
        children.append(subprocess.Popen(dagster, env=quiet, start_new_session=True))
        return children[-1].wait()
    except KeyboardInterrupt:
        return 130
    finally:  # each child with what it started: Ctrl-C's signal, then SIGKILL after 30 s
        for child in reversed(children):
            _stop_group(child)


def _stop_group(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGINT)
        child.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    try:
        os.killpg(child.pid, signal.SIGKILL)  # what the child left behind, if anything
    except ProcessLookupError:
        pass
    child.wait()


# what `aerie ui` hides of its children's output: the frameworks' notices about their own
# APIs (dagster dev's "superseded by dg dev", Starlette's deprecations inside MLflow), which
# a newcomer reads as errors in their setup
FRAMEWORK_WARNINGS = ("ignore::DeprecationWarning,ignore::FutureWarning,"
                      "ignore:starlette.middleware.wsgi is deprecated")


def mlflow_ui_command(mlflow_exe: Path) -> tuple[list[str], str] | None:
    """``(command, url)`` of ``mlflow server`` on the embedded default's tracking store,
    listening where :meth:`MlflowResource.mlflow_ui` sends the links; None when the
    tracking URI is an MLflow server already (it has its UI)."""
    from urllib.parse import urlsplit

    from resources.mlflow import mlflow_resource_from_environment

    resource = mlflow_resource_from_environment()
    tracking = resource.resolved_tracking_uri()
    if urlsplit(tracking).scheme in ("http", "https"):
        return None
    url = urlsplit(resource.mlflow_ui())
    command = [str(mlflow_exe), "server", "--backend-store-uri", tracking,
               "--host", url.hostname or "127.0.0.1", "--port", str(url.port or 5000),
               "--workers", "1"]  # one user: not a process per core
    artifacts = resource.resolved_artifact_location()
    if artifacts:
        command += ["--default-artifact-root", artifacts]
    return command, resource.mlflow_ui()


def _registry_and_storage():
    from resources.mlflow import mlflow_from_environment
    from resources.storage import storage_from_environment

    return mlflow_from_environment(), storage_from_environment()


def cmd_status(args: argparse.Namespace) -> int:
    from dagster import DagsterInstance

    from aerie.launch import fail_orphaned_runs
    from aerie.status import render, serving_status
    from resources.refresh import refresh_policy_from_env
    from resources.serving import serving_from_env

    prepare_dagster_home()
    registry, storage = _registry_and_storage()
    policy = refresh_policy_from_env()
    instance = DagsterInstance.get()
    for run_id in fail_orphaned_runs(instance):
        print(f"run {run_id} was left in flight by an aerie process that died: marked failed")
    status = serving_status(instance, storage, registry.model_name,
                            stale_after_steps=policy.stale_after_steps,
                            max_tau_drop=policy.max_tau_drop_percent / 100,
                            drift_window=policy.drift_window,
                            canary_policy=serving_from_env().canary_policy())
    print(render(status))
    return 0


def cmd_canary(args: argparse.Namespace) -> int:
    """Judge CANDIDATE against CHAMPION from the counters of the RL steps since ``--since``."""
    import json

    from aerie.canary import render
    from pipeline.monitor.canary import CanaryPolicy, judge_canary
    from pipeline.monitor.observed import observed_series
    from pipeline.records import to_dict
    from resources.storage import storage_from_environment

    policy = CanaryPolicy(canary_steps=args.steps, min_verify_passes=args.min_passes,
                          min_relative_gain=args.min_gain)
    series = observed_series(storage_from_environment(), since=args.since)
    verdict = judge_canary(series, args.candidate, args.champion, args.since, policy)
    print(json.dumps(to_dict(verdict), indent=1) if args.json else render(verdict, series))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from pipeline.evaluation.any_drafter import measure_drafter, shard_steps
    from pipeline.evaluation.config import EvalConfig
    from resources.evaluator import evaluator_from_env
    from resources.storage import storage_from_environment

    storage = storage_from_environment()
    committed = shard_steps(storage)
    if not committed:
        print(f"aerie eval: no RL step of {storage.url('')} has hidden-state shards (held-out "
              "prompts come from them): run a refresh first", file=sys.stderr)
        return 1
    step = args.step if args.step is not None else committed[-1]
    window = [s for s in committed if step - args.window < s <= step]
    if not window:
        print(f"aerie eval: no step in {step - args.window + 1}..{step} has hidden-state "
              f"shards (committed: {committed})", file=sys.stderr)
        return 1
    overrides = {k: getattr(args, k) for k in ("temperature", "top_p", "top_k", "min_p")
                 if getattr(args, k) is not None}
    drafter, named = args.drafter, {}
    try:
        if args.serving or args.serving_name:  # what serves now, at its settings
            if drafter is not None:
                raise ValueError("give a drafter directory or --serving, not both")
            drafter, manifest = _serving_drafter(storage, args.serving_name or "")
            settings = manifest.settings
            overrides.update(num_steps=settings.num_steps, eagle_topk=settings.eagle_topk,
                             num_draft_tokens=settings.num_draft_tokens)
            named = {"uri": manifest.target.drafter_uri,
                     "fingerprint": manifest.target.fingerprint}
        config = EvalConfig(max_prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                            device=args.device, dtype=args.dtype, seed=args.seed, **overrides)
        resource = evaluator_from_env()
        if args.evaluator:
            resource = resource.model_copy(update={"kind": args.evaluator})
        problem = resource.problem()
        if problem:
            raise ValueError(problem)
        result = measure_drafter(storage, step, drafter, window, config,
                                 evaluator=resource.build(), **named)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"aerie eval: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**json.loads(to_json(result)), "rows": result.rows()}, indent=1))
        return 0
    print(render_measurement(result))
    return 0


def _serving_drafter(storage, name: str):
    """The drafter serving now under ``name`` ("" : the registered model's name), fetched
    and verified into ``$AERIE_HOME/serving-cache``, and its serving manifest."""
    from pipeline.serving_now import resolve_serving
    from resources.home import aerie_home

    name = name or _registry_and_storage()[0].model_name
    launch = resolve_serving(storage, name, aerie_home() / "serving-cache")
    if launch is None:
        raise ValueError(f"serving {name}: nothing was ever published under "
                         f"{storage.url('')} (is the name right?)")
    if launch.drafter_dir is None:
        raise ValueError(f"serving {name}: manifest {launch.manifest.sequence} serves no "
                         "drafter")
    return launch.drafter_dir, launch.manifest


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def render_measurement(result) -> str:
    """``aerie eval``'s table: τ with its interval and α per position, per contestant."""
    settings = result.settings
    lines = [f"policy of RL step {result.step}; {result.prompts} held-out prompts of steps "
             f"{result.window[0]}..{result.window[-1]}; {result.sampler} "
             f"({result.sampler_source})",
             f"{settings['num_steps']} steps, top-k {settings['eagle_topk']}, "
             f"{settings['num_draft_tokens']} draft tokens, {settings['max_new_tokens']} new "
             f"tokens; " + (f"{result.device} {result.dtype}" if result.evaluator == "inprocess"
                            else f"on {result.evaluator}"),
             "",
             f"{'contestant':<12} {'τ':>6}  {f'{result.confidence:.0%} interval':<15} "
             f"{'greedy':<7} {'reference':<9} {'ties':<4} α per position"]
    for row in result.rows():
        tau = "-" if row["tau"] is None else f"{row['tau']:.3f}"
        interval = "-".join("-" if x is None else f"{x:.3f}" for x in row["tau_interval"])
        alpha = " ".join("-" if a is None else f"{a:.3f}" for a in row["alpha"]) or "-"
        lines.append(f"{row['contestant']:<12} {tau:>6}  {interval:<15} "
                     f"{row['matches_greedy']:<7} {row['matches_reference']:<9} "
                     f"{row['near_ties']:<4} {alpha}")
    lines += ["", "greedy: prompts whose greedy output equals no drafter's; reference: "
                  "prompts equal to the cache-free greedy reference (in process only); ties: "
                  "mismatches at a bf16 near-tie (on an engine: at the no-drafter server's "
                  "top two); α: unknown (-) where an engine reports totals only"]
    return "\n".join(lines)


def cmd_ingest(args: argparse.Namespace) -> int:
    from jobs.ingest import follow
    from resources.ingest import IngestResource
    from resources.storage import storage_from_environment

    settings = IngestResource(
        framework=args.framework, directory=str(args.directory),
        initial_policy=str(args.initial_policy), checkpoints=str(args.checkpoints or ""),
        pattern=args.pattern or "", sampling=args.sampling or "", settle_s=args.settle,
        allow_multi_turn_text=args.allow_multi_turn_text)
    reports = follow(settings, storage_from_environment(), poll_s=args.poll,
                     passes=None if args.follow else 1)
    return 0 if not any(r["files_quarantined"] for r in reports) else 3


def cmd_serving_args(args: argparse.Namespace) -> int:
    from pipeline.serving_now import resolve_serving
    from resources.home import aerie_home
    from resources.storage import storage_from_environment

    name = args.name or _registry_and_storage()[0].model_name
    storage = storage_from_environment()
    cache = args.cache or aerie_home() / "serving-cache"
    launch = resolve_serving(storage, name, cache)
    if launch is None:
        print(f"serving {name}: nothing was ever published under {storage.url('')} (is the "
              "name right?)", file=sys.stderr)
        return 1
    sequence = launch.manifest.sequence  # AERIE_SYNC_LAUNCHED_WITH for the sync hooks
    if launch.drafter_dir is None:
        print(f"serving {name}: manifest {sequence} serves no drafter", file=sys.stderr)
        return 0
    try:
        flags = launch.args_for(args.engine)
    except ValueError as e:
        print(f"serving {name}: {e}", file=sys.stderr)
        return 2
    print("\n".join(flags))
    print(f"serving {name}: manifest {sequence}, drafter {launch.manifest.target.name} at "
          f"{launch.drafter_dir}", file=sys.stderr)
    return 0


def _run_release_job(job_name: str, op: str, config: dict, args) -> int:
    """Run ``job_name`` (the override or the rollback job) on the instance, recorded like a
    run launched from the UI, and print what serves afterwards."""
    from dagster import DagsterInstance, RunRequest

    from aerie import launch

    prepare_dagster_home()
    instance = DagsterInstance.get()
    launch.fail_orphaned_runs(instance)
    run_config = {"ops": {op: {"config": config}}, **launch.in_process(args.verbose)}
    run = launch.execute(instance, job_name, RunRequest(run_config=run_config),
                         run_config, {VERSION_TAG: f"aerie {args.command}"})
    print(f"{job_name}: run {run.run_id} succeeded")
    return cmd_status(args)


def cmd_promote(args: argparse.Namespace) -> int:
    return _run_release_job("promote_drafter_manually", "force_promote_op",
                            {"version": args.version, "actor": args.actor,
                             "reason": args.reason}, args)


def cmd_rollback(args: argparse.Namespace) -> int:
    return _run_release_job("rollback_drafter", "rollback_op",
                            {"actor": args.actor, "reason": args.reason}, args)


class _Version(argparse.Action):
    """``--version``: the installed distribution's version, looked up when asked."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"aerie {version('aerie')}")
        except PackageNotFoundError:
            print("aerie (not installed: pip install -e . in the checkout)")
        parser.exit()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aerie", description=__doc__.splitlines()[0])
    p.add_argument("--version", action=_Version)
    p.add_argument("-v", "--verbose", action="store_true",
                   help="show Dagster's run logs and every library's INFO logs")
    sub = p.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the demo RL world and the refresh loop on it")
    demo.add_argument("--regenerate", action="store_true",
                      help="generate the demo world again even if it exists")
    demo.set_defaults(func=cmd_demo)
    ui = sub.add_parser("ui", help="open the Dagster UI on the embedded default's instance, "
                                   "and the MLflow UI on its store")
    ui.add_argument("--port", type=int, default=3000)
    ui.add_argument("--no-mlflow", action="store_true",
                    help="do not start the MLflow UI (it runs elsewhere)")
    ui.set_defaults(func=cmd_ui)
    sub.add_parser("status", help="what serves now, since when, its τ and staleness, and the "
                                  "last refresh").set_defaults(func=cmd_status)
    canary = sub.add_parser(
        "canary", help="judge two drafter versions served side by side on the same RL steps "
                       "(say, on two halves of the rollout servers) from the RL engine's "
                       "counters: promote, roll back or wait")
    canary.add_argument("candidate", help="the registry version of the canary")
    canary.add_argument("champion", help="the version it is compared with ('none': no "
                                         "drafter)")
    canary.add_argument("--since", type=int, required=True,
                        help="the first RL step the canary served")
    canary.add_argument("--steps", type=int, default=4,
                        help="RL steps with both drafting before a verdict (default 4)")
    canary.add_argument("--min-passes", type=int, default=200,
                        help="verify passes per drafter before a verdict (default 200)")
    canary.add_argument("--min-gain", type=float, default=0.0,
                        help="the relative gain the interval's lower end must pass "
                             "(default 0)")
    canary.add_argument("--json", action="store_true", help="print the verdict as JSON")
    canary.set_defaults(func=cmd_canary)
    ev = sub.add_parser("eval", help="measure a drafter directory (or no drafter) against "
                                     "a committed RL step's policy on its held-out prompts")
    ev.add_argument("drafter", nargs="?", type=Path,
                    help="a drafter directory (config.json + model.safetensors, SGLang's "
                         "EAGLE-3 layout); left out: no drafter only")
    ev.add_argument("--serving", action="store_true",
                    help="measure the drafter serving now, at the settings it serves with")
    ev.add_argument("--serving-name", metavar="NAME",
                    help="the serving name for --serving (default: the registered model's "
                         "name); implies --serving")
    ev.add_argument("--step", type=int, help="the RL step whose policy is the target "
                                             "(default: the newest with shards)")
    ev.add_argument("--window", type=_positive, default=1,
                    help="take held-out prompts from this many steps up to --step (default 1)")
    ev.add_argument("--prompts", type=_positive, default=32,
                    help="at most this many prompts")
    ev.add_argument("--max-new-tokens", type=_positive, default=128)
    ev.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ev.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ev.add_argument("--seed", type=int, default=0, help="seeds a sampled evaluation")
    for name, kind in (("temperature", float), ("top_p", float), ("top_k", int),
                       ("min_p", float)):
        ev.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind,
                        help=f"override the recorded sampler's {name}")
    from pipeline.evaluation.evaluators import EVALUATORS

    ev.add_argument("--evaluator", choices=tuple(EVALUATORS),
                    help="who decodes: inprocess (Aerie's engine), sglang or vllm (servers "
                         "from AERIE_EVALUATOR_<ENGINE>_LAUNCH); default: "
                         "AERIE_EVALUATOR_KIND, else inprocess")
    ev.add_argument("--json", action="store_true", help="print the measurement as JSON")
    ev.set_defaults(func=cmd_eval)
    from resources.mlflow import MlflowResource

    who = MlflowResource.user()
    promote = sub.add_parser("promote", help="make a registered drafter version the champion, "
                                             "overriding the gate (recorded)")
    promote.add_argument("version", type=lambda v: v.removeprefix("v"),
                         help="registered model version, e.g. 3 (or v3, as Aerie names it)")
    promote.add_argument("--reason", required=True, help="why the gate is overridden")
    promote.add_argument("--actor", default=who, help=f"who decides (default: {who})")
    promote.set_defaults(func=cmd_promote)
    from pipeline.adapters.readers import READERS
    from pipeline.serving_now import ENGINES

    ingest = sub.add_parser("ingest", help="write an RL framework's dump directory as rollout "
                                           "snapshots (one pass, or --follow)")
    ingest.add_argument("framework", choices=sorted(READERS))
    ingest.add_argument("directory", type=Path, help="the framework's dump directory")
    ingest.add_argument("--initial-policy", type=Path, required=True,
                        help="HF dir of the policy before RL (version 0, and the tokenizer)")
    ingest.add_argument("--checkpoints", type=Path,
                        help="root of the framework's HF checkpoints")
    ingest.add_argument("--pattern", help="checkpoint dir under the root with {N}, e.g. "
                                          "'global_step_{N}/actor/huggingface'")
    ingest.add_argument("--sampling", help='the rollout sampler as JSON, e.g. '
                                           '\'{"temperature": 1.0}\'')
    ingest.add_argument("--settle", type=float, default=60.0,
                        help="seconds the newest file must be unchanged to count as complete")
    ingest.add_argument("--allow-multi-turn-text", action="store_true",
                        help="keep multi-turn text records (no tool-token mask) instead of "
                             "quarantining them")
    ingest.add_argument("--follow", action="store_true", help="keep polling the directory")
    ingest.add_argument("--poll", type=float, default=30.0, help="seconds between passes")
    ingest.set_defaults(func=cmd_ingest)
    serving = sub.add_parser(
        "serving-args", help="the launch flags (one per line) that serve the current drafter "
                             "on an engine, its files fetched and verified")
    serving.add_argument("engine", choices=ENGINES)
    serving.add_argument("--name", help="the serving name (default: the registered model "
                                        "of AERIE_TARGET_FAMILY)")
    serving.add_argument("--cache", type=Path, help="where the drafter is fetched to "
                                                    "(default: $AERIE_HOME/serving-cache)")
    serving.set_defaults(func=cmd_serving_args)
    rollback = sub.add_parser("rollback", help="restore the previous champion (recorded)")
    rollback.add_argument("--reason", default="rollback", help="why")
    rollback.add_argument("--actor", default=who, help=f"who rolls back (default: {who})")
    rollback.set_defaults(func=cmd_rollback)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not args.verbose:  # MLflow's INFO logs and transformers' loading bars
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # quiet by default: Aerie's own progress and results; libraries only when they warn
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")
    log.setLevel(logging.INFO if args.verbose else logging.WARNING)
    from aerie.launch import RunFailed

    try:
        return args.func(args)
    except RunFailed as e:  # the run's error, without the traceback (--verbose keeps it)
        if args.verbose:
            raise
        print(f"aerie {args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
