"""GPU check: Aerie's CUDA paths against their CPU references, and throughput at a real width.

Run from the repository root:

    python bench/gpu_check.py                    # on a CUDA machine (meant: < 10 min, one H100)
    python bench/gpu_check.py --dry-run          # tiny shapes, CPU only (what CI runs)
    python bench/gpu_check.py --json out.json    # also write the figures (after each section)

Checks, on a small random Llama world (one RL step, random Zipf-like token ids, the response
masked from a random start; H=512, 4 layers, V=4096 on a GPU):

1. ``capture``: the hf capture backend on the device in bf16 against the same model on CPU in
   fp32, over the same batch: relative error of the aux and final states (bound: 3e-2);
2. ``step``: TTT training steps in this process, without DeepSpeed, each on a micro batch
   no earlier step saw: their times as Aerie runs them and with cuDNN attention allowed
   (:mod:`pipeline.attention_kernels`), how many distinct attention shapes one step runs, and
   its busiest operators (a diagnosis, no bound);
3. ``resume``: a DeepSpeed ZeRO-2 bf16 training on the device, SIGKILLed after its first
   checkpoint and resumed, ends with the uninterrupted run's weights, bit for bit (when they
   differ, a second uninterrupted run says whether the kernels or the resume are to blame);
4. ``evaluation``: the in-process engine on the device in bf16 (lossless against greedy
   decoding with bf16 near-ties counted) and its τ against the same drafter measured on CPU
   in fp32, each with its 95% interval over prompts.

Throughput, on a random target of Llama-3-8B's layer shape (H=4096, 14336, 32 heads, 8 KV
heads, V=128256) with ``--layers`` layers, each stage through its production entry point:

5. capture tokens/s (``capture.stage.run``: read, forward, bf16 shards on local disk);
6. training step time (the median gap between the run's own per-step log lines, so process
   start, checkpoints and export are left out), tokens/s and MFU: model FLOPs per trained token
   ``6·d·(drafter layer + draft head) + 6·fc + 2·H·V`` (TTT depth d; the teacher's full-vocab
   logits forward only; attention scores left out) over the measured bf16 matmul rate and the
   datasheet's 989 TFLOP/s. The count charges every depth and the head at every real token,
   while TTT runs them only where the loss needs them (about half the positions in chat
   data), so the MFU is an upper bound;
7. evaluation tokens/s of the in-process engine, one prompt at a time, with no drafter and
   with the trained drafter.

``--sections`` runs a subset; a training launch that outlives ``--train-limit`` seconds is
killed and fails its section with the tail of its log. Exits 1 when a check fails.
``--dry-run`` runs every section at tiny shapes with the device set to CPU (bf16 on CPU
stands in for the device's bf16), so CI keeps the script working.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import re
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.capture import stage as capture_stage  # noqa: E402
from pipeline.capture.config import ExtractConfig  # noqa: E402
from pipeline.capture.hf import HFCaptureBackend  # noqa: E402
from pipeline.evaluation import stage as eval_stage  # noqa: E402
from pipeline.evaluation.config import EvalConfig  # noqa: E402
from pipeline.layout import drafter_prefix  # noqa: E402
from pipeline.snapshot.policy import load_policy_ref, publish_policy  # noqa: E402
from pipeline.storage import Storage  # noqa: E402
from pipeline.tokenize.schema import commit_rows  # noqa: E402
from pipeline.training import stage as train_stage  # noqa: E402
from pipeline.training.checkpoint import complete_checkpoints  # noqa: E402
from pipeline.training.config import TrainConfig  # noqa: E402
from pipeline.training.launch import TrainingProcess, launch  # noqa: E402
from pipeline.vocab import stage as vocab_stage  # noqa: E402

STEP = 1
DATASHEET_BF16_TFLOPS = 989.0  # H100/H200 SXM dense bf16
CAPTURE_BOUND = 3e-2  # relative error of bf16 states against fp32 after a few layers


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    layers: int


@dataclass(frozen=True)
class Sizes:
    """How much of everything one run of the check uses."""

    check: Shape  # the numerics world
    width: Shape  # the throughput world
    samples: int  # per world
    lengths: tuple[int, int]  # sample token counts
    draft_vocab: int
    width_draft_vocab: int
    train_steps: int  # the resume check's run
    width_train_steps: int
    prompts: int  # evaluated prompts
    new_tokens: int
    matmul: int  # side of the square bf16 product that measures the peak


def sizes(dry_run: bool, layers: int) -> Sizes:
    if dry_run:
        tiny = Shape(32, 64, 4, 2, 300, 4)
        return Sizes(tiny, replace(tiny, layers=layers), samples=72, lengths=(16, 40),
                     draft_vocab=64, width_draft_vocab=64, train_steps=8,
                     width_train_steps=3, prompts=4, new_tokens=16, matmul=256)
    return Sizes(Shape(512, 1408, 8, 2, 4096, 4), Shape(4096, 14336, 32, 8, 128256, layers),
                 samples=96, lengths=(256, 768), draft_vocab=1024, width_draft_vocab=32000,
                 train_steps=60, width_train_steps=12, prompts=16, new_tokens=64,
                 matmul=8192)


def build_target(shape: Shape, device: str, dtype: torch.dtype, seed: int = 0):
    """A random Llama of ``shape``, initialised on ``device`` (fast on a GPU), with a peaky
    lm_head so that its greedy choices are confident and a drafter has something to learn."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden,
                         intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                         max_position_embeddings=4096, rope_theta=500000.0,
                         tie_word_embeddings=False)
    with torch.device(device):
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, 4.0 / shape.hidden ** 0.5)
    return model.to(dtype).eval()


