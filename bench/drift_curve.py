"""Benchmark: the drift curve. τ on every RL step's policy for three drafters.

    python bench/drift_curve.py [--storage DIR] [--work DIR] [--every 4] [--window 4]
        [--prompts 32] [--max-new-tokens 160] [--spec 5,1,6] [--temperatures 0,1]
        [--seed 0] [--json out.json]

Needs the demo world ingested (``aerie demo`` does it; default storage: the embedded
default's). The storage is copied to ``--work`` first, so the user's state is never touched.

(a) stale: trained once at step 0 (window [0], the only data there is) with the compute of
    (c), i.e. to convergence on the step-0 policy, and never refreshed;
(b) refreshed: retrained after every block of ``--every`` steps (steps every-1, 2·every-1,
    …) on the last ``--window`` steps, warm-started from the previous refresh; at RL step s
    the newest refresh <= s serves;
(c) scratch: trained from scratch on the newest window with 5× the epochs of one refresh
    (evaluated on the last step only, where it is the upper reference).

Every drafter is evaluated with the same engine (SGLang-style EAGLE-3 drafting and
verification; ``--spec`` = num_steps,eagle_topk,num_draft_tokens) on the same held-out
prompts: the distinct held-out prompts of all steps (prompts no drafter trained on), cut at
``--prompts`` in key order, once per regime of ``--temperatures``: 0 is greedy, above is
speculative sampling at that temperature (the demo's RL samples at 1), every prompt seeded
from ``--seed``. τ = tokens emitted per draft-verify cycle (bonus included), with its 95%
bootstrap interval over prompts.

Training and evaluation results are cached in ``--work`` (re-running resumes). Prints a
markdown table and writes the τ curve PNG next to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from pipeline.records import to_dict

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

log = logging.getLogger("drift_curve")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--storage", type=Path, default=None, help="ingested demo storage dir")
    p.add_argument("--work", type=Path, default=Path("/tmp/aerie-drift"))
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--spec", default="5,1,6", help="num_steps,eagle_topk,num_draft_tokens")
    p.add_argument("--temperatures", default="0,1", help="regimes, 0 = greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scratch-factor", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def train_config(epochs_factor: int = 1, max_steps: int = 0):
    from pipeline.training.config import FAMILY_PRESETS, TrainConfig

    demo = FAMILY_PRESETS["demo"]
    base = TrainConfig(lr=demo["lr"], epochs=demo["epochs"],
                       micro_batch_size=demo["micro_batch_size"], export_dtype="float32")
    return replace(base, epochs=base.epochs * epochs_factor, max_steps=max_steps)


def train(storage, step: int, window: int, config, warm_start: str, work: Path):
    from pipeline.layout import drafter_prefix
    from pipeline.training import stage as training_stage
    from pipeline.vocab import stage as vocab_stage

    vocab_stage.run(storage, step, window, 32000)
    started = time.perf_counter()
    r = training_stage.run(storage, step, config, work_root=work / "runs", warm_start=warm_start)
    log.info("trained step %d (window %s, warm start %s): loss %.3f, %.0fs%s", step,
             r.manifest.meta["window_steps"], r.result.warm_start["mode"],
             r.result.final["loss"], time.perf_counter() - started,
             " (cached)" if r.reused else "")
    return drafter_prefix(step), r


def fingerprint(storage, prefix: str) -> str:
    from pipeline.manifest import read_manifest

    return read_manifest(storage, prefix).meta["fingerprint"]


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import torch

    from pipeline.capture.heldout import heldout_prompts
    from pipeline.eagle3.export import load_drafter
    from pipeline.eagle3.spec import SpecParams
    from pipeline.evaluation.charts import tau_curve
    from pipeline.evaluation.confidence import tau_interval
    from pipeline.evaluation.engine import evaluate
    from pipeline.layout import policy_prefix
    from pipeline.sampling import SamplingParams
    from pipeline.storage import Storage
    from resources.home import aerie_home

    torch.set_num_threads(args.threads)
    source = args.storage or aerie_home() / "storage"
    work = args.work
    root = work / "storage"
    if not root.exists():
        work.mkdir(parents=True, exist_ok=True)
        shutil.copytree(source, root, ignore=shutil.ignore_patterns("drafters", "vocab"))
    storage = Storage(root.as_uri())
    steps = sorted(int(d.split("=")[1]) for d in storage.list_dirs("shards"))
    last = steps[-1]
    params = SpecParams(*(int(x) for x in args.spec.split(",")))
    t0 = time.perf_counter()

    # -- drafters ----------------------------------------------------------------------
    config = train_config()
    # refresh after every block of ``every`` steps, so the last step is a refresh step
    refreshes = [0] + [s for s in steps if s > 0 and (s + 1) % args.every == 0]
    scratch_root = work / "scratch-storage"
    if not scratch_root.exists():
        shutil.copytree(root, scratch_root, ignore=shutil.ignore_patterns("drafters"))
    scratch_storage = Storage(scratch_root.as_uri())
    scratch, scratch_run = train(scratch_storage, last, args.window,
                                 train_config(args.scratch_factor), "none", work / "scratch")
    # (a) gets the optimizer steps of (c): trained to convergence on the step-0 data.
    stale, _ = train(storage, 0, 1, train_config(max_steps=scratch_run.result.steps), "none",
                     work)
    refreshed = {0: stale}
    for s in refreshes[1:]:
        refreshed[s], _ = train(storage, s, args.window, config, "previous", work)
    train_s = time.perf_counter() - t0

    # -- evaluation ----------------------------------------------------------------------
    split, prompts = heldout_prompts(storage, steps, args.prompts)
    ids = [list(p.prompt_ids) for p in prompts]
    samplers = [SamplingParams(float(t)) for t in args.temperatures.split(",")]
    cache_path = work / f"eval-{args.spec}-{len(ids)}-{args.max_new_tokens}-s{args.seed}.json"
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        from transformers import AutoModelForCausalLM

        for s in steps:
            todo = [("stale", storage, stale), ("refreshed", storage,
                                                 refreshed[max(r for r in refreshed if r <= s)])]
            if s == last:
                todo.append(("scratch", scratch_storage, scratch))
            todo = [(f"{s}/{n}/{sampler.slug}", sampler, st, p) for n, st, p in todo
                    for sampler in samplers]
            todo = [t for t in todo if t[0] not in cache
                    or cache[t[0]]["fingerprint"] != fingerprint(t[2], t[3])]
            if not todo:
                continue
            local = storage.download_dir(policy_prefix(s), Path(tmp) / f"policy-{s}")
            target = AutoModelForCausalLM.from_pretrained(str(local), dtype=torch.float32)
            embed = target.get_input_embeddings().weight.detach()
            for key, sampler, store, prefix in todo:
                model = load_drafter(store.download_dir(prefix, Path(tmp) / key.replace(
                    "/", "-")), embed, dtype=torch.float32)
                run = evaluate(target, model, ids, params, max_new_tokens=args.max_new_tokens,
                               eos_token_id=target.config.eos_token_id, sampler=sampler,
                               seed=args.seed)
                cache[key] = {"drafter": prefix, "fingerprint": fingerprint(store, prefix),
                              "interval": tau_interval(run.per_prompt),
                              "per_prompt": run.per_prompt, **run.stats.summary()}
                cache_path.write_text(json.dumps(cache, indent=1))
                log.info("%s tau %.3f %s", key, run.stats.tau, cache[key]["interval"])
    eval_s = time.perf_counter() - t0 - train_s

    # -- report ------------------------------------------------------------------------
    out = {"spec": str(params), "prompts": len(ids), "max_new_tokens": args.max_new_tokens,
           "every": args.every, "window": args.window, "seed": args.seed,
           "refresh_steps": sorted(refreshed), "last": last, "train_s": train_s,
           "eval_s": eval_s, "heldout": to_dict(split), "regimes": {}, "evals": cache}
    for sampler in samplers:
        series = {name: {s: cache[f"{s}/{name}/{sampler.slug}"] for s in steps
                         if f"{s}/{name}/{sampler.slug}" in cache}
                  for name in ("stale", "refreshed", "scratch")}
        out["regimes"][sampler.label] = report(series, steps, last, sampler, params, ids, args)
        if args.json:
            png = tau_curve({label: {s: e["tau"] for s, e in series[name].items()}
                             for name, label in LABELS.items()},
                            title=f"τ on each RL step's policy ({sampler.label})",
                            refresh_steps=sorted(refreshed))
            args.json.with_name(f"{args.json.stem}-{sampler.slug}.png").write_bytes(png)
    print(f"\ntraining {train_s:.0f}s, evaluation {eval_s:.0f}s")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


LABELS = {"stale": "(a) stale", "refreshed": "(b) refreshed", "scratch": "(c) scratch 5×"}


def report(series, steps, last, sampler, params, ids, args) -> dict:
    """Print one regime's table (τ [95% interval]) and return its headline ratios."""
    def cell(entry) -> str:
        if entry is None:
            return ""
        lo, hi = entry["interval"]
        return f"{entry['tau']:.3f} [{lo:.2f}, {hi:.2f}]"

    print(f"\nτ per RL step, {sampler.label} (spec {params}, {len(ids)} held-out prompts, "
          f"max_new_tokens {args.max_new_tokens}, seed {args.seed}; refresh every "
          f"{args.every}, window {args.window}; [95% bootstrap interval over prompts]):\n")
    print("| RL step | (a) stale | (b) refreshed | (c) scratch 5× |\n|---|---|---|---|")
    for s in steps:
        print(f"| {s} | {cell(series['stale'].get(s))} | {cell(series['refreshed'].get(s))} | "
              f"{cell(series['scratch'].get(s))} |")
    a, b, c = (series[n][last]["tau"] for n in ("stale", "refreshed", "scratch"))
    print(f"\nlast step {last}, {sampler.label}: (b)/(a) = {b / a:.3f}, (b)/(c) = {b / c:.3f}")
    return {"b_over_a": b / a, "b_over_c": b / c,
            "series": {n: {s: e["tau"] for s, e in v.items()} for n, v in series.items()},
            "alpha_last": {n: series[n][last]["alpha"] for n in series}}


if __name__ == "__main__":
    sys.exit(main())
