"""Benchmark: the drafter algorithms side by side on the demo world.

    python bench/drafter_algorithms.py [--storage DIR] [--work DIR] [--step S] [--window 4]
        [--algorithms eagle3,eagle3.1,dflash] [--epochs-factor 5] [--prompts 32]
        [--max-new-tokens 160] [--spec 5,1,6] [--temperatures 0,1] [--seed 0] [--json out.json]

Needs an ingested demo world (``aerie demo`` makes one; default storage: the embedded
default's). Each algorithm trains in its own copy of the storage under ``--work``, so the
user's state is never touched and the drafters never overwrite each other.

Every algorithm gets the same window (the ``--window`` RL steps ending at ``--step``, the
newest step with shards by default), the same draft vocab, the same training compute (the
demo preset with ``--epochs-factor`` times its epochs, from scratch: one refresh's compute
teaches a scratch drafter next to nothing, the demo's drafters learn over a chain of
warm-started refreshes) and the same seed; all of them are evaluated
with the in-process engine on the same held-out prompts (those no drafter trained on), at
each regime of ``--temperatures`` (0: greedy; above: speculative sampling, every prompt
seeded from ``--seed``). τ = tokens emitted per draft-verify cycle (bonus included), with its
95% bootstrap interval over prompts; training seconds are wall time on this machine.

Each algorithm drafts as its engines serve it: EAGLE-3 and 3.1 with ``--spec``, DFlash with
a chain as long as its block (``dflash_block_size`` - 1 tokens, one draft forward per cycle
where EAGLE runs ``num_steps``). Every cycle is one target forward, so τ is also the tokens
per target forward; the table adds the drafts proposed and the draft forwards per cycle. A
window captured for several algorithms (``AERIE_CAPTURE_AUX_LAYER_IDS`` holding each one's
default layers) trains each on its own layers.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

log = logging.getLogger("drafter_algorithms")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--storage", type=Path, default=None, help="ingested demo storage dir")
    p.add_argument("--work", type=Path, default=Path("/tmp/aerie-algorithms"))
    p.add_argument("--step", type=int, default=None, help="default: the newest with shards")
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--algorithms", default="eagle3,eagle3.1,dflash")
    p.add_argument("--epochs-factor", type=int, default=5)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--spec", default="5,1,6", help="num_steps,eagle_topk,num_draft_tokens")
    p.add_argument("--temperatures", default="0,1", help="regimes, 0 = greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.algorithms import algorithm, read_config, serving_of
    from pipeline.capture.heldout import heldout_prompts
    from pipeline.eagle3.spec import SpecParams
    from pipeline.evaluation.confidence import tau_interval
    from pipeline.evaluation.engine import evaluate
    from pipeline.layout import drafter_prefix, policy_prefix
    from pipeline.sampling import SamplingParams
    from pipeline.storage import Storage
    from pipeline.training import stage as training_stage
    from pipeline.training.config import FAMILY_PRESETS, TrainConfig
    from pipeline.vocab import stage as vocab_stage
    from resources.home import aerie_home

    torch.set_num_threads(args.threads)
    source = args.storage or aerie_home() / "storage"
    names = args.algorithms.split(",")
    for name in names:
        algorithm(name)  # refuses a typo before anything runs
    demo = FAMILY_PRESETS["demo"]
    base = TrainConfig(lr=demo["lr"], epochs=demo["epochs"] * args.epochs_factor,
                       micro_batch_size=demo["micro_batch_size"], export_dtype="float32")
    params = SpecParams(*(int(x) for x in args.spec.split(",")))
    samplers = [SamplingParams(float(t)) for t in args.temperatures.split(",")]
    out: dict = {"spec": str(params), "window": args.window, "seed": args.seed,
                 "epochs": base.epochs, "algorithms": {}}
    with tempfile.TemporaryDirectory() as tmp:
        target = ids = None
        for name in names:
            root = args.work / name / "storage"
            if not root.exists():
                root.parent.mkdir(parents=True, exist_ok=True)
                shutil.copytree(source, root, ignore=shutil.ignore_patterns("drafters", "vocab"))
            storage = Storage(root.as_uri())
            steps = sorted(int(d.split("=")[1]) for d in storage.list_dirs("shards"))
            step = args.step if args.step is not None else steps[-1]
            vocab_stage.run(storage, step, args.window, 32000)
            started = time.perf_counter()
            r = training_stage.run(storage, step, replace(base, drafter_algorithm=name),
                                   work_root=args.work / name / "runs", warm_start="none")
            train_s = time.perf_counter() - started
            log.info("%s: %d steps, loss %.3f, %.0f s%s", name, r.result.steps,
                     r.result.final["loss"], train_s, " (cached)" if r.reused else "")
            if target is None:
                _, prompts = heldout_prompts(storage, steps, args.prompts)
                ids = [list(p.prompt_ids) for p in prompts]
                local = storage.download_dir(policy_prefix(step), Path(tmp) / "policy")
                target = AutoModelForCausalLM.from_pretrained(str(local), dtype=torch.float32)
            embed = target.get_input_embeddings().weight.detach()
            export = storage.download_dir(drafter_prefix(step), Path(tmp) / name)
            model = algorithm(name).load(export, embed, dtype=torch.float32,
                                         head=target.get_output_embeddings().weight.detach())
            own = serving_of(read_config(export), params, str(export))[1]
            entry = {"step": step, "train_steps": r.result.steps, "spec": str(own),
                     "draft_forwards_per_cycle": 1 if name == "dflash" else own.num_steps,
                     "layers": r.result.drafter_config.get("dflash_config", {}).get(
                         "target_layer_ids") or r.result.drafter_config.get(
                         "eagle_config", {}).get("eagle_aux_hidden_state_layer_ids"),
                     "train_s": None if r.reused else round(train_s, 1),
                     "final_loss": r.result.final["loss"], "regimes": {}}
            for sampler in samplers:
                run = evaluate(target, model, ids, own, max_new_tokens=args.max_new_tokens,
                               eos_token_id=target.config.eos_token_id, sampler=sampler,
                               seed=args.seed)
                entry["regimes"][sampler.label] = {
                    "tau": run.stats.tau, "interval": list(tau_interval(run.per_prompt)),
                    "cycles": run.stats.cycles}
                log.info("%s %s: tau %.3f %s", name, sampler.label, run.stats.tau,
                         entry["regimes"][sampler.label]["interval"])
            out["algorithms"][name] = entry
    out["prompts"] = len(ids or [])
    print(table(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


def table(out: dict) -> str:
    regimes = next(iter(out["algorithms"].values()))["regimes"]
    head = ("| algorithm | drafts (spec) | draft forwards / cycle | training | "
            + " | ".join(f"τ {r}" for r in regimes) + " |")
    lines = [head, "|" + "---|" * (4 + len(regimes))]
    for name, e in out["algorithms"].items():
        cells = [f"{v['tau']:.3f} [{v['interval'][0]:.2f}, {v['interval'][1]:.2f}]"
                 for v in e["regimes"].values()]
        seconds = "cached" if e["train_s"] is None else f"{e['train_s']:.0f} s"
        lines.append(f"| {name} | {e['spec']} | {e['draft_forwards_per_cycle']} | "
                     f"{e['train_steps']} steps, {seconds} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
