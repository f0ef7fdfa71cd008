"""Benchmark: one EAGLE-3 training step, Aerie vs SpecForge 0.2.0, side by side on CPU.

Run from the repository root with Aerie's venv; SpecForge runs in its own venv
(DESIGN §7; ``bench/specforge_step.py`` is its worker):

    python bench/training_vs_specforge.py --quick               # shape a, 1 and 2 threads
    python bench/training_vs_specforge.py --shapes a,b,c --reps 7 --json out.json
    python bench/training_vs_specforge.py --shapes a --profile  # + top ops of both sides

One step = teacher logits from the target's final hidden state + TTT forward (depth 7) +
loss + backward + grad clip + AdamW step, fp32, batch 1 (unless the shape says otherwise).
Both sides read IDENTICAL weights and batch from one safetensors pair written here (drafter
tensors under SGLang's names, which both models use: ``fc``, ``midlayer.*``, ``norm``,
``lm_head``, ``d2t``, ``t2d``; plus the frozen embedding and the target's ``lm_head``).

Method (the two CPU cores are shared with other jobs):

- each side runs in its own worker process with the same thread count
  (``OMP_NUM_THREADS`` + ``torch.set_num_threads``); workers answer "step" requests, so
  repetitions interleave A, S, S, A, A, S, ... and only one side computes at a time;
- small shapes keep both workers resident; large ones (``resident=False``) start a fresh
  worker per repetition (load, one untimed warm-up step, timed steps, exit) so only one
  side's ~10 GB is in RAM at a time;
- reported: best-of-N and median seconds/step, tokens/s (B·T per step), the median of the
  per-repetition ratios SpecForge/Aerie, and the load average before and after.

Loss check: the first step of both sides starts from the same weights, so their first
losses are comparable -- but the definitions differ (see ``specforge_definition_loss``).
The Aerie worker therefore also recomputes SpecForge's exact definition from ITS OWN draft
logits (and the gradient norm of that loss): equal to SpecForge's loss and gradient norm up
to fp32 rounding means the two models, TTT chains and backward passes are the same
computation, and the native losses differ only by definition.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPECFORGE_PYTHON = "/tmp/specforge-venv/bin/python"
SPECFORGE_WORKER = REPO / "bench" / "specforge_step.py"


# -- shapes ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    name: str
    description: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    layers: int  # target layers (only sets the recorded aux ids)
    vocab: int
    draft_vocab: int
    seq_len: int
    batch: int = 1
    depth: int = 7
    rope_theta: float = 10000.0
    max_positions: int = 2048
    resident: bool = True  # keep both workers alive (small shapes)
    timed_steps_per_rep: int = 1

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    def target_config(self) -> dict:
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": self.hidden, "intermediate_size": self.intermediate,
            "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
            "head_dim": self.hidden // self.heads, "num_hidden_layers": self.layers,
            "rms_norm_eps": 1e-5, "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_positions, "vocab_size": self.vocab,
            "hidden_act": "silu", "tie_word_embeddings": False,
        }


SHAPES = {
    "a": Shape("a", "DESIGN reference: H256, T512, vocab 32k→8k", hidden=256,
               intermediate=1024, heads=4, kv_heads=4, layers=8, vocab=32000,
               draft_vocab=8000, seq_len=512),
    "b": Shape("b", "Llama-3-8B-shaped drafter: H4096, 32/8 heads, I14336, vocab 128256→32000",
               hidden=4096, intermediate=14336, heads=32, kv_heads=8, layers=32,
               vocab=128256, draft_vocab=32000, seq_len=64, rope_theta=500000.0,
               max_positions=8192, resident=False, timed_steps_per_rep=2),
    "c": Shape("c", "demo policy shape: H128, I256, 4 heads, vocab 1536 (draft = full)",
               hidden=128, intermediate=256, heads=4, kv_heads=4, layers=4, vocab=1536,
               draft_vocab=1536, seq_len=256, batch=4, max_positions=512),
}


# -- data --------------------------------------------------------------------------------
def zipf_ids(rng, vocab: int, n: int, perm, exponent: float = 1.1):
    import numpy as np

    p = 1.0 / np.arange(1, vocab + 1, dtype=np.float64) ** exponent
    p /= p.sum()
    return perm[rng.choice(vocab, size=n, p=p)]


def make_loss_mask(rng, t: int):
    """Prompt (off) for the first ~T/8 tokens, then response/user turns of 16..96 tokens
    (70% response); the sequence ends inside a response (mask on at T-1, as with EOS)."""
    import numpy as np

    mask = np.zeros(t, dtype=bool)
    pos = max(2, t // 8)
    while pos < t:
        n = int(rng.integers(16, 97))
        mask[pos:pos + n] = rng.random() < 0.7
        pos += n
    mask[-max(4, t // 32):] = True
    return mask


def make_data(shape: Shape, out: Path, seed: int = 0) -> dict:
    """Write config.json, target/config.json, weights/batch safetensors and meta.json."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(REPO))
    from pipeline.eagle3.config import DrafterConfig
    from pipeline.eagle3.model import Eagle3Drafter
    from pipeline.vocab.mapping import build_vocab_mapping

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    tcfg = shape.target_config()
    cfg = DrafterConfig.from_target(tcfg, draft_vocab_size=shape.draft_vocab)
    (out / "target").mkdir(exist_ok=True)
    (out / "target" / "config.json").write_text(json.dumps(tcfg, indent=1))
    (out / "config.json").write_text(json.dumps(cfg.to_sglang_config("float32"), indent=1))

    v, h, b, t = shape.vocab, shape.hidden, shape.batch, shape.seq_len
    perm = rng.permutation(v)  # Zipf rank -> token id
    # Draft vocab from 1M masked tokens of the same distribution (the product's function).
    counts = torch.bincount(torch.from_numpy(zipf_ids(rng, v, 1_000_000, perm)), minlength=v)
    mapping = build_vocab_mapping(counts, shape.draft_vocab)

    embed = torch.randn(v, h) * 0.02
    model = Eagle3Drafter(cfg, embed, d2t=mapping.d2t, t2d=mapping.t2d)
    with torch.no_grad():  # non-trivial norm weights: a swapped name would show in the loss
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    weights = dict(model.exported_state_dict())
    weights = {k: x.contiguous() for k, x in weights.items()}
    del model
    weights["embed_tokens.weight"] = embed
    lm_head = torch.randn(v, h) / math.sqrt(h)  # rows of norm ~1
    weights["target_lm_head.weight"] = lm_head
    save_file(weights, str(out / "weights.safetensors"))

    ids = torch.from_numpy(zipf_ids(rng, v, b * (t + 1), perm)).view(b, t + 1)
    alt = torch.from_numpy(zipf_ids(rng, v, b * t, perm)).view(b, t)
    # Teacher: sharp on the true next token, a secondary peak on another frequent token.
    final = 12.0 * lm_head[ids[:, 1:]] + 8.0 * lm_head[alt] + 0.5 * torch.randn(b, t, h)
    loss_mask = torch.stack([torch.from_numpy(make_loss_mask(rng, t)) for _ in range(b)])
    batch = {
        "input_ids": ids[:, :t].contiguous(),
        "loss_mask": loss_mask.to(torch.int64),
        "attention_mask": torch.ones(b, t, dtype=torch.int64),
        "aux_hidden": torch.randn(b, t, 3 * h),
        "final_hidden": final.contiguous(),
    }
    save_file(batch, str(out / "batch.safetensors"))
    meta = {"shape": asdict(shape), "depth": shape.depth, "lr": 1e-4, "weight_decay": 0.0,
            "clip": 0.5, "decay": 0.8, "seed": seed,
            "trainable_params": sum(x.numel() for k, x in weights.items()
                                    if k not in ("embed_tokens.weight", "target_lm_head.weight",
                                                 "d2t", "t2d")),
            "vocab_coverage": mapping.coverage,
            "masked_tokens": int(loss_mask.sum())}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


