"""Data-parallel hf extraction: one RL step extracted by 2 processes vs 1, on the CPU.

    python bench/parallel_extraction.py [--storage DIR] [--work DIR] [--step N] [--shards 8]
        [--repeats 3] [--hidden 0 --layers 0 --intermediate 0] [--json out]

Needs the demo world ingested (``aerie demo``; default storage: the embedded default's).
The step's policy and tokenized rollouts are copied into ``--work``, so the user's state is
never touched. ``shard_bytes`` is set so the step cuts into ``--shards`` shards (a step
is split between processes shard by shard). ``--hidden``/``--layers``/``--intermediate``
replace the demo policy with a randomly initialised Llama of that shape (same vocabulary
and tokens), to see where the split starts to pay.

Each run starts from an empty shards directory and is timed end to end as Dagster runs it
(``capture.parallel.run``: open the backend in this process, start the child, both parts,
the commit pass), child start-up (Python, torch, transformers, loading the policy)
included. One process uses every core for torch; two use half each. Runs of 1 and 2
processes alternate; the median of ``--repeats`` is reported, with whether both wrote
byte-identical shards.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--storage", type=Path, default=None)
    p.add_argument("--work", type=Path, default=Path("/tmp/aerie-parallel-bench"))
    p.add_argument("--step", type=int, default=None, help="default: the newest step")
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hidden", type=int, default=0)
    p.add_argument("--layers", type=int, default=0)
    p.add_argument("--intermediate", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def world(source: Path, work: Path, step: int, args: argparse.Namespace) -> Path:
    """A storage root holding only ``step``'s policy (replaced by a random one of the asked
    shape, if any) and tokenized rollouts."""
    from pipeline.layout import policy_prefix, tokenized_prefix

    root = work / "storage"
    shutil.rmtree(work, ignore_errors=True)
    for prefix in (policy_prefix(step), tokenized_prefix(step)):
        shutil.copytree(source / prefix, root / prefix)
    if args.hidden:
        reshape_policy(root, step, args)
    return root


def reshape_policy(root: Path, step: int, args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    from pipeline.layout import policy_prefix
    from pipeline.snapshot.policy import publish_policy
    from pipeline.storage import Storage

    demo = root / policy_prefix(step)
    config = AutoConfig.from_pretrained(demo)
    config.hidden_size, config.num_hidden_layers = args.hidden, args.layers
    config.intermediate_size = args.intermediate or 3 * args.hidden
    config.head_dim = args.hidden // config.num_attention_heads
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    staged = root.parent / "reshaped"
    model.save_pretrained(staged)
    for name in os.listdir(demo):  # keep the tokenizer files
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            shutil.copy(demo / name, staged / name)
    shutil.rmtree(demo)
    publish_policy(Storage(root.as_uri()), step, staged)


def extract_once(root: Path, step: int, processes: int, shard_bytes: int) -> dict:
    import torch

    from pipeline.capture import parallel
    from pipeline.capture.backends import open_backend
    from pipeline.capture.config import ExtractConfig
    from pipeline.layout import shards_prefix
    from pipeline.snapshot.policy import load_policy_ref
    from pipeline.storage import Storage

    shutil.rmtree(root / shards_prefix(step), ignore_errors=True)
    storage = Storage(root.as_uri())
    config = ExtractConfig(shard_bytes=shard_bytes)
    open_args = {"kind": "hf", "token_budget": config.token_budget,
                 "options": {"device": "cpu"}}
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    started, cpu = time.perf_counter(), time.process_time()
    with open_backend(storage, step, **open_args) as backend:
        summary = parallel.run(storage, step, backend, config, processes=processes,
                               open_args=open_args, policy=load_policy_ref(storage, step))
    wall = time.perf_counter() - started
    manifest = json.loads((root / shards_prefix(step) / "_manifest.json").read_text())
    return {"wall_s": wall, "parent_cpu_s": time.process_time() - cpu,
            "tokens": summary.tokens, "shards": summary.shards,
            "files": [[f["path"], f["sha256"]] for f in manifest["files"]]}


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from pipeline.capture.shards import ShardSpec
    from resources.home import aerie_home

    source = args.storage or aerie_home() / "storage"
    steps = sorted(int(d.name.split("=")[1]) for d in (source / "tokenized").iterdir())
    step = args.step if args.step is not None else steps[-1]
    root = world(source, args.work, step, args)
    config = json.loads((root / f"policies/step={step:06d}/config.json").read_text())
    spec = ShardSpec(step=step, hidden_size=config["hidden_size"], aux_layer_ids=(0, 1, 2))
    tokens = json.loads((root / f"tokenized/step={step:06d}/_manifest.json").read_text())[
        "meta"].get("tokens") or extract_once(root, step, 1, 1 << 40)["tokens"]
    shard_bytes = spec.state_bytes_per_token * -(-int(tokens * 0.8) // args.shards)

    runs: dict[int, list[dict]] = {1: [], 2: []}
    extract_once(root, step, 1, shard_bytes)  # warm the page cache and imports
    for _ in range(args.repeats):
        for processes in (1, 2):
            runs[processes].append(extract_once(root, step, processes, shard_bytes))
    med = {p: statistics.median(r["wall_s"] for r in rs) for p, rs in runs.items()}
    out = {
        "step": step, "hidden_size": config["hidden_size"],
        "layers": config["num_hidden_layers"], "tokens": runs[1][0]["tokens"],
        "shards": runs[1][0]["shards"], "cores": len(os.sched_getaffinity(0)),
        "repeats": args.repeats,
        "wall_s": {p: [round(r["wall_s"], 2) for r in rs] for p, rs in runs.items()},
        "median_wall_s": {p: round(v, 2) for p, v in med.items()},
        "tokens_per_s": {p: round(runs[1][0]["tokens"] / v) for p, v in med.items()},
        "speedup_2_vs_1": round(med[1] / med[2], 2),
        "identical_bytes": all(r["files"] == runs[1][0]["files"]
                               for rs in runs.values() for r in rs),
    }
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
