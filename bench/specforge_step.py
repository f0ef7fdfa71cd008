"""SpecForge side of the training benchmarks. Runs INSIDE the SpecForge venv, never Aerie's.

    /tmp/specforge-venv/bin/python bench/specforge_step.py --data DIR --threads N serve
    /tmp/specforge-venv/bin/python bench/specforge_step.py --data DIR --threads N memory
    /tmp/specforge-venv/bin/python bench/specforge_step.py --data DIR vocab   # vocab bench

This file imports nothing from Aerie and contains no SpecForge code: it builds SpecForge
0.2.0's own ``LlamaForCausalLMEagle3`` draft model and ``OnlineEagle3Model`` (TTT + loss)
from the installed package and drives one offline training step the way SpecForge's
``Eagle3TrainStrategy.forward_loss`` does for ``target_repr="hidden_state"``:

    loss_mask[:, -1] = 0                                         # offline loader's rule
    input_ids, target, loss_mask = TargetHead.preprocess(...)   # shift left by one
    target = TargetHead(target)                                  # full-vocab teacher logits
    plosses, ... = OnlineEagle3Model(...)                        # TTT, per-step losses
    loss = sum(0.8 ** i * plosses[i])
    loss.backward(); clip_grad_norm_(params, clip); AdamW.step(); zero_grad()

CPU adaptations (DESIGN §7): ``specforge.core.loss`` imports ``triton`` at module level, so a
stub module sits in ``sys.modules`` only while it is imported; its Triton ``LogSoftmaxLoss``
cannot run on CPU, so the step uses the plain ``_compute_loss`` reference from the same file
(same value, normalised by B·T). The optimiser is a plain fp32 ``torch.optim.AdamW`` (the
same one Aerie's side uses) instead of SpecForge's ``BF16Optimizer`` (which keeps fp32
master copies of bf16 weights -- meaningless in an fp32 run).

``--compile off`` sets ``TORCHDYNAMO_DISABLE=1`` before torch is imported, so SpecForge's
``@torch.compile`` helpers (RMSNorm, RoPE, ``_compute_target_p``, ``_compute_loss``) run
eagerly; ``on`` lets inductor compile them for the CPU (compilation happens in the warm-up
step and is not timed).

Data directory (written by ``bench/training_vs_specforge.py``): ``config.json`` (the
drafter's SGLang config), ``target/config.json`` (a target config for ``TargetHead``),
``weights.safetensors`` (drafter tensors under SGLang names, ``embed_tokens.weight``,
``target_lm_head.weight``), ``batch.safetensors`` (``input_ids``, ``loss_mask``,
``attention_mask``, ``aux_hidden``, ``final_hidden``) and ``meta.json`` (depth, lr, clip,
decay).

``serve`` protocol: one JSON object per line on stdin (``{"cmd": "step"}``,
``{"cmd": "quit"}``); one JSON line answers each on stdout, prefixed ``@@`` so that stray
library prints cannot be mistaken for a reply.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types


def _early_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="data directory (see module docstring)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compile", choices=("on", "off"), default="off",
                   help="let SpecForge's @torch.compile helpers compile (default: eager)")
    p.add_argument("--target-vocab", type=int, default=128256, help="vocab mode")
    p.add_argument("--draft-vocab", type=int, default=32000, help="vocab mode")
    p.add_argument("mode", choices=("serve", "memory", "vocab"),
                   help="serve: step on request; memory: one fwd+bwd, print peak RSS; "
                   "vocab: time SpecForge's vocab-mapping count loop and mapping on "
                   "DATA/tokens.safetensors")
    return p.parse_args()


ARGS = _early_args()
os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)
os.environ["MKL_NUM_THREADS"] = str(ARGS.threads)
if ARGS.compile == "off":
    os.environ["TORCHDYNAMO_DISABLE"] = "1"

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


def _import_specforge():
    """Import the SpecForge pieces; ``triton`` is stubbed only while ``core.loss`` loads."""
    if ARGS.compile == "on":
        # Let dynamo/inductor import (and cache "no triton") BEFORE the stub exists:
        # ``core.loss``'s @torch.compile decorator imports them otherwise, and they would
        # take the stub for a real triton.
        import torch._dynamo.repro.after_dynamo  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401
        import torch._inductor.runtime.triton_compat  # noqa: F401
        from torch.utils._triton import has_triton

        has_triton()
    stub = types.ModuleType("triton")
    stub_lang = types.ModuleType("triton.language")
    stub_lang.constexpr = object
    stub.language = stub_lang
    stub.jit = lambda fn=None, **kw: fn if fn is not None else (lambda f: f)
    stub.next_power_of_2 = lambda n: 1 << max(int(n) - 1, 0).bit_length()
    saved = {k: sys.modules.get(k) for k in ("triton", "triton.language")}
    sys.modules["triton"], sys.modules["triton.language"] = stub, stub_lang
    try:
        import specforge.algorithms.eagle3.model as sf_eagle3
        import specforge.core.loss as sf_loss
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.modeling.target.target_head import TargetHead

    class PlainLogSoftmaxLoss:
        """Drop-in for the Triton ``LogSoftmaxLoss``: SpecForge's own ``_compute_loss``."""

        @staticmethod
        def apply(logits, target_p, position_mask):
            return sf_loss._compute_loss(logits, target_p, position_mask)

    sf_eagle3.LogSoftmaxLoss = PlainLogSoftmaxLoss
    return sf_eagle3, LlamaForCausalLMEagle3, TargetHead


