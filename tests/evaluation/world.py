"""The evaluation tests' world: two ingested RL steps of a tiny target with held-out
prompts, and random drafters published as the training stage publishes them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from pipeline.algorithms import ALGORITHMS
from pipeline.contracts import Manifest
from pipeline.manifest import entry_for, write_manifest
from pipeline.storage import Storage
from tests.training.world import EXTRACT, build_world, tiny_target

STEPS = (1, 2)
SETTINGS = {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}


def eval_world(root: Path, tie: bool = False) -> tuple[Storage, torch.nn.Module]:
    """STEPS of a 16-sample world under ``root``, 30% of prompts held out; and its target
    (``tie``: tied embeddings, a target that mostly repeats its prompt's last token)."""
    torch.set_num_threads(1)
    target = tiny_target(seed=4, tie=tie)
    extract = replace(EXTRACT, heldout_fraction=0.3)
    return build_world(root, STEPS, samples=16, model=target, extract=extract), target


def publish_drafter(storage: Storage, target, step: int, seed: int, tmp: Path,
                    algorithm: str = "eagle3") -> str:
    """A random drafter of ``algorithm`` published like the training stage does (manifest
    last)."""
    found = ALGORITHMS[algorithm]
    cfg = found.new_config(target.config, draft_vocab_size=64)
    torch.manual_seed(seed)
    model = found.build(cfg, target.get_input_embeddings().weight.detach(),
                        head=target.get_output_embeddings().weight.detach())
    if hasattr(model, "set_vocab"):  # a draft vocab of its own (EAGLE)
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[torch.randperm(cfg.vocab_size)[:64]] = True
        used = t2d.nonzero().flatten()
        model.set_vocab(used - torch.arange(64), t2d)
    local = found.save(model, tmp / f"drafter-{seed}", dtype=torch.float32)
    return publish_drafter_dir(storage, local, f"drafters/step={step:06d}-seed{seed}", step,
                               f"fp-{seed}")


def publish_drafter_dir(storage: Storage, local: Path, prefix: str, step: int,
                        fingerprint: str) -> str:
    """The drafter directory ``local`` published at ``prefix`` as the training stage
    publishes (files, then the manifest), trained on the window :data:`STEPS`."""
    written = storage.upload_dir(local, prefix)
    write_manifest(storage, prefix, Manifest(
        kind="drafter_checkpoint", kind_version=1,
        files=tuple(entry_for(prefix, w) for w in written),
        meta={"step": step, "fingerprint": fingerprint, "window_steps": list(STEPS)}))
    return prefix
