"""FP8 shards on the demo world: bytes per token, and τ of a drafter trained on them vs bf16.

    python bench/fp8_shards.py [--storage DIR] [--work DIR] [--window 4] [--prompts 32]
        [--max-new-tokens 160] [--spec 5,1,6] [--temperatures 0,1] [--seed 0] [--json out]

Needs the demo world ingested (``aerie demo``; default storage: the embedded default's),
copied per encoding into ``--work`` so the user's state is never touched. For each encoding
(``bfloat16``, ``fp8-aux``, ``fp8``) the newest ``--window`` RL steps are extracted again
with the configuration their manifests recorded, only ``encoding`` changed, and a drafter
is trained from scratch on them with the demo preset and the same seed (same batches, same
optimizer steps). Each drafter is then evaluated with the same engine on the same held-out
prompts of the window (prompts no drafter trained on): τ = tokens per draft-verify cycle,
with its 95% bootstrap interval over prompts.

Bytes per token are the committed shard files (zstd) over the window's tokens, beside the
raw state bytes and what the per-sample ``torch.save`` format of other EAGLE-3 pipelines
(one ``.pt`` file per sample holding ``input_ids``, ``loss_mask``, ``hidden_state`` and
``aux_hidden_state`` in bf16) takes for the same samples; that format is only measured here,
never written to storage.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from drift_curve import train, train_config  # noqa: E402

log = logging.getLogger("bench.fp8_shards")
ENCODINGS = ("bfloat16", "fp8-aux", "fp8")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--storage", type=Path, default=None)
    p.add_argument("--work", type=Path, default=Path("/tmp/aerie-fp8-bench"))
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--spec", default="5,1,6")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def extract(storage, step: int, encoding: str):
    from pipeline.capture import stage as capture_stage
    from pipeline.capture.backends import open_backend
    from pipeline.capture.config import ExtractConfig
    from pipeline.capture.shards import read_shards_manifest
    from pipeline.snapshot.policy import load_policy_ref

    recorded = read_shards_manifest(storage, step).meta["config"]
    config = ExtractConfig(**{**recorded, "encoding": encoding})
    with open_backend(storage, step, "hf", token_budget=config.token_budget) as backend:
        return capture_stage.run(storage, step, backend, config,
                                 policy=load_policy_ref(storage, step))


def torch_save_bytes(storage, steps) -> int:
    """Bytes of one ``torch.save`` file per sample, the per-sample format (measured only)."""
    import torch

    from pipeline.capture.shards import iter_step

    total = 0
    for step in steps:
        for s in iter_step(storage, step):
            buf = io.BytesIO()
            torch.save({"input_ids": s.input_ids.long(), "loss_mask": s.loss_mask.long(),
                        "hidden_state": s.final_hidden.clone(),
                        "aux_hidden_state": s.aux_hidden.clone()}, buf)
            total += buf.tell()
    return total


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import torch

    from pipeline.capture.heldout import heldout_prompts
    from pipeline.capture.shards import ShardSpec, read_shards_manifest
    from pipeline.eagle3.export import load_drafter
    from pipeline.eagle3.spec import SpecParams
    from pipeline.evaluation.confidence import tau_interval
    from pipeline.evaluation.engine import evaluate
    from pipeline.layout import policy_prefix
    from pipeline.sampling import SamplingParams
    from pipeline.storage import Storage
    from resources.home import aerie_home

    torch.set_num_threads(args.threads)
    source = args.storage or aerie_home() / "storage"
    params = SpecParams(*(int(x) for x in args.spec.split(",")))
    samplers = [SamplingParams(float(t)) for t in args.temperatures.split(",")]
    out: dict = {"window": args.window, "spec": str(params), "seed": args.seed,
                 "encodings": {}}
    stores = {}
    for encoding in ENCODINGS:
        root = args.work / encoding
        if not root.exists():
            args.work.mkdir(parents=True, exist_ok=True)
            shutil.copytree(source, root, ignore=shutil.ignore_patterns("drafters", "vocab",
                                                                         "evals", "serving"))
        storage = stores[encoding] = Storage(root.as_uri())
        steps = sorted(int(d.split("=")[1]) for d in storage.list_dirs("shards"))
        last = steps[-1]
        window = steps[-args.window:]
        started = time.perf_counter()
        summaries = [extract(storage, s, encoding) for s in window]
        tokens = sum(s.tokens for s in summaries)
        m = read_shards_manifest(storage, last)
        spec = ShardSpec(step=last, hidden_size=m.meta["hidden_size"],
                         aux_layer_ids=tuple(m.meta["aux_layer_ids"]), encoding=encoding)
        row = {"extract_s": round(time.perf_counter() - started, 1), "tokens": tokens,
               "file_bytes_per_token": sum(s.bytes for s in summaries) / tokens,
               "state_bytes_per_token": spec.state_bytes_per_token}
        if encoding == "bfloat16":
            row["torch_save_bytes_per_token"] = torch_save_bytes(storage, window) / tokens
        started = time.perf_counter()
        prefix, run = train(storage, last, args.window, replace(train_config(), seed=args.seed),
                            "none", args.work / f"{encoding}-work")
        row.update(train_s=round(time.perf_counter() - started, 1), steps=run.result.steps,
                   final_loss=run.result.final["loss"], drafter=prefix)
        out["encodings"][encoding] = row
        out["last"], out["window_steps"] = last, window

    bf16 = stores["bfloat16"]
    _, prompts = heldout_prompts(bf16, out["window_steps"], args.prompts)
    ids = [list(p.prompt_ids) for p in prompts]
    out["prompts"] = len(ids)
    local = bf16.download_dir(policy_prefix(out["last"]), args.work / "policy")
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(local), dtype=torch.float32)
    embed = target.get_input_embeddings().weight.detach()
    for encoding, row in out["encodings"].items():
        drafter = load_drafter(stores[encoding].download_dir(
            row["drafter"], args.work / f"{encoding}-drafter"), embed, dtype=torch.float32)
        for sampler in samplers:
            run = evaluate(target, drafter, ids, params, max_new_tokens=args.max_new_tokens,
                           eos_token_id=target.config.eos_token_id, sampler=sampler,
                           seed=args.seed)
            row[f"tau_{sampler.slug}"] = run.stats.tau
            row[f"interval_{sampler.slug}"] = tau_interval(run.per_prompt)
    base = out["encodings"]["bfloat16"]
    print(f"window {out['window_steps']}, {out['prompts']} held-out prompts, spec {params}")
    print("| encoding | file B/token | vs bf16 | state B/token | train steps | "
          + " | ".join(f"τ {s.label} (95% CI) | vs bf16" for s in samplers) + " |")
    for encoding, row in out["encodings"].items():
        taus = " | ".join(
            f"{row[f'tau_{s.slug}']:.3f} ({row[f'interval_{s.slug}'][0]:.3f}–"
            f"{row[f'interval_{s.slug}'][1]:.3f}) | "
            f"{row[f'tau_{s.slug}'] / base[f'tau_{s.slug}']:.1%}" for s in samplers)
        print(f"| {encoding} | {row['file_bytes_per_token']:.0f} | "
              f"{row['file_bytes_per_token'] / base['file_bytes_per_token']:.2f}x | "
              f"{row['state_bytes_per_token']} | {row['steps']} | {taus} |")
    print(f"per-sample torch.save: {base['torch_save_bytes_per_token']:.0f} B/token")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