# -- Aerie worker ------------------------------------------------------------------------
def vm_hwm_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return -1


class AerieTrainer:
    def __init__(self, data_dir: Path):
        import torch
        from safetensors.torch import load_file

        sys.path.insert(0, str(REPO))
        from pipeline.eagle3.config import DrafterConfig
        from pipeline.eagle3.model import Eagle3Drafter

        self.meta = json.loads((data_dir / "meta.json").read_text())
        cfg = DrafterConfig.from_sglang_config(json.loads((data_dir / "config.json").read_text()))
        w = load_file(str(data_dir / "weights.safetensors"))
        self.lm_head_w = w.pop("target_lm_head.weight")
        embed = w.pop("embed_tokens.weight")
        self.model = Eagle3Drafter(cfg, embed)
        self.model.load_state_dict(w, strict=True)  # SGLang names, d2t and t2d included
        self.model.train()
        self.params = self.model.trainable_parameters()
        self.opt = torch.optim.AdamW(self.params, lr=self.meta["lr"],
                                     weight_decay=self.meta["weight_decay"])
        b = load_file(str(data_dir / "batch.safetensors"))
        self.input_ids = b["input_ids"].long()
        self.loss_mask = b["loss_mask"].bool()
        self.attention_mask = b["attention_mask"].bool()
        self.aux_hidden = b["aux_hidden"].float()
        self.final_hidden = b["final_hidden"].float()
        self.n_params = sum(p.numel() for p in self.params)

    def make_batch(self):
        import torch

        from pipeline.eagle3.ttt_batch import TTTBatch, teacher_batch, teacher_rows

        with torch.no_grad():  # as ``collate`` does: the rows the loss reads
            rows = teacher_rows(self.loss_mask & self.attention_mask)
            logits, argmax = teacher_batch(self.final_hidden, self.lm_head_w, self.model.t2d,
                                           rows)
        return TTTBatch(self.input_ids, self.aux_hidden, logits, argmax, self.loss_mask,
                        self.attention_mask)

    def step(self) -> dict:
        import torch

        from pipeline.eagle3.ttt import ttt_loss

        t0 = time.perf_counter()
        batch = self.make_batch()
        t1 = time.perf_counter()
        loss, metrics = ttt_loss(self.model, batch, self.meta["depth"],
                                 decay=self.meta["decay"])
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.meta["clip"])
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        return {"total": t4 - t0, "teacher": t1 - t0, "forward": t2 - t1,
                "backward": t3 - t2, "optimizer": t4 - t3, "loss": float(loss.detach()),
                "step_loss": metrics.step_loss, "accuracy": metrics.accuracy,
                "count": metrics.count, "grad_norm": float(grad_norm),
                "vm_hwm_kib": vm_hwm_kib()}

    def check(self) -> dict:
        """Losses and gradient norms of the CURRENT weights under three definitions
        (no optimiser step): Aerie's, SpecForge's exact one from Aerie's logits, and
        SpecForge's gating with Aerie's per-count normalisation."""
        from pipeline.eagle3.ttt import ttt_logits, ttt_loss

        out = {}
        batch = self.make_batch()
        loss, m = ttt_loss(self.model, batch, self.meta["depth"], decay=self.meta["decay"])
        loss.backward()
        out["aerie"] = {"loss": float(loss.detach()), "step_loss": m.step_loss, "count": m.count,
                        "grad_norm": _grad_norm(self.params)}
        self.opt.zero_grad(set_to_none=True)
        for norm in ("tokens", "count"):
            logits = ttt_logits(self.model, self.input_ids, self.aux_hidden, self.meta["depth"])
            total, steps, counts = specforge_definition_loss(
                logits, self.final_hidden, self.lm_head_w, self.model.t2d, self.loss_mask,
                decay=self.meta["decay"], normalise=norm)
            total.backward()
            key = "specforge_def" if norm == "tokens" else "specforge_gate_aerie_norm"
            out[key] = {"loss": float(total.detach()), "step_loss": steps, "count": counts,
                        "grad_norm": _grad_norm(self.params)}
            self.opt.zero_grad(set_to_none=True)
        return out

    def profile(self, top: int = 25) -> str:
        return _profile(self.step, top)


