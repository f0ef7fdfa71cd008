"""Benchmark: draft-vocab mapping (``pipeline.vocab.mapping``) for a 128k → 32k vocab.

Run from the repository root with Aerie's venv:

    python bench/vocab_mapping.py                  # 10M masked tokens, best of 5
    python bench/vocab_mapping.py --quick          # 1M masked tokens, best of 3
    python bench/vocab_mapping.py --specforge      # + SpecForge 0.2.0's own loop, once

Data: samples of ``--seq-len`` Zipf-distributed token ids (exponent ``--zipf`` over a random
permutation of the target vocab) with a prompt/response-like loss mask covering about
``--mask-frac`` of the tokens; enough samples for ``--masked-tokens`` masked tokens.

Timed separately (``--threads`` torch threads, best-of-N and median):

1. count: ``TokenCounter.update(ids, mask)`` once per sample, then ``counts()`` -- the
   streaming path the pipeline uses;
2. mapping: ``build_vocab_mapping(counts, draft_vocab_size)`` (sort, d2t, t2d, coverage);
3. reference: one ``torch.bincount`` over all masked ids at once (a lower bound for 1).

``--specforge`` runs SpecForge's count loop and ``process_token_dict_to_mappings`` on the
same samples in its own venv (``bench/specforge_step.py vocab``) and compares the chosen ids.
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
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.vocab.mapping import TokenCounter, build_vocab_mapping  # noqa: E402

SPECFORGE_PYTHON = "/tmp/specforge-venv/bin/python"


def make_samples(target_vocab: int, masked_tokens: int, seq_len: int, mask_frac: float,
                 zipf: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids (S, L) int64, loss_mask (S, L) bool)`` with ~``masked_tokens`` on."""
    rng = np.random.default_rng(seed)
    n_samples = max(1, round(masked_tokens / (seq_len * mask_frac)))
    p = 1.0 / np.arange(1, target_vocab + 1, dtype=np.float64) ** zipf
    cdf = np.cumsum(p / p.sum())
    perm = rng.permutation(target_vocab)
    ranks = np.searchsorted(cdf, rng.random(n_samples * seq_len), side="right")
    ids = perm[np.minimum(ranks, target_vocab - 1)].reshape(n_samples, seq_len)
    # Prompt of (1 - mask_frac) of the sequence, then the response (mask on).
    mask = np.zeros((n_samples, seq_len), dtype=bool)
    start = int(round(seq_len * (1.0 - mask_frac)))
    mask[:, start:] = True
    return torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask)


def time_count(input_ids: torch.Tensor, loss_mask: torch.Tensor,
               vocab: int) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    counter = TokenCounter(vocab)
    for ids, mask in zip(input_ids, loss_mask, strict=True):
        counter.update(ids, mask)
    counts = counter.counts()
    return time.perf_counter() - t0, counts


def time_bincount(input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab: int) -> float:
    t0 = time.perf_counter()
    torch.bincount(input_ids[loss_mask], minlength=vocab)
    return time.perf_counter() - t0


def time_mapping(counts: torch.Tensor, draft_vocab: int):
    t0 = time.perf_counter()
    mapping = build_vocab_mapping(counts, draft_vocab)
    return time.perf_counter() - t0, mapping


