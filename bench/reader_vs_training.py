"""Benchmark: the training reader (shards → teacher targets → TTT batches) vs training itself.

Run from the repository root:

    python bench/reader_vs_training.py              # demo-like shape, prints markdown
    python bench/reader_vs_training.py --json out.json

Builds a demo-like window in a temporary storage (random Llama target H=128, 4 layers,
V=1536; K steps × 128 samples of 80–240 tokens, response masked from ~40%; shards captured by
the hf backend through ``capture.stage.run``), picks a draft vocab of 1024, and measures:

1. reader samples/s: ``WindowReader`` over one epoch, each micro batch collated with
   :func:`pipeline.eagle3.ttt_batch.collate` (right padding + teacher logits over the draft vocab +
   full-vocab argmax from ``final_hidden`` and the target ``lm_head``) — the whole data path a
   training step waits for; median of ``--repeats`` epochs;
2. training samples/s: a real training run (``launch``: child process, DeepSpeed ZeRO-2, fp32,
   TTT depth 7, AdamW) over the same window, as reported by the run (its loop time, which
   includes its own reading).

The ratio 1 / 2 says how much faster the reader is than training consumes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.capture import stage as capture_stage
from pipeline.capture.config import ExtractConfig
from pipeline.capture.hf import HFCaptureBackend  # noqa: E402
from pipeline.capture.window import load_target, read_window  # noqa: E402
from pipeline.contracts import Manifest  # noqa: E402
from pipeline.eagle3.ttt_batch import collate
from pipeline.layout import tokenized_prefix
from pipeline.manifest import entry_for, write_manifest  # noqa: E402
from pipeline.parquet import write_table  # noqa: E402
from pipeline.snapshot.policy import load_policy_ref, publish_policy  # noqa: E402
from pipeline.storage import Storage  # noqa: E402
from pipeline.tokenize.schema import TOKENIZED_KIND, TOKENIZED_SCHEMA
from pipeline.training.config import TrainConfig  # noqa: E402
from pipeline.training.data import Position, WindowReader  # noqa: E402
from pipeline.training.launch import launch  # noqa: E402
from pipeline.training.stage import plan  # noqa: E402
from pipeline.vocab import stage as vocab_stage
from pipeline.vocab.stage import load_window_vocab


def build_window(root: Path, steps: int, samples: int, hidden: int, vocab: int) -> Storage:
    storage = Storage(root.as_uri())
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
        tie_word_embeddings=False)).eval()
    model.save_pretrained(root.parent / "policy")
    backend = HFCaptureBackend(model, token_budget=8192)
    rng = np.random.default_rng(0)
    for step in range(1, steps + 1):
        publish_policy(storage, step, root.parent / "policy")
        rows = []
        for i in range(samples):
            t = int(rng.integers(80, 241))
            start = int(t * rng.uniform(0.3, 0.5))
            rows.append({"sample_id": f"{step}-{i}", "step": step,
                         "input_ids": rng.integers(0, vocab, t).tolist(),
                         "loss_mask": [int(j >= start) for j in range(t)]})
        prefix = tokenized_prefix(step)
        table = pa.Table.from_pylist(rows, schema=TOKENIZED_SCHEMA)
        written = write_table(storage, f"{prefix}/part-00000.parquet", table)
        write_manifest(storage, prefix, Manifest(
            kind=TOKENIZED_KIND, kind_version=1,
            files=(entry_for(prefix, written, rows=len(rows)),), meta={"step": step}))
        capture_stage.run(storage, step, backend, ExtractConfig(token_budget=8192),
                     policy=load_policy_ref(storage, step))
    return storage


def reader_rate(storage: Storage, steps: int, config: TrainConfig) -> tuple[float, float]:
    """(samples/s with teacher targets, samples/s reading only) over one epoch."""
    manifests = read_window(storage, list(range(1, steps + 1)))
    _, mapping = load_window_vocab(storage, steps)
    lm_head = load_target(storage, steps).lm_head
    reader = WindowReader(storage, manifests, micro_batch_size=config.micro_batch_size,
                          shuffle_buffer=config.shuffle_buffer, seed=0,
                          max_length=config.max_length)
    t0 = time.perf_counter()
    n = 0
    for _, samples in reader.iter_micro_batches(Position(0, 0)):
        collate(samples, lm_head, mapping.t2d)
        n += len(samples)
    with_teacher = n / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    n = sum(len(s) for _, s in reader.iter_micro_batches(Position(1, 0)))
    return with_teacher, n / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="RL steps in the window (K)")
    parser.add_argument("--samples", type=int, default=128, help="samples per step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train-steps", type=int, default=40)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = TrainConfig(micro_batch_size=8, max_steps=args.train_steps, threads=args.threads,
                         ttt_depth=7, checkpoint_every=10_000, log_every=10)
    with tempfile.TemporaryDirectory(prefix="aerie-bench-") as tmp:
        storage = build_window(Path(tmp) / "storage", args.steps, args.samples, 128, 1536)
        vocab_stage.run(storage, args.steps, args.steps, 1024)
        rates = [reader_rate(storage, args.steps, config) for _ in range(args.repeats)]
        teacher = statistics.median(r[0] for r in rates)
        plain = statistics.median(r[1] for r in rates)
        result = launch(plan(storage, args.steps, config, Path(tmp) / "work", "none"))
    train = result.samples_per_s
    numbers = {"window_samples": result.samples, "reader_samples_per_s": teacher,
               "reader_no_teacher_samples_per_s": plain, "train_samples_per_s": train,
               "train_tokens_per_s": result.tokens_per_s, "ratio": teacher / train,
               "threads": args.threads, "train_steps": result.steps,
               "micro_batch_size": config.micro_batch_size, "ttt_depth": config.ttt_depth}
    sys.stdout.write(
        "| path | samples/s |\n|---|---|\n"
        f"| reader + teacher targets + collate | {teacher:,.0f} |\n"
        f"| reader only (shards → samples) | {plain:,.0f} |\n"
        f"| training (ZeRO-2 fp32, TTT 7, 1 process) | {train:,.1f} |\n\n"
        f"reader / training = {teacher / train:,.1f}× "
        f"(training {result.tokens_per_s:,.0f} tokens/s, {result.samples} window samples)\n")
    if args.json:
        args.json.write_text(json.dumps(numbers, indent=2))


if __name__ == "__main__":
    main()