def _grad_norm(params) -> float:
    import torch

    return float(torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(p.grad) for p in params if p.grad is not None])))


def _profile(fn, top: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top,
                                     max_name_column_width=48)


def specforge_definition_loss(logits, final_hidden, lm_head_w, t2d, loss_mask, *,
                              decay: float = 0.8, normalise: str = "tokens"):
    """SpecForge 0.2.0's offline EAGLE-3 loss, recomputed from Aerie's TTT logits.

    (Written from its behaviour, see RESULTS-training.md.) Its offline loader zeroes the
    last loss-mask entry. Teacher rows are the target logits shifted left by one
    (``S_t = L_{t+1}``) with a ZERO hidden state at ``T-1`` (uniform teacher there,
    full-vocab argmax 0); rows past the end are uniform with mask 0. Step i at position t
    (all T positions) uses row ``t+i`` and the gate
    ``m_{t+i} · t2d[argmax S_{t+i}]`` -- the loss mask of the token two before the one it
    predicts. Per-step loss = Σ gate·CE / (B·T) (``normalise="tokens"``, SpecForge) or
    / Σ gate (``"count"``, Aerie's normalisation with SpecForge's gating).
    """
    import torch
    import torch.nn.functional as F

    b, t = loss_mask.shape
    loss_mask = loss_mask.clone().bool()
    loss_mask[:, -1] = False  # SpecForge's offline loader zeroes the last mask entry
    with torch.no_grad():
        hidden = torch.cat([final_hidden[:, 1:], torch.zeros_like(final_hidden[:, :1])], 1)
        full = hidden.float() @ lm_head_w.float().T  # (B, T, V)
        argmax = full.argmax(-1)
        p = torch.softmax(full[..., t2d], -1)  # (B, T, Vd)
        gate_rows = t2d[argmax] & loss_mask.bool()  # (B, T)
        vd = p.shape[-1]
        p = torch.cat([p, torch.full((b, len(logits), vd), 1.0 / vd)], 1)
        gate_rows = torch.cat([gate_rows, torch.zeros(b, len(logits), dtype=torch.bool)], 1)
    total = logits[0].new_zeros(())
    steps, counts = [], []
    for i, lg in enumerate(logits):
        gate = gate_rows[:, i:i + t]
        ce = -(p[:, i:i + t] * F.log_softmax(lg.float(), -1)).sum(-1)
        denom = b * t if normalise == "tokens" else max(int(gate.sum()), 1)
        loss_i = (ce * gate).sum() / denom
        total = total + decay ** i * loss_i
        steps.append(float(loss_i.detach()))
        counts.append(int(gate.sum()))
    return total, steps, counts