def vm_hwm_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return -1


def vm_rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class SpecForgeTrainer:
    def __init__(self, data_dir: str):
        from transformers import LlamaConfig

        sf_eagle3, Draft, TargetHead = _import_specforge()
        self.sf_eagle3 = sf_eagle3
        with open(os.path.join(data_dir, "meta.json")) as f:
            self.meta = json.load(f)
        with open(os.path.join(data_dir, "config.json")) as f:
            cfg = json.load(f)
        cfg["torch_dtype"] = "float32"
        weights = load_file(os.path.join(data_dir, "weights.safetensors"))
        lm_head_w = weights.pop("target_lm_head.weight")
        config = LlamaConfig(**cfg)
        draft = Draft(config, attention_backend="sdpa").float()
        missing, unexpected = draft.load_state_dict(weights, strict=False, assign=True)
        if missing or unexpected:
            raise RuntimeError(f"weight names do not match SpecForge's model: missing "
                               f"{missing}, unexpected {unexpected}")
        draft.freeze_embedding()
        self.draft = draft
        self.target_head = TargetHead(os.path.join(data_dir, "target"))
        self.target_head.fc.weight = nn.Parameter(lm_head_w, requires_grad=False)
        self.target_head.eval()
        self.model = sf_eagle3.OnlineEagle3Model(draft, length=int(self.meta["depth"]),
                                                 attention_backend="sdpa")
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=self.meta["lr"],
                                     weight_decay=self.meta.get("weight_decay", 0.0))
        b = load_file(os.path.join(data_dir, "batch.safetensors"))
        self.input_ids = b["input_ids"].long()
        self.loss_mask = b["loss_mask"].long()
        # SpecForge's offline loader (``process_offline_eagle3_sample``) zeroes the last
        # loss-mask entry of every sample; do the same so the batch is what it would train on.
        self.loss_mask[:, -1] = 0
        self.attention_mask = b["attention_mask"].long()
        self.aux_hidden = b["aux_hidden"].float()
        self.final_hidden = b["final_hidden"].float()
        self.n_params = sum(p.numel() for p in self.params)

    def forward_loss(self):
        """Teacher + TTT forward + weighted loss, as ``Eagle3TrainStrategy.forward_loss``."""
        t0 = time.perf_counter()
        with torch.no_grad():
            input_ids, target_hidden, loss_mask = self.target_head.preprocess(
                self.input_ids, self.final_hidden, self.loss_mask)
            target = self.target_head(target_hidden)  # (B, T, V) fp32 full-vocab logits
        t1 = time.perf_counter()
        plosses, _, acces, *_ = self.model(
            input_ids=input_ids, attention_mask=self.attention_mask, target=target,
            loss_mask=loss_mask, hidden_states=self.aux_hidden)
        decay = self.meta["decay"]
        loss = sum(decay ** i * p for i, p in enumerate(plosses))
        t2 = time.perf_counter()
        return loss, plosses, acces, (t1 - t0, t2 - t1)

    def step(self) -> dict:
        t0 = time.perf_counter()
        loss, plosses, acces, (t_teacher, t_fwd) = self.forward_loss()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.meta["clip"])
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        return {"total": t3 - t0, "teacher": t_teacher, "forward": t_fwd,
                "backward": t2 - t1, "optimizer": t3 - t2, "loss": float(loss.detach()),
                "step_loss": [float(p.detach()) for p in plosses],
                "accuracy": [float(a) for a in acces], "grad_norm": float(grad_norm),
                "vm_hwm_kib": vm_hwm_kib()}