def token_rows(shape: Shape, n: int, lengths: tuple[int, int], seed: int) -> list[dict]:
    """``n`` samples of Zipf-like random ids; the loss mask on from a random start."""
    rng = np.random.default_rng(seed)
    probs = 1.0 / np.arange(1, shape.vocab + 1) ** 1.1
    probs /= probs.sum()
    rows = []
    for i in range(n):
        t = int(rng.integers(lengths[0], lengths[1] + 1))
        start = int(rng.integers(4, t // 2))
        rows.append({"sample_id": f"s{i}", "step": STEP,
                     "input_ids": rng.choice(shape.vocab, size=t, p=probs).tolist(),
                     "loss_mask": [int(j >= start) for j in range(t)]})
    return rows


def world(root: Path, model, rows: list[dict], device: str, extract: ExtractConfig
          ) -> tuple[Storage, capture_stage.ExtractSummary]:
    """A one-step world in ``root``: ``model`` as the policy, ``rows`` tokenized, states
    captured on ``device`` in bf16 by the production stage."""
    storage = Storage((root / "storage").as_uri())
    model.save_pretrained(root / "policy")
    publish_policy(storage, STEP, root / "policy")
    commit_rows(storage, STEP, rows, rows_per_part=64)
    backend = HFCaptureBackend(model, device=device, output_dtype=torch.bfloat16)
    _sync(device)
    summary = capture_stage.run(storage, STEP, backend, extract,
                                policy=load_policy_ref(storage, STEP))
    return storage, summary


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def matmul_tflops(side: int, device: str, repeats: int = 10) -> float:
    """The measured bf16 matmul rate: mean of ``repeats`` products after three warm-ups."""
    a = torch.randn(side, side, device=device, dtype=torch.bfloat16)
    b = torch.randn(side, side, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    _sync(device)
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    _sync(device)
    return 2 * side ** 3 * repeats / (time.perf_counter() - started) / 1e12


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    ours, reference = ours.float().cpu(), reference.float().cpu()
    return float((ours - reference).norm() / reference.norm())


def check_capture(model_fp32, rows: list[dict], device: str) -> dict[str, Any]:
    """The device's bf16 capture against CPU fp32 on the same 16 samples."""
    batch = [r["input_ids"] for r in rows[:16]]
    reference = HFCaptureBackend(model_fp32, device="cpu").capture(batch)
    device_model = build_target_like(model_fp32, device)
    ours = HFCaptureBackend(device_model, device=device).capture(batch)
    aux = relative_error(torch.cat([o.aux_hidden for o in ours]),
                         torch.cat([r.aux_hidden for r in reference]))
    final = relative_error(torch.cat([o.final_hidden for o in ours]),
                           torch.cat([r.final_hidden for r in reference]))
    return {"tokens": sum(map(len, batch)), "aux_relative_error": aux,
            "final_relative_error": final, "bound": CAPTURE_BOUND,
            "ok": max(aux, final) <= CAPTURE_BOUND}


def build_target_like(model, device: str):
    """A bf16 copy of ``model`` on ``device``."""
    import copy

    return copy.deepcopy(model).to(device=device, dtype=torch.bfloat16).eval()


TRAIN_LIMIT = 120.0  # seconds one training launch may take before the check kills it


@contextlib.contextmanager
def time_limit(seconds: float | None = None) -> Iterator[None]:
    """Kill this process's children still running after ``seconds``: a hung training run
    (a stuck collective, say) then fails its launch with the tail of its log."""
    import psutil

    seconds = seconds or TRAIN_LIMIT

    def kill_children() -> None:
        print(f"time limit of {seconds:.0f} s reached: killing the training processes",
              flush=True)
        for child in psutil.Process().children(recursive=True):
            child.kill()

    timer = threading.Timer(seconds, kill_children)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def echo(line: str) -> None:
    print(line, flush=True)


def train_config(device: str, steps: int, **overrides: Any) -> TrainConfig:
    base = TrainConfig(lr=1e-3, warmup_ratio=0.1, micro_batch_size=8, max_steps=steps,
                       ttt_depth=4, checkpoint_every=max(1, steps // 3), keep_checkpoints=3,
                       log_every=1, shuffle_buffer=32, dtype="bf16", zero_stage=2,
                       device=device, export_dtype="float32")
    return replace(base, **overrides)


def weights_of(out_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(out_dir) / "model.safetensors"))


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def check_resume(storage: Storage, config: TrainConfig, work: Path) -> dict[str, Any]:
    """Uninterrupted (published as the drafter) vs SIGKILLed after a checkpoint + resumed."""
    with time_limit():
        reference = train_stage.run(storage, STEP, config, work_root=work / "reference",
                                    warm_start="none", on_line=echo)
    spec = train_stage.plan(storage, STEP, config, work / "killed", "none")
    proc = TrainingProcess(spec, on_line=echo)
    root = Path(spec.work_dir) / "checkpoints"
    deadline = time.monotonic() + TRAIN_LIMIT
    try:
        while not complete_checkpoints(root):
            if proc.proc.poll() is not None:
                raise RuntimeError(f"training ended before its first checkpoint: "
                                   f"{proc.log_path}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no checkpoint within {TRAIN_LIMIT:.0f} s")
            time.sleep(0.01)
        finished = proc.proc.poll() is not None
    finally:
        proc.kill()  # SIGKILL mid-run (a no-op if it already ended)
    killed_at = max(int(p.name.split("-")[1]) for p in complete_checkpoints(root))
    with time_limit():
        resumed = launch(spec, on_line=echo)
    expected = weights_of(str(Path(train_stage.plan(
        storage, STEP, config, work / "reference", "none").out_dir)))
    identical = same_weights(weights_of(resumed.out_dir), expected)
    mid_run = not finished and killed_at < resumed.steps
    out = {"steps": resumed.steps, "killed_after_checkpoint": killed_at,
           "killed_mid_run": mid_run, "resumed_from_step": resumed.resumed_from_step,
           "bit_identical": identical, "drafter": reference.uri,
           "ok": mid_run and identical and resumed.resumed_from_step == killed_at}
    if not identical:  # kernels or resume? a second uninterrupted run answers
        with time_limit():
            again = launch(train_stage.plan(storage, STEP, config, work / "again", "none"))
        out["uninterrupted_runs_identical"] = same_weights(weights_of(again.out_dir), expected)
    return out


def contestant_figures(report) -> dict[str, Any]:
    out: dict[str, Any] = {"device": report.device, "dtype": report.dtype,
                           "seconds": round(report.seconds, 2),
                           "lossless_prompts": report.lossless_prompts}
    for name, c in report.contestants.items():
        stats = c.acceptance
        seconds = stats.prefill_seconds + stats.draft_seconds + stats.verify_seconds
        tokens = stats.emitted_tokens + stats.prefill_tokens
        out[name] = {"tau": round(c.tau, 4), "tau_interval": [round(x, 4)
                                                              for x in c.tau_interval],
                     "alpha": [round(a, 4) if a == a else None for a in stats.alpha],
                     "outputs_match": c.outputs_match_baseline,
                     "reference_match": c.outputs_match_reference, "near_ties": c.ties,
                     "tokens_per_s": round(tokens / seconds, 1) if seconds else None}
    return out


def evaluation_figures(storage: Storage, sz: Sizes, device: str, dtype: str, prompts: int
             ) -> dict[str, Any]:
    """The evaluation stage on the device: every contestant's figures, and whether the
    report is sound as the promotion check judges it (lossless against greedy decoding and
    the cache-free reference, bf16 near-ties counted; :func:`pipeline.checks.evaluation_sound`)."""
    from pipeline.checks import evaluation_sound

    config = EvalConfig(max_prompts=prompts, max_new_tokens=sz.new_tokens,
                        reference_prompts=2, device=device, dtype=dtype)
    report = eval_stage.run(storage, STEP, drafter_prefix(STEP), config=config)
    sound = evaluation_sound(report)
    return {**contestant_figures(report), "lossless": bool(sound.passed),
            "soundness": sound.description}


def check_evaluation(storage: Storage, sz: Sizes, device: str) -> dict[str, Any]:
    """τ and losslessness on the device in bf16 against CPU fp32, same prompts, greedy."""
    ours = evaluation_figures(storage, sz, device, "bfloat16", sz.prompts)
    reference = evaluation_figures(storage, sz, "cpu", "float32", sz.prompts)
    c, r = ours["candidate"], reference["candidate"]
    lossless = ours["lossless"] and reference["lossless"]
    overlap = (c["tau_interval"][0] <= r["tau_interval"][1]
               and r["tau_interval"][0] <= c["tau_interval"][1])
    return {"device_bf16": ours, "cpu_fp32": reference, "lossless": lossless,
            "tau_intervals_overlap": overlap, "ok": lossless and overlap}


def step_profile(storage: Storage, config: TrainConfig, work: Path, device: str
                 ) -> dict[str, Any]:
    """TTT training steps (forward + backward) run in this process without DeepSpeed, each
    on a micro batch of the check world that no earlier step saw: their times as Aerie runs
    them (attention without cuDNN's per-shape graphs, :mod:`pipeline.attention_kernels`) and
    with cuDNN attention allowed, the distinct attention shapes one step runs, and its
    busiest operators. Fresh batches keep any per-shape cost in the timings, as in a real
    run; against the DeepSpeed runs' step times this says where a slow step goes."""
    from torch.profiler import ProfilerActivity, profile

    from pipeline.eagle3 import ttt
    from pipeline.eagle3.ttt import TTTObjective
    from pipeline.eagle3.ttt_batch import LogitHead, collate
    from pipeline.training.data import Position, WindowReader
    from pipeline.training.loop import build_drafter

    spec = train_stage.plan(storage, STEP, config, work, "none")
    model, target, manifests = build_drafter(spec, storage)
    model = model.to(device=device, dtype=torch.bfloat16)
    reader = WindowReader(storage, manifests, micro_batch_size=config.micro_batch_size,
                          shuffle_buffer=config.shuffle_buffer, seed=0,
                          max_length=config.max_length)
    lm_head, head = target.lm_head.to(device), LogitHead.of(target.config)
    batches = [collate(samples, lm_head, model.t2d, device=device, head=head)
               for _, samples in itertools.islice(reader.iter_micro_batches(Position(), 0, 1),
                                                  7)]
    if len(batches) < 7:
        raise RuntimeError(f"the check world holds {len(batches)} micro batches, 7 needed")
    objective = TTTObjective(model, config.ttt_depth, config.ttt_decay)

    def one_step(batch) -> float:
        started = time.perf_counter()
        loss, _ = objective(batch)
        loss.backward()
        _sync(device)
        return time.perf_counter() - started

    def timed(steps: list, allow_cudnn: bool = False) -> list[float]:
        kept = ttt.shape_stable
        if allow_cudnn:  # the backends PyTorch picks by itself
            ttt.shape_stable = contextlib.nullcontext
        try:
            return [round(one_step(b), 4) for b in steps]
        finally:
            ttt.shape_stable = kept

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda"
                                           else [])
    with profile(activities=activities, record_shapes=True) as prof:
        one_step(batches[0])  # also the warm-up: CUDA context, kernels loaded
    events = prof.key_averages()
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    busiest = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:8]
    shapes = {str(e.input_shapes) for e in prof.key_averages(group_by_input_shape=True)
              if e.key == "aten::scaled_dot_product_attention"}
    return {"tokens": [int(b.real.sum()) for b in batches[1:]],
            "seconds": timed(batches[1:4]),
            "cudnn_allowed_seconds": timed(batches[4:7], allow_cudnn=True),
            "attention_shapes": len(shapes), "operators": sum(e.count for e in events),
            "busiest": [{"op": e.key, "count": e.count,
                         "ms": round(getattr(e, key) / 1e3, 2)} for e in busiest]}


STEP_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) rank0 \S+ INFO step (\d+)/")