def stats(xs: list[float]) -> str:
    return f"{min(xs) * 1e3:.1f} / {statistics.median(xs) * 1e3:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target-vocab", type=int, default=128256)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--masked-tokens", type=int, default=10_000_000)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--mask-frac", type=float, default=0.6)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--specforge", action="store_true",
                   help="also run SpecForge 0.2.0's count loop + mapping once (slow)")
    p.add_argument("--quick", action="store_true", help="1M masked tokens, 3 repetitions")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.quick:
        args.masked_tokens, args.reps = 1_000_000, 3
    torch.set_num_threads(args.threads)

    load_start = os.getloadavg()
    t0 = time.perf_counter()
    input_ids, loss_mask = make_samples(args.target_vocab, args.masked_tokens, args.seq_len,
                                        args.mask_frac, args.zipf)
    gen_s = time.perf_counter() - t0
    n_masked = int(loss_mask.sum())
    print(f"{input_ids.shape[0]} samples × {args.seq_len} tokens, {n_masked:,} masked; "
          f"generated in {gen_s:.1f}s", file=sys.stderr)

    count_t, map_t, bin_t = [], [], []
    counts = mapping = None
    for _ in range(args.reps):
        dt, counts = time_count(input_ids, loss_mask, args.target_vocab)
        count_t.append(dt)
        bin_t.append(time_bincount(input_ids, loss_mask, args.target_vocab))
        dt, mapping = time_mapping(counts, args.draft_vocab)
        map_t.append(dt)
    total = [c + m for c, m in zip(count_t, map_t, strict=True)]
    summary = mapping.summary()
    result = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "samples": int(input_ids.shape[0]), "masked_tokens": n_masked,
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "count_s": count_t, "mapping_s": map_t, "bincount_s": bin_t, "total_s": total,
        "summary": summary, "load_start": load_start,
    }

    sf = None
    if args.specforge:
        with tempfile.TemporaryDirectory(prefix="aerie-vocab-") as tmp:
            from safetensors.torch import save_file

            save_file({"input_ids": input_ids, "loss_mask": loss_mask.to(torch.int64)},
                      os.path.join(tmp, "tokens.safetensors"))
            env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
            env.pop("PYTHONPATH", None)
            out = subprocess.run(
                [SPECFORGE_PYTHON, str(REPO / "bench" / "specforge_step.py"), "--data", tmp,
                 "--threads", str(args.threads), "--target-vocab", str(args.target_vocab),
                 "--draft-vocab", str(args.draft_vocab), "vocab"],
                capture_output=True, text=True, env=env, check=True).stdout
            sf = json.loads(next(x for x in out.splitlines() if x.startswith("@@"))[2:])
        ours = set(mapping.draft_to_target.tolist())
        theirs = set(sf.pop("used"))
        cutoff = int(counts[mapping.draft_to_target].min())
        only = sorted(ours ^ theirs)
        sf["differing_ids"] = len(only) // 2
        # Differences are harmless iff every differing id has exactly the cut-off count.
        sf["differences_are_ties"] = bool((counts[only] == cutoff).all()) if only else True
        sf["cutoff_count"] = cutoff
        result["specforge"] = sf
    result["load_end"] = os.getloadavg()

    lines = [
        f"Target vocab {args.target_vocab:,} → draft {args.draft_vocab:,}; "
        f"{n_masked:,} masked tokens in {input_ids.shape[0]:,} samples of {args.seq_len}; "
        f"{torch.get_num_threads()} thread(s); best / median of {args.reps} (ms); load "
        f"{load_start[0]:.2f} → {result['load_end'][0]:.2f}.",
        "",
        "| step | Aerie best / median ms |" + (" SpecForge 0.2.0 (1 run) ms |" if sf else ""),
        "|---|---|" + ("---|" if sf else ""),
        f"| count (per-sample `TokenCounter.update` + `counts()`) | {stats(count_t)} |"
        + (f" {sf['count_s'] * 1e3:.0f} |" if sf else ""),
        f"| mapping (`build_vocab_mapping`) | {stats(map_t)} |"
        + (f" {sf['mapping_s'] * 1e3:.0f} |" if sf else ""),
        f"| total | {stats(total)} |"
        + (f" {(sf['count_s'] + sf['mapping_s']) * 1e3:.0f} |" if sf else ""),
        f"| reference: one `bincount` over all masked ids | {stats(bin_t)} |"
        + (" |" if sf else ""),
        "",
        f"coverage {summary['coverage']:.4f}, distinct tokens {summary['distinct_tokens']:,}, "
        f"padded ids {summary['padded_ids']}"
        + (f"; SpecForge picked the same ids except {sf['differing_ids']} "
           f"({'all' if sf['differences_are_ties'] else 'NOT all'} ties at the cut-off count "
           f"{sf['cutoff_count']}: it breaks ties by first appearance, Aerie by id)"
           if sf else ""),
    ]
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