def vocab_mode() -> None:
    """SpecForge's vocab mapping on the token file the Aerie benchmark wrote.

    The count loop is the one in ``specforge.data.preprocessing.generate_vocab_mapping_file``
    (per sample: masked ids -> ``unique(return_counts=True)`` -> ``Counter.update``), run
    over in-memory tensors instead of an HF dataset; the mapping step is SpecForge's own
    ``process_token_dict_to_mappings``. That module imports ``datasets`` (not installed with
    ``--no-deps``), so a stub stands in for it during the import.
    """
    import hashlib
    from collections import Counter

    saved = sys.modules.get("datasets")
    stub = types.ModuleType("datasets")
    stub.Dataset = object
    sys.modules["datasets"] = stub
    try:
        from specforge.data.preprocessing import process_token_dict_to_mappings
    finally:
        if saved is None:
            sys.modules.pop("datasets", None)
        else:
            sys.modules["datasets"] = saved
    data = load_file(os.path.join(ARGS.data, "tokens.safetensors"))
    input_ids, loss_mask = data["input_ids"], data["loss_mask"]
    t0 = time.perf_counter()
    token_dict = Counter()
    for ids, mask in zip(input_ids, loss_mask, strict=True):
        masked_ids = ids[mask == 1]
        unique_ids, counts = masked_ids.unique(return_counts=True)
        token_dict.update(dict(zip(unique_ids.tolist(), counts.tolist(), strict=True)))
    t1 = time.perf_counter()
    d2t, t2d = process_token_dict_to_mappings(token_dict, ARGS.draft_vocab, ARGS.target_vocab)
    t2 = time.perf_counter()
    used = (torch.arange(d2t.numel()) + d2t).to(torch.int64)
    print("@@" + json.dumps({
        "count_s": t1 - t0, "mapping_s": t2 - t1,
        "used_sha256": hashlib.sha256(used.numpy().tobytes()).hexdigest(),
        "used": used.tolist()}), flush=True)


def main() -> None:
    torch.set_num_threads(ARGS.threads)
    torch.manual_seed(0)
    if ARGS.mode == "vocab":
        vocab_mode()
        return
    if ARGS.mode == "memory":
        # Peak RSS of one forward + backward (teacher included), VmHWM reset right before.
        trainer = SpecForgeTrainer(ARGS.data)
        base = vm_rss_kib()
        reset_hwm()
        t0 = time.perf_counter()
        loss, *_ = trainer.forward_loss()
        loss.backward()
        dt = time.perf_counter() - t0
        print("@@" + json.dumps({"baseline_rss_kib": base, "peak_kib": vm_hwm_kib(),
                                 "seconds": dt, "loss": float(loss.detach())}), flush=True)
        return
    t0 = time.perf_counter()
    trainer = SpecForgeTrainer(ARGS.data)
    print("@@" + json.dumps({"ready": True, "load_s": time.perf_counter() - t0,
                             "trainable_params": trainer.n_params,
                             "torch": torch.__version__, "threads": torch.get_num_threads(),
                             "compile": ARGS.compile}), flush=True)
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        cmd = json.loads(line).get("cmd")
        if cmd == "quit":
            break
        if cmd == "step":
            print("@@" + json.dumps(trainer.step()), flush=True)
        elif cmd == "profile":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                trainer.step()
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25,
                                              max_name_column_width=48)
            print("@@" + json.dumps({"table": table}), flush=True)
        else:
            print("@@" + json.dumps({"error": f"unknown command {cmd!r}"}), flush=True)


if __name__ == "__main__":
    main()
