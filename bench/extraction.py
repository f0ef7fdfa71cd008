"""Benchmark: hidden-state extraction (hf backend) and shard I/O on CPU.

Run from the repository root:

    python bench/extraction.py                 # default shape, 2 threads, prints markdown
    python bench/extraction.py --json out.json # also dump the numbers

Measures, on a random Llama (default H=512, 8 layers) and random token ids:

1. extraction time (``capture.stage.run``: read tokenized parts, capture, validate, bf16, write
   Parquet + markers + manifest) vs a bare ``model.model(...)`` forward over exactly the
   same padded batches (recorded from the extraction run) — the overhead ratio;
2. shard write and read throughput (bf16 state bytes/s and tokens/s) for zstd and
   uncompressed shards, next to per-sample ``torch.save`` / ``torch.load(weights_only=True)``
   dicts (the SpecForge offline format);
3. bytes per token on disk for each;
4. peak RSS (VmHWM, reset right before extraction) and Arrow pool peak at 1× and 8× data,
   each in a fresh subprocess.

Timings interleave the two sides and report the median of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.capture import stage as capture_stage
from pipeline.capture.config import ExtractConfig
from pipeline.capture.hf import HFCaptureBackend  # noqa: E402
from pipeline.capture.shards import (
    ShardSample,
    ShardSpec,
    iter_shard,
    iter_step,
    read_shards_manifest,
    write_shard,
)
from pipeline.layout import shards_prefix
from pipeline.storage import Storage  # noqa: E402
from pipeline.tokenize.schema import commit_rows  # noqa: E402

STEP = 1


def build_model(args: argparse.Namespace):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.heads,
                         max_position_embeddings=4096)
    return LlamaForCausalLM(config).eval()


def write_tokenized(storage: Storage, n: int, args: argparse.Namespace) -> int:
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        t = int(rng.integers(args.min_len, args.max_len + 1))
        rows.append({"sample_id": f"s{i}", "step": STEP,
                     "input_ids": rng.integers(0, args.vocab, t).tolist(),
                     "loss_mask": (rng.random(t) < 0.6).astype(int).tolist()})
    return commit_rows(storage, STEP, rows)


class Timed:
    """Backend wrapper: records the batches it is given and the time spent capturing."""

    def __init__(self, inner: HFCaptureBackend):
        self.inner = inner
        self.hidden_size, self.aux_layer_ids = inner.hidden_size, inner.aux_layer_ids
        self.batches: list[list[list[int]]] = []
        self.seconds = 0.0

    def describe(self):
        return self.inner.describe()

    def capture(self, batch):
        self.batches.append([list(ids) for ids in batch])
        t0 = time.perf_counter()
        out = self.inner.capture(batch)
        self.seconds += time.perf_counter() - t0
        return out


def padded(batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    t = max(map(len, batch))
    ids = torch.zeros((len(batch), t), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(batch):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


def bare_forward(model, tensors) -> tuple[float, float]:
    """Wall and process-CPU seconds of the bare base-model forward over ``tensors``."""
    w0, c0 = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        for ids, mask in tensors:
            model.model(input_ids=ids, attention_mask=mask, use_cache=False)
    return time.perf_counter() - w0, time.process_time() - c0


def per_batch_capture_overhead(model, batches, tensors, args) -> float:
    """Σ over batches of min-of-3 capture time / Σ min-of-3 bare time, interleaved per
    batch: the hooks + bf16 copy-out cost, robust to load drifting between long runs."""
    backend = HFCaptureBackend(model, output_dtype=torch.bfloat16,
                               token_budget=args.token_budget)
    cap_total = bare_total = 0.0
    for batch, (ids, mask) in zip(batches, tensors, strict=True):
        caps, bares = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.model(input_ids=ids, attention_mask=mask, use_cache=False)
            bares.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            backend.capture(batch)
            caps.append(time.perf_counter() - t0)
        cap_total += min(caps)
        bare_total += min(bares)
    return cap_total / bare_total


def overhead(model, args, workdir: Path) -> dict:
    config = ExtractConfig(token_budget=args.token_budget, compression=args.compression)
    runs = []  # (extract wall, extract cpu, bare wall, bare cpu, capture wall)
    tensors = batches = None
    storage = summary = None
    tokens = 0
    for r in range(args.repeats + 1):  # run 0 warms up both sides and is not counted
        storage = Storage((workdir / f"run{r}").as_uri())
        tokens = write_tokenized(storage, args.samples, args)
        backend = Timed(HFCaptureBackend(model, output_dtype=torch.bfloat16,
                                         token_budget=args.token_budget))
        w0, c0 = time.perf_counter(), time.process_time()
        summary = capture_stage.run(storage, STEP, backend, config)
        ext_wall, ext_cpu = time.perf_counter() - w0, time.process_time() - c0
        if tensors is None:
            batches = backend.batches
            tensors = [padded(b) for b in batches]
        bare_wall, bare_cpu = bare_forward(model, tensors)
        if r > 0:
            runs.append((ext_wall, ext_cpu, bare_wall, bare_cpu, backend.seconds))
    ext_w, ext_c, bare_w, bare_c, cap_w = zip(*runs, strict=True)
    return {"tokens": tokens, "padded_tokens": summary.padded_tokens,
            "batches": len(tensors), "shards": summary.shards,
            "extract_s": min(ext_w), "bare_s": min(bare_w),
            "ratio_min": min(ext_w) / min(bare_w),
            "ratio_median_pairs": statistics.median(e / b for e, b in zip(ext_w, bare_w,
                                                                           strict=True)),
            "ratio_cpu": min(ext_c) / min(bare_c),
            "capture_ratio": min(cap_w) / min(bare_w),
            "capture_ratio_per_batch": per_batch_capture_overhead(model, batches, tensors,
                                                                  args),
            "extract_runs": list(ext_w), "bare_runs": list(bare_w),
            "storage": storage.root_url, "shard_bytes": summary.bytes}


def io_throughput(storage: Storage, args, workdir: Path) -> dict:
    """Write/read MB/s of bf16 state bytes for Parquet shards and per-sample torch.save."""
    rows = [ShardSample(s.sample_id, s.step, s.input_ids.clone(), s.loss_mask.clone(),
                        s.aux_hidden.clone(), s.final_hidden.clone())
            for s in iter_step(storage, STEP)]
    manifest = read_shards_manifest(storage, STEP)
    h = manifest.meta["hidden_size"]
    spec = ShardSpec(step=STEP, hidden_size=h, aux_layer_ids=tuple(manifest.meta[
        "aux_layer_ids"]))
    tokens = sum(r.num_tokens for r in rows)
    state_mb = tokens * spec.state_bytes_per_token / 1e6
    out: dict = {"tokens": tokens, "state_mb": state_mb, "hidden_size": h}
    for codec in ("zstd", "none"):
        st = Storage((workdir / f"io-{codec}").as_uri())
        key = f"{shards_prefix(STEP)}/shard-00000.parquet"
        writes, reads = [], []
        for _ in range(args.io_repeats):
            t0 = time.perf_counter()
            written = write_shard(st, key, spec, rows, compression=codec)
            writes.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            n = 0
            for s in iter_shard(st, key):
                n += s.aux_hidden.shape[0]  # tensors are handed out; nothing is copied
            reads.append(time.perf_counter() - t0)
            assert n == tokens
        w, r = min(writes), min(reads)
        out[codec] = {"bytes": written.obj.bytes, "bytes_per_token": written.obj.bytes / tokens,
                      "write_mb_s": state_mb / w, "read_mb_s": state_mb / r,
                      "write_tok_s": tokens / w, "read_tok_s": tokens / r}
    # the SpecForge offline format: one torch.save'd dict per sample (int64 ids and mask)
    pt_dir = workdir / "torch-save"
    pt_dir.mkdir()
    writes, reads = [], []
    for _ in range(args.io_repeats):
        t0 = time.perf_counter()
        for i, s in enumerate(rows):
            torch.save({"input_ids": s.input_ids.long(), "loss_mask": s.loss_mask.long(),
                        "hidden_state": s.final_hidden, "aux_hidden_state": s.aux_hidden},
                       pt_dir / f"data_{i}.ckpt")
        writes.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(len(rows)):
            torch.load(pt_dir / f"data_{i}.ckpt", weights_only=True)
        reads.append(time.perf_counter() - t0)
    size = sum(p.stat().st_size for p in pt_dir.iterdir())
    w, r = min(writes), min(reads)
    out["torch_save"] = {"bytes": size, "bytes_per_token": size / tokens,
                         "write_mb_s": state_mb / w, "read_mb_s": state_mb / r,
                         "write_tok_s": tokens / w, "read_tok_s": tokens / r}
    return out


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def memory_child(args: argparse.Namespace) -> None:
    """One extraction at ``--scale``× data in this fresh process; prints JSON."""
    model = build_model(args)
    backend = HFCaptureBackend(model, output_dtype=torch.bfloat16,
                               token_budget=args.token_budget)
    with tempfile.TemporaryDirectory() as tmp:
        storage = Storage(Path(tmp).as_uri())
        tokens = write_tokenized(storage, args.samples * args.scale, args)
        config = ExtractConfig(token_budget=args.token_budget,
                               shard_bytes=args.mem_shard_mb << 20,
                               row_group_bytes=args.mem_row_group_mb << 20,
                               compression=args.compression)
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS watermark
        base = _status("VmRSS")
        t0 = time.perf_counter()
        summary = capture_stage.run(storage, STEP, backend, config)
        seconds = time.perf_counter() - t0
        print(json.dumps({"scale": args.scale, "tokens": tokens, "shards": summary.shards,
                          "state_mb": tokens * 8 * args.hidden / 1e6,
                          "rss_before_mb": base / 1e6, "peak_rss_mb": _status("VmHWM") / 1e6,
                          "peak_over_base_mb": (_status("VmHWM") - base) / 1e6,
                          "arrow_pool_peak_mb": pa.default_memory_pool().max_memory() / 1e6,
                          "seconds": seconds}))


def memory(args: argparse.Namespace) -> list[dict]:
    results = []
    for scale in (1, 8):
        cmd = [sys.executable, __file__, "--memory-child", "--scale", str(scale),
               *_shape_args(args)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return results


def _shape_args(args: argparse.Namespace) -> list[str]:
    keys = ("hidden", "layers", "intermediate", "heads", "vocab", "samples", "min_len",
            "max_len", "threads", "token_budget", "mem_shard_mb", "mem_row_group_mb", "compression")
    return [a for k in keys for a in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]


def report(args, ov: dict, io: dict, mem: list[dict]) -> str:
    h = io["hidden_size"]
    lines = [
        f"Shape: Llama H={args.hidden}, {args.layers} layers, intermediate "
        f"{args.intermediate}, {args.heads} heads, vocab {args.vocab}, fp32 compute, bf16 "
        f"states; {args.samples} samples of {args.min_len}–{args.max_len} tokens "
        f"({ov['tokens']} tokens, {ov['padded_tokens']} padded, {ov['batches']} batches under a "
        f"{args.token_budget}-token budget, {ov['shards']} shard(s)); "
        f"torch threads {args.threads}; {args.repeats} timed runs after a warm-up.",
        "",
        "| measure | value |",
        "|---|---|",
        f"| extraction (capture.stage.run end to end), best run | {ov['extract_s']:.2f} s |",
        f"| bare `model.model(...)` forward on the same padded batches, best run | "
        f"{ov['bare_s']:.2f} s |",
        f"| **overhead ratio**, best / best (wall) | **{ov['ratio_min']:.3f}×** |",
        f"| overhead ratio, median of paired runs (wall) | {ov['ratio_median_pairs']:.3f}× |",
        f"| overhead ratio, process CPU time, best / best | {ov['ratio_cpu']:.3f}× |",
        f"| capture only (hooks + bf16 copy-out) / bare, per batch interleaved, min of 3 | "
        f"{ov['capture_ratio_per_batch']:.3f}× |",
        f"| extraction runs (s) | {', '.join(f'{x:.2f}' for x in ov['extract_runs'])} |",
        f"| bare runs (s) | {', '.join(f'{x:.2f}' for x in ov['bare_runs'])} |",
        "",
        f"Shard I/O over {io['tokens']} tokens ({io['state_mb']:.1f} MB of bf16 states; "
        f"MB/s counts those state bytes; best of {args.io_repeats}):",
        "",
        "| format | bytes/token | write MB/s | write tok/s | read MB/s | read tok/s |",
        "|---|---|---|---|---|---|",
    ]
    for name, key in (("Parquet shard, zstd (default)", "zstd"),
                      ("Parquet shard, uncompressed", "none"),
                      ("per-sample torch.save dict", "torch_save")):
        r = io[key]
        lines.append(f"| {name} | {r['bytes_per_token']:.0f} | {r['write_mb_s']:.0f} | "
                     f"{r['write_tok_s']:.0f} | {r['read_mb_s']:.0f} | {r['read_tok_s']:.0f} |")
    lines += [f"| (8H+16 = {8 * h + 16}: the torch.save payload without pickle framing) | "
              f"{8 * h + 16} | | | | |", "",
              f"Peak memory of extraction (fresh process; shard {args.mem_shard_mb} MiB, row "
              f"group {args.mem_row_group_mb} MiB; RSS watermark reset just before "
              "`capture.stage.run`):", "",
              "| data | tokens | bf16 states | shards | peak RSS − RSS before | peak RSS | "
              "Arrow pool peak | time |",
              "|---|---|---|---|---|---|---|---|"]
    for m in mem:
        lines.append(f"| {m['scale']}× | {m['tokens']} | {m['state_mb']:.0f} MB | "
                     f"{m['shards']} | {m['peak_over_base_mb']:.0f} MB | "
                     f"{m['peak_rss_mb']:.0f} MB | {m['arrow_pool_peak_mb']:.0f} MB | "
                     f"{m['seconds']:.1f} s |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--token-budget", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--io-repeats", type=int, default=5)
    p.add_argument("--compression", default="zstd")
    p.add_argument("--mem-shard-mb", type=int, default=32)
    p.add_argument("--mem-row-group-mb", type=int, default=8)
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--json", type=Path)
    p.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--scale", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_child:
        memory_child(args)
        return
    print(f"load average before: {os.getloadavg()}", file=sys.stderr)
    model = build_model(args)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        ov = overhead(model, args, workdir)
        io = io_throughput(Storage(ov["storage"]), args, workdir)
    mem = [] if args.skip_memory else memory(args)
    print(f"load average after: {os.getloadavg()}", file=sys.stderr)
    print(report(args, ov, io, mem))
    if args.json:
        args.json.write_text(json.dumps({"overhead": ov, "io": io, "memory": mem}, indent=2))


if __name__ == "__main__":
    main()