def step_seconds(lines: list[str]) -> float | None:
    """Median gap between consecutive per-step log lines (their own timestamps)."""
    stamps = [datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
              for m in map(STEP_LINE.match, lines) if m]
    gaps = [(b - a).total_seconds() for a, b in zip(stamps, stamps[1:], strict=False)]
    return statistics.median(gaps) if gaps else None


def flops_per_token(drafter_dir: Path, depth: int, target: Shape) -> float:
    """Model FLOPs of one trained token (see the module docstring)."""
    from safetensors import safe_open

    fc = other = 0
    with safe_open(str(drafter_dir / "model.safetensors"), "pt") as f:
        for name in f.keys():
            shape = f.get_slice(name).get_shape()
            if len(shape) != 2 or "embed" in name:
                continue
            size = shape[0] * shape[1]
            if name.startswith("fc."):
                fc += size
            else:
                other += size
    return 6.0 * depth * other + 6.0 * fc + 2.0 * target.hidden * target.vocab


def throughput(root: Path, sz: Sizes, device: str, peak: float) -> dict[str, Any]:
    """Capture, training and evaluation throughput on the real-width target."""
    shape = sz.width
    dtype_name = "bfloat16" if device == "cuda" else "float32"
    model = build_target(shape, device, getattr(torch, dtype_name))
    params = sum(p.numel() for p in model.parameters())
    rows = token_rows(shape, sz.samples, sz.lengths, seed=2)
    extract = ExtractConfig(token_budget=16384, max_batch_size=16, heldout_fraction=0.1)
    storage, summary = world(root, model, rows, device, extract)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    capture = {"target_params": params, "tokens": summary.tokens, "seconds":
               round(summary.seconds, 2), "tokens_per_s": round(summary.tokens / summary.seconds),
               "shard_bytes": summary.bytes}
    vocab_stage.run(storage, STEP, 1, sz.width_draft_vocab)
    config = train_config(device, sz.width_train_steps, micro_batch_size=4, ttt_depth=7,
                          checkpoint_every=sz.width_train_steps, lr=1e-4,
                          export_dtype="bfloat16")
    lines: list[str] = []

    def keep(line: str) -> None:
        lines.append(line)
        echo(line)

    with time_limit():
        trained = train_stage.run(storage, STEP, config, work_root=root / "train",
                                  warm_start="none", on_line=keep)
    seconds = step_seconds(lines)
    per_step = trained.result.tokens_trained / trained.result.steps
    spec = train_stage.plan(storage, STEP, config, root / "train", "none")
    flops = flops_per_token(Path(spec.out_dir), config.ttt_depth, shape) * per_step
    training = {"steps": trained.result.steps, "tokens_per_step": round(per_step),
                "step_seconds": seconds, "tflop_per_step": round(flops / 1e12, 2)}
    if seconds:
        achieved = flops / seconds / 1e12
        training.update(tokens_per_s=round(per_step / seconds), achieved_tflops=round(
            achieved, 1), mfu_vs_measured=round(achieved / peak, 4),
            mfu_vs_datasheet=round(achieved / DATASHEET_BF16_TFLOPS, 4))
    evaluation = evaluation_figures(storage, sz, device, dtype_name, max(2, sz.prompts // 2))
    return {"shape": shape.__dict__, "capture": capture, "training": training,
            "evaluation": evaluation}


SECTIONS = ("capture", "step", "resume", "evaluation", "throughput")


class Report:
    """The figures so far, written to ``--json`` after every section."""

    def __init__(self, path: Path | None):
        self.path, self.data, self.failed = path, {}, []

    def section(self, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        started = time.perf_counter()
        print(f"== {name} ==", flush=True)
        try:
            out = fn()
        except Exception as exc:  # recorded, printed and failing the run; the rest goes on
            traceback.print_exc()
            out = {"error": f"{type(exc).__name__}: {exc}", "ok": False}
        out["section_seconds"] = round(time.perf_counter() - started, 1)
        if out.get("ok") is False:
            self.failed.append(name)
        self.data[name] = out
        print(json.dumps(out, indent=1, default=str), flush=True)
        if self.path is not None:
            self.path.write_text(json.dumps(self.data, indent=1, default=str))
        return None if "error" in out else out


def environment(device: str) -> dict[str, Any]:
    import deepspeed
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__,
           "deepspeed": deepspeed.__version__, "device": device}
    if device == "cuda":
        out["gpu"] = torch.cuda.get_device_name(0)
        out["cuda"] = torch.version.cuda
    return out


def main(argv: list[str] | None = None) -> int:
    global TRAIN_LIMIT
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes on CPU (checks the script, measures nothing real)")
    parser.add_argument("--layers", type=int, default=4,
                        help="decoder layers of the real-width target (default 4)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--train-limit", type=float, default=TRAIN_LIMIT,
                        help="seconds one training launch may take (default %(default)s)")
    parser.add_argument("--work", type=Path, default=None,
                        help="working directory (default: a temporary one)")
    args = parser.parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --dry-run on a machine without one")
    TRAIN_LIMIT = args.train_limit
    sz = sizes(args.dry_run, args.layers)
    wanted = set(args.sections.split(","))
    if not wanted <= set(SECTIONS):
        parser.error(f"--sections: unknown {sorted(wanted - set(SECTIONS))}")
    report = Report(args.json)
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        work = Path(tmp)
        report.section("environment", lambda: environment(device))
        peak = report.section("peak", lambda: {
            "bf16_matmul_tflops": round(matmul_tflops(sz.matmul, device), 3)})
        model = build_target(sz.check, "cpu", torch.float32)
        rows = token_rows(sz.check, sz.samples, sz.lengths, seed=1)
        if "capture" in wanted:
            report.section("capture", lambda: check_capture(model, rows, device))
        if wanted & {"step", "resume", "evaluation"}:
            extract = ExtractConfig(token_budget=8192, max_batch_size=16,
                                    heldout_fraction=0.15)
            storage, _ = world(work / "check", build_target_like(model, device), rows,
                               device, extract)
            vocab_stage.run(storage, STEP, 1, sz.draft_vocab)
            if "step" in wanted:
                report.section("step", lambda: step_profile(
                    storage, train_config(device, sz.train_steps), work / "profile", device))
            if wanted & {"resume", "evaluation"}:
                resume = report.section("resume", lambda: check_resume(
                    storage, train_config(device, sz.train_steps), work / "runs"))
                if resume is not None and "evaluation" in wanted:
                    report.section("evaluation", lambda: check_evaluation(storage, sz,
                                                                          device))
        if peak is not None and "throughput" in wanted:
            report.section("throughput", lambda: throughput(
                work / "width", sz, device, peak["bf16_matmul_tflops"]))
    if report.failed:
        print(f"FAILED: {', '.join(report.failed)}", file=sys.stderr)
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
