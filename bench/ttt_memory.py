"""Benchmark: peak memory of one TTT training step (teacher + forward + backward) vs T.

Run from the repository root with Aerie's venv:

    python bench/ttt_memory.py                          # T = 256..2048, Aerie + SpecForge
    python bench/ttt_memory.py --quick --no-specforge   # T = 256, 512; Aerie only
    python bench/ttt_memory.py --shape a --seq-lens 512,4096

Each point runs in a FRESH subprocess (one per side and T): load the weights and batch
written by ``bench/training_vs_specforge.py``'s ``make_data`` (identical for both sides),
read VmRSS (the baseline: weights, embedding, target head, inputs), reset the peak with
``/proc/self/clear_refs`` = 5, run teacher logits + TTT forward (depth 7) + loss + backward,
then read VmHWM. Reported: baseline, peak, and peak − baseline (the step's working memory:
activations kept for backward, logits, gradients; no optimiser state, since no step is
taken). SpecForge's side is ``bench/specforge_step.py memory`` in its own venv.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from training_vs_specforge import (  # noqa: E402
    REPO,
    SHAPES,
    SPECFORGE_PYTHON,
    SPECFORGE_WORKER,
    Shape,
    make_data,
)


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return -1


def aerie_child(data_dir: Path, threads: int) -> None:
    """Measure one Aerie teacher + TTT forward + backward; print one ``@@`` JSON line."""
    import torch
    from training_vs_specforge import AerieTrainer

    torch.set_num_threads(threads)
    trainer = AerieTrainer(data_dir)
    from pipeline.eagle3.ttt import ttt_loss

    base = status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    if status_kib("VmHWM") > base * 1.05 + 1024:
        raise RuntimeError("VmHWM reset (/proc/self/clear_refs) is not supported here")
    t0 = time.perf_counter()
    loss, _ = ttt_loss(trainer.model, trainer.make_batch(), trainer.meta["depth"],
                       decay=trainer.meta["decay"])
    loss.backward()
    dt = time.perf_counter() - t0
    print("@@" + json.dumps({"baseline_rss_kib": base, "peak_kib": status_kib("VmHWM"),
                             "seconds": dt, "loss": float(loss.detach())}), flush=True)


def run_child(side: str, data_dir: Path, threads: int, timeout: float) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    if side == "aerie":
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(data_dir),
               "--threads", str(threads)]
    else:
        env.pop("PYTHONPATH", None)
        cmd = [SPECFORGE_PYTHON, str(SPECFORGE_WORKER), "--data", str(data_dir),
               "--threads", str(threads), "--compile", "off", "memory"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(REPO),
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s"}
    for line in proc.stdout.splitlines():
        if line.startswith("@@"):
            return json.loads(line[2:])
    tail = (proc.stderr or "").strip().splitlines()[-3:]
    return {"error": f"exit {proc.returncode}: {' | '.join(tail)}"}


def mib(kib: int) -> float:
    return kib / 1024.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="a", choices=sorted(SHAPES),
                   help="base shape (default a: H256, vocab 32k→8k); T is overridden")
    p.add_argument("--seq-lens", default="256,512,1024,2048")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-specforge", action="store_true")
    p.add_argument("--timeout", type=float, default=900.0, help="per point, seconds")
    p.add_argument("--quick", action="store_true", help="T = 256, 512")
    p.add_argument("--json", type=Path)
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        aerie_child(args.child, args.threads)
        return
    if args.quick:
        args.seq_lens = "256,512"
    sides = ["aerie"] + ([] if args.no_specforge else ["specforge"])
    base_shape = SHAPES[args.shape]
    load_start = os.getloadavg()
    rows = []
    for t in (int(x) for x in args.seq_lens.split(",")):
        shape = Shape(**{**asdict(base_shape), "seq_len": t})
        with tempfile.TemporaryDirectory(prefix=f"aerie-mem-{t}-") as tmp:
            make_data(shape, Path(tmp))
            row = {"seq_len": t}
            for side in sides:
                r = run_child(side, Path(tmp), args.threads, args.timeout)
                row[side] = r
                msg = r.get("error") or (f"peak {mib(r['peak_kib']):.0f} MiB, step "
                                         f"{mib(r['peak_kib'] - r['baseline_rss_kib']):.0f} "
                                         f"MiB, {r['seconds']:.2f}s")
                print(f"T={t:5d} {side:9s} {msg}", file=sys.stderr, flush=True)
            rows.append(row)
    load_end = os.getloadavg()

    head = "| T |" + "".join(f" {s}: baseline / peak / step (peak − baseline) MiB | {s} s |"
                             for s in sides)
    lines = [f"Shape {base_shape.name} ({base_shape.description}), batch {base_shape.batch}, "
             f"depth {base_shape.depth}, fp32, {args.threads} thread(s); load "
             f"{load_start[0]:.2f} → {load_end[0]:.2f}.", "", head,
             "|---|" + "---|---|" * len(sides)]
    for row in rows:
        cells = []
        for s in sides:
            r = row[s]
            if "error" in r:
                cells.append(f" {r['error']} | – |")
            else:
                cells.append(f" {mib(r['baseline_rss_kib']):.0f} / {mib(r['peak_kib']):.0f} / "
                             f"**{mib(r['peak_kib'] - r['baseline_rss_kib']):.0f}** | "
                             f"{r['seconds']:.2f} |")
        lines.append(f"| {row['seq_len']} |" + "".join(cells))
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "load": [load_start, load_end],
                                         "args": {k: str(v) for k, v in vars(args).items()}},
                                        indent=1))


if __name__ == "__main__":
    main()