def aerie_worker(data_dir: Path, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    trainer = AerieTrainer(data_dir)
    _reply({"ready": True, "load_s": time.perf_counter() - t0,
            "trainable_params": trainer.n_params, "torch": torch.__version__,
            "threads": torch.get_num_threads()})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)["cmd"]
        if cmd == "quit":
            break
        if cmd == "step":
            _reply(trainer.step())
        elif cmd == "check":
            _reply(trainer.check())
        elif cmd == "profile":
            _reply({"table": trainer.profile()})
        else:
            _reply({"error": f"unknown command {cmd!r}"})


def _reply(obj: dict) -> None:
    print("@@" + json.dumps(obj), flush=True)


# -- driver ------------------------------------------------------------------------------
class Worker:
    """A worker process speaking the ``@@``-JSON line protocol.

    ``side`` is ``"aerie"`` or ``"specforge-off"`` / ``"specforge-on"`` (SpecForge with its
    ``@torch.compile`` helpers eager or compiled).
    """

    def __init__(self, side: str, data_dir: Path, threads: int):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        if side == "aerie":
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "aerie",
                   "--data", str(data_dir), "--worker-threads", str(threads)]
        else:
            compile_mode = side.split("-", 1)[1]
            cmd = [SPECFORGE_PYTHON, str(SPECFORGE_WORKER), "--data", str(data_dir),
                   "--threads", str(threads), "--compile", compile_mode, "serve"]
            env.pop("PYTHONPATH", None)
        self.side = side
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env, cwd=str(REPO))
        self.hello = self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("@@"):
                return json.loads(line[2:])
        raise RuntimeError(f"{self.side} worker exited with {self.proc.wait()}")

    def ask(self, cmd: str) -> dict:
        self.proc.stdin.write(json.dumps({"cmd": cmd}) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        if "error" in reply:
            raise RuntimeError(f"{self.side}: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass
            self.proc.wait(timeout=120)


def summarize(xs: list[float]) -> dict:
    return {"best": min(xs), "median": statistics.median(xs), "n": len(xs)}


PHASES = ("teacher", "forward", "backward", "optimizer")


def run_shape(shape: Shape, threads: int, data_dir: Path, reps: int, warmup: int,
              sf_modes: list[str], profile: bool, log) -> dict:
    """Interleaved repetitions of Aerie and each SpecForge mode at one thread count.

    The order rotates every repetition (A S1 S2, S2 S1 A, ...); the ratio of a repetition
    is SpecForge's time over Aerie's time in that same repetition.
    """
    sides = ["aerie"] + [f"specforge-{m}" for m in sf_modes]
    load_start = os.getloadavg()
    times = {s: [] for s in sides}
    phases = {s: [] for s in sides}
    ratios = {s: [] for s in sides[1:]}
    first, hello, profiles = {}, {}, {}

    def record(side: str, r: dict) -> None:
        times[side].append(r["total"])
        phases[side].append({k: r[k] for k in PHASES})
        log(f"    {side:14s} {r['total']:7.3f}s  (teacher {r['teacher']:.3f}, fwd "
            f"{r['forward']:.3f}, bwd {r['backward']:.3f}, opt {r['optimizer']:.3f}) "
            f"loss {r['loss']:.5f}")

    def order(rep: int) -> list[str]:
        return sides if rep % 2 == 0 else sides[::-1]

    if shape.resident:
        workers = {}
        try:
            for s in sides:
                workers[s] = Worker(s, data_dir, threads)
                hello[s] = workers[s].hello
            first["check"] = workers["aerie"].ask("check")
            for s in sides:
                first[s] = workers[s].ask("step")  # warm-up 1: from the initial weights
                for _ in range(warmup - 1):
                    workers[s].ask("step")
            for rep in range(reps):
                got = {}
                for s in order(rep):
                    r = workers[s].ask("step")
                    record(s, r)
                    got[s] = r["total"]
                for s in sides[1:]:
                    ratios[s].append(got[s] / got["aerie"])
            if profile:
                profiles = {s: workers[s].ask("profile")["table"] for s in sides}
        finally:
            for w in workers.values():
                w.close()
    else:
        # One fresh worker per side and repetition: load, 1 untimed step, timed steps, exit.
        for rep in range(reps):
            got = {}
            for s in order(rep):
                w = Worker(s, data_dir, threads)
                try:
                    hello[s] = w.hello
                    if rep == 0 and s == "aerie":
                        first["check"] = w.ask("check")
                    warm = w.ask("step")
                    if rep == 0:
                        first[s] = warm
                    rs = [w.ask("step") for _ in range(shape.timed_steps_per_rep)]
                    if profile and rep == 0:
                        profiles[s] = w.ask("profile")["table"]
                finally:
                    w.close()
                for r in rs:
                    record(s, r)
                got[s] = min(r["total"] for r in rs)
            for s in sides[1:]:
                ratios[s].append(got[s] / got["aerie"])
    res = {"shape": shape.name, "threads": threads, "tokens": shape.tokens,
           "load_start": load_start, "load_end": os.getloadavg(), "hello": hello,
           "first_step": first, "profiles": profiles, "sides": {}}
    for s in sides:
        st = summarize(times[s])
        st["tokens_per_s_best"] = shape.tokens / st["best"]
        st["tokens_per_s_median"] = shape.tokens / st["median"]
        st["phases_median"] = {k: statistics.median(p[k] for p in phases[s]) for k in PHASES}
        if s != "aerie":
            st["ratios"] = ratios[s]
            st["ratio_median"] = statistics.median(ratios[s])
            st["ratio_best"] = st["best"] / min(times["aerie"])
        res["sides"][s] = st
    return res


def _num(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def markdown(results: list[dict]) -> str:
    lines = ["| shape | thr | Aerie best / median s | SpecForge (compile) best / median s | "
             "Aerie tok/s best | SpecForge tok/s best | SF/Aerie: median of per-rep ratios "
             "(ratio of bests) | load avg start → end |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        a = r["sides"]["aerie"]
        for name, s in r["sides"].items():
            if name == "aerie":
                continue
            lines.append(
                f"| {r['shape']} | {r['threads']} | {a['best']:.3f} / {a['median']:.3f} | "
                f"({name.split('-')[1]}) {s['best']:.3f} / {s['median']:.3f} | "
                f"{_num(a['tokens_per_s_best'])} | {_num(s['tokens_per_s_best'])} | "
                f"**{s['ratio_median']:.2f}×** ({s['ratio_best']:.2f}×) | "
                f"{r['load_start'][0]:.2f} → {r['load_end'][0]:.2f} |")
    lines += ["", "Median phase seconds (teacher / fwd+loss / bwd / clip+AdamW):", "",
              "| shape | thr | side | teacher | fwd+loss | bwd | clip+AdamW |",
              "|---|---|---|---|---|---|---|"]
    for r in results:
        for name, s in r["sides"].items():
            p = s["phases_median"]
            lines.append(f"| {r['shape']} | {r['threads']} | {name} | " +
                         " | ".join(f"{p[k]:.3f}" for k in PHASES) + " |")
    lines += ["", "First-step loss (identical weights and batch) and gradient norm "
              "(before clipping):", "",
              "| shape | Aerie native | SpecForge native | SpecForge def. recomputed from "
              "Aerie's logits | SF gating + Aerie normalisation | ‖g‖ Aerie | ‖g‖ SpecForge | "
              "‖g‖ SF def. from Aerie |", "|---|---|---|---|---|---|---|---|"]
    seen = set()
    for r in results:
        if r["shape"] in seen:
            continue
        seen.add(r["shape"])
        f = r["first_step"]
        c = f["check"]
        sf = next(f[s] for s in r["sides"] if s != "aerie")
        lines.append(
            f"| {r['shape']} | {f['aerie']['loss']:.6f} | {sf['loss']:.6f} | "
            f"{c['specforge_def']['loss']:.6f} | {c['specforge_gate_aerie_norm']['loss']:.6f} "
            f"| {c['aerie']['grad_norm']:.6g} | {sf['grad_norm']:.6g} | "
            f"{c['specforge_def']['grad_norm']:.6g} |")
    lines += ["", "Counted positions per TTT step (Aerie: m_{t+2+i}; SpecForge: m_{t+i}, "
              "denominator B·T):", "", "| shape | B·T | Aerie | SpecForge |", "|---|---|---|---|"]
    seen = set()
    for r in results:
        if r["shape"] in seen:
            continue
        seen.add(r["shape"])
        c = r["first_step"]["check"]
        lines.append(f"| {r['shape']} | {r['tokens']} | {c['aerie']['count']} | "
                     f"{c['specforge_def']['count']} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="a", help="comma list of " + ", ".join(
        f"{k} ({v.description})" for k, v in SHAPES.items()))
    p.add_argument("--threads", default="1,2", help="comma list of thread counts")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions per side")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per resident worker")
    p.add_argument("--seq-len", type=int, default=None, help="override T of every shape")
    p.add_argument("--compile", default="off",
                   help="SpecForge modes, comma list of off (its @torch.compile helpers run "
                   "eagerly) and on (inductor-compiled for the CPU; compiles in the untimed "
                   "warm-up, ~1 min); each is a separate interleaved side")
    p.add_argument("--profile", action="store_true", help="torch.profiler table of one "
                   "Aerie step per shape/thread count")
    p.add_argument("--quick", action="store_true", help="shape a, 3 reps, 1 warm-up")
    p.add_argument("--json", type=Path, help="write all results here")
    p.add_argument("--keep-data", type=Path, help="write the data here and keep it")
    # internal
    p.add_argument("--worker", choices=("aerie",), help=argparse.SUPPRESS)
    p.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--worker-threads", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.worker == "aerie":
        aerie_worker(args.data, args.worker_threads)
        return
    if args.quick:
        args.reps, args.warmup = 3, 1
    if not Path(SPECFORGE_PYTHON).exists():
        sys.exit(f"{SPECFORGE_PYTHON} missing: create the SpecForge venv (DESIGN §7)")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    results = []
    for key in args.shapes.split(","):
        shape = SHAPES[key.strip()]
        if args.seq_len:
            shape = Shape(**{**asdict(shape), "seq_len": args.seq_len})
        with tempfile.TemporaryDirectory(prefix=f"aerie-bench-{shape.name}-") as tmp:
            data_dir = args.keep_data / shape.name if args.keep_data else Path(tmp)
            t0 = time.perf_counter()
            meta = make_data(shape, data_dir)
            log(f"shape {shape.name}: {shape.description}, T={shape.seq_len}, "
                f"B={shape.batch}; {meta['trainable_params'] / 1e6:.1f}M trainable params; "
                f"data in {time.perf_counter() - t0:.1f}s")
            for threads in (int(x) for x in args.threads.split(",")):
                log(f"  threads={threads}")
                r = run_shape(shape, threads, data_dir, args.reps, args.warmup,
                              args.compile.split(","), args.profile, log)
                r["meta"] = meta
                results.append(r)
                for name, st in r["sides"].items():
                    if name != "aerie":
                        log(f"  -> {name}/aerie median ratio {st['ratio_median']:.2f}x")
                for side, table in r["profiles"].items():
                    log(f"  torch.profiler, one {side} step (shape {shape.name}, "
                        f"{threads} thread(s)):\n{table}")
    print(markdown(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
