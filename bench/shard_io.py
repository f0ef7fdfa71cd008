"""Shard bytes per token and write/read throughput at a real width, per encoding.

    python bench/shard_io.py --hidden 4096 --samples 16 --tokens 512 --reps 3 --json out.json

Synthetic states (``--samples`` samples of ``--tokens`` tokens, three aux layers of width
``--hidden`` plus the final state; heavy-tailed like activations: N(0, 1) times a per-channel
scale drawn from a log-normal, rounded to bf16) written as one shard per way and read back
whole, timed in wall seconds (median of ``--reps``, ways interleaved):

- Aerie's shards in ``bfloat16``, ``fp8-aux`` and ``fp8``, each with zstd and uncompressed;
- the per-sample ``torch.save`` format of other EAGLE-3 pipelines (one file per sample:
  ``input_ids``, ``loss_mask``, ``hidden_state``, ``aux_hidden_state`` in bf16), read with
  ``torch.load(weights_only=True)``: measured only, never Aerie's storage format.

Throughput is counted in tokens/s and in bf16-equivalent state bytes/s (what the states
are worth before encoding), so the ways compare on the same work. For the fp8 encodings it
also prints the decoded states' relative RMS error and the share of non-zero values that
decode to zero (small channels under a token's large scale).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.capture.shards import ShardSample, ShardSpec, iter_shard, write_shard  # noqa: E402
from pipeline.storage import Storage  # noqa: E402

AUX_IDS = (1, 15, 28)


def samples(n: int, tokens: int, hidden: int, seed: int) -> list[ShardSample]:
    g = torch.Generator().manual_seed(seed)
    channel = torch.exp(torch.randn(4 * hidden, generator=g))  # a few channels dominate
    out = []
    for i in range(n):
        states = (torch.randn(tokens, 4 * hidden, generator=g) * channel).to(torch.bfloat16)
        out.append(ShardSample(f"s{i}", 0, torch.arange(tokens, dtype=torch.int32),
                               torch.ones(tokens, dtype=torch.bool),
                               states[:, :3 * hidden].contiguous(),
                               states[:, 3 * hidden:].contiguous()))
    return out


def shard_way(storage: Storage, rows: list[ShardSample], hidden: int, encoding: str,
              compression: str) -> tuple[Callable[[], int], Callable[[], int]]:
    spec = ShardSpec(step=0, hidden_size=hidden, aux_layer_ids=AUX_IDS, encoding=encoding)
    key = f"bench/{encoding}-{compression}.parquet"

    def write() -> int:
        return write_shard(storage, key, spec, rows, compression=compression).obj.bytes

    def read() -> int:
        return sum(s.num_tokens for s in iter_shard(storage, key))

    return write, read


def relative_error(storage: Storage, key: str, rows: list[ShardSample]) -> dict[str, float]:
    """RMS error of the decoded states over their RMS, aux and final, and the share of
    values that decode to zero although they are not (lost under their token's scale)."""
    err = {"aux": [0.0, 0.0], "final": [0.0, 0.0]}
    flushed = total = 0
    for original, back in zip(rows, iter_shard(storage, key), strict=True):
        for name, a, b in (("aux", original.aux_hidden, back.aux_hidden),
                           ("final", original.final_hidden, back.final_hidden)):
            a, b = a.float(), b.float()
            err[name][0] += float(((b - a) ** 2).sum())
            err[name][1] += float((a ** 2).sum())
            flushed += int(((b == 0) & (a != 0)).sum())
            total += a.numel()
    out = {f"{n}_rel_rms_error": (e / s) ** 0.5 for n, (e, s) in err.items()}
    out["flushed_to_zero"] = flushed / total
    return out


def torch_save_way(root: Path, rows: list[ShardSample]
                   ) -> tuple[Callable[[], int], Callable[[], int]]:
    root.mkdir(parents=True, exist_ok=True)

    def write() -> int:
        total = 0
        for s in rows:
            path = root / f"{s.sample_id}.pt"
            torch.save({"input_ids": s.input_ids.long(), "loss_mask": s.loss_mask.long(),
                        "hidden_state": s.final_hidden, "aux_hidden_state": s.aux_hidden},
                       path)
            total += path.stat().st_size
        return total

    def read() -> int:
        return sum(int(torch.load(p, weights_only=True)["input_ids"].shape[0])
                   for p in sorted(root.glob("*.pt")))

    return write, read


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = samples(args.samples, args.tokens, args.hidden, args.seed)
    tokens = args.samples * args.tokens
    bf16_bytes = tokens * 2 * 4 * args.hidden
    with tempfile.TemporaryDirectory() as tmp:
        storage = Storage(Path(tmp).as_uri())
        ways = {f"{e} {c}": shard_way(storage, rows, args.hidden, e, c)
                for e in ("bfloat16", "fp8-aux", "fp8") for c in ("zstd", "none")}
        ways["torch.save per sample"] = torch_save_way(Path(tmp) / "pt", rows)
        sizes: dict[str, int] = {}
        times: dict[str, dict[str, list[float]]] = {n: {"write": [], "read": []} for n in ways}
        for _ in range(args.reps):
            for name, (write, read) in ways.items():
                start = time.perf_counter()
                sizes[name] = write()
                times[name]["write"].append(time.perf_counter() - start)
                start = time.perf_counter()
                assert read() == tokens
                times[name]["read"].append(time.perf_counter() - start)
        errors = {e: relative_error(storage, f"bench/{e}-zstd.parquet", rows)
                  for e in ("fp8-aux", "fp8")}
    report = {"command": " ".join(["python", "bench/shard_io.py", *(argv or sys.argv[1:])]),
              "hidden": args.hidden, "tokens": tokens, "ways": {}}
    base = sizes["bfloat16 zstd"]
    print(f"{tokens} tokens of 3 x {args.hidden} aux + {args.hidden} final states")
    print("| way | bytes/token | vs bf16 zstd | write MB/s (tokens/s) | read MB/s (tokens/s) |")
    print("|---|---|---|---|---|")
    for name in ways:
        w = statistics.median(times[name]["write"])
        r = statistics.median(times[name]["read"])
        row = {"bytes_per_token": sizes[name] / tokens, "vs_bf16_zstd": sizes[name] / base,
               "write_mb_s": bf16_bytes / w / 1e6, "write_tokens_s": tokens / w,
               "read_mb_s": bf16_bytes / r / 1e6, "read_tokens_s": tokens / r}
        report["ways"][name] = row
        print(f"| {name} | {row['bytes_per_token']:.0f} | {row['vs_bf16_zstd']:.2f}x | "
              f"{row['write_mb_s']:.0f} ({row['write_tokens_s']:.0f}) | "
              f"{row['read_mb_s']:.0f} ({row['read_tokens_s']:.0f}) |")
    for encoding, e in errors.items():
        report["ways"][f"{encoding} zstd"].update(e)
        print(f"{encoding}: relative RMS error aux {e['aux_rel_rms_error']:.4f}, final "
              f"{e['final_rel_rms_error']:.4f}; {e['flushed_to_zero']:.2%} of values "
              f"decoded to zero")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
