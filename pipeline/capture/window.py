"""The training window of a refresh step and the target weights the drafter trains against.

A refresh at RL step ``s`` with window ``K`` trains on steps ``s-K+1 .. s`` (clipped at 0).
Every step of the window must be committed; a missing one is an error that names it, never a
silently shorter window.

The teacher and the drafter's frozen embedding come from the policy checkpoint of ``s`` (the
newest policy of the window, the one the drafter will serve): ``lm_head.weight`` and
``model.embed_tokens.weight`` read from its safetensors, or the embedding for both when the
config ties them. Nothing is unpickled.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open

from pipeline.capture.provenance import ENCODING, check_provenance
from pipeline.capture.shards import ShardsDeletedError, read_shards_manifest
from pipeline.contracts import Manifest
from pipeline.eagle3.aux_layers import AUX_CAPTURE, check_aux_layer_ids
from pipeline.layout import policy_prefix, shards_prefix
from pipeline.manifest import verify_manifest
from pipeline.snapshot.policy import POLICY_KIND
from pipeline.storage import Storage
from pipeline.verified import committed, fetch, read_verified

_EMBED_NAMES = ("model.embed_tokens.weight", "embed_tokens.weight")
_HEAD_NAMES = ("lm_head.weight",)


class WindowError(ValueError):
    """The window cannot be trained on (missing or inconsistent steps); names them."""


def window_steps(step: int, window: int) -> list[int]:
    """``[max(0, step-window+1), …, step]``."""
    if step < 0 or window < 1:
        raise ValueError(f"need step >= 0 and window >= 1, got {step}, {window}")
    return list(range(max(0, step - window + 1), step + 1))


def read_window(storage: Storage, steps: Sequence[int],
                read: Callable[[Storage, int], Manifest] = read_shards_manifest,
                what: str = "hidden-state shards") -> dict[int, Manifest]:
    """The committed manifests of ``steps`` (via ``read``); raises naming every missing step."""
    found: dict[int, Manifest] = {}
    missing: list[int] = []
    deleted: list[str] = []
    for s in steps:
        try:
            found[s] = read(storage, s)
        except ShardsDeletedError as e:
            deleted.append(str(e))
        except FileNotFoundError:
            missing.append(s)
    if deleted:
        raise WindowError(f"the window {list(steps)} reads steps whose {what} were deleted: "
                          + "; ".join(deleted))
    if missing:
        raise WindowError(f"the window {list(steps)} lacks committed {what} for step(s) "
                          f"{missing} under {storage.url()}: ingest them first (job "
                          f"ingest_step, one run per RL-step partition; snapshot_sensor runs "
                          f"it for every step the trainer finished), or refresh a step whose "
                          f"window is ingested")
    return found


def verify_window(storage: Storage, manifests: Mapping[int, Manifest]) -> None:
    """Re-hash every shard of the window against its manifest; raises naming each damaged
    file (re-running the step's ingest re-extracts exactly those)."""
    problems = [p for s, m in sorted(manifests.items())
                for p in verify_manifest(storage, shards_prefix(s), m)]
    if problems:
        raise WindowError(f"{len(problems)} shard file(s) of the window differ from their "
                          f"manifests, not training on them: " + "; ".join(problems[:5]))


def shard_geometry(manifests: Mapping[int, Manifest]) -> tuple[int, tuple[int, ...]]:
    """``(hidden_size, aux_layer_ids)`` shared by every step of the window, whose aux states
    were captured in Aerie's convention (:data:`~pipeline.eagle3.aux_layers.AUX_CAPTURE`;
    shards written before it was recorded used it too) with ids every engine can capture."""
    for step, m in sorted(manifests.items()):
        convention = m.meta.get("aux_capture", AUX_CAPTURE)
        if convention != AUX_CAPTURE:
            raise WindowError(f"step {step}: shards hold aux states captured as "
                              f"{convention!r}; training reads {AUX_CAPTURE!r}")
        try:
            check_aux_layer_ids(m.meta["aux_layer_ids"])
        except ValueError as e:
            raise WindowError(f"step {step}: shards' {e}; capture the step again") from None
        record = m.meta.get("provenance")
        if record:  # absent on shards written before it was recorded
            try:
                check_provenance(record, m.meta["aux_layer_ids"], f"step {step} shards",
                                 m.meta.get("encoding", ENCODING))
            except ValueError as e:
                raise WindowError(str(e)) from None
    seen = {(int(m.meta["hidden_size"]), tuple(m.meta["aux_layer_ids"]))
            for m in manifests.values()}
    if len(seen) != 1:
        detail = {s: (m.meta["hidden_size"], m.meta["aux_layer_ids"])
                  for s, m in sorted(manifests.items())}
        raise WindowError(f"the window's shards disagree on (hidden_size, aux_layer_ids): "
                          f"{detail}")
    return seen.pop()


@dataclass(frozen=True, eq=False)
class TargetWeights:
    """What training needs from the target policy (fp32, CPU)."""

    step: int
    uri: str
    sha256: str
    config: dict[str, Any]  # the checkpoint's config.json
    embed: torch.Tensor  # (V, H) token embedding (frozen inside the drafter)
    lm_head: torch.Tensor  # (V, H) teacher head; the embedding itself when tied


def load_target(storage: Storage, step: int) -> TargetWeights:
    """Config, embedding and lm_head of the committed policy checkpoint of ``step``."""
    prefix = policy_prefix(step)
    try:
        manifest = committed(storage, prefix, POLICY_KIND)
    except FileNotFoundError as e:
        raise WindowError(str(e)) from e
    config = json.loads(read_verified(storage, prefix, manifest, "config.json"))
    tied = bool(config.get("tie_word_embeddings", False))
    wanted = {"embed": _EMBED_NAMES} if tied else {"embed": _EMBED_NAMES, "head": _HEAD_NAMES}
    weights = _weight_files(storage, prefix, manifest, wanted)
    if not weights:
        raise WindowError(f"{storage.url(prefix)}: the policy has no safetensors weights")
    # only the files holding the embedding and head, verified, in the dataset cache
    local = fetch(storage, prefix, kind=POLICY_KIND, label="policy-head", paths=weights)
    found: dict[str, torch.Tensor] = {}
    for name in weights:
        with safe_open(str(local / name), framework="pt") as f:
            keys = set(f.keys())
            for role, candidates in wanted.items():
                hit = next((k for k in candidates if k in keys), None)
                if hit is not None and role not in found:
                    found[role] = f.get_tensor(hit).float()
        if len(found) == len(wanted):
            break
    missing = [wanted[r][0] for r in wanted if r not in found]
    if missing:
        raise WindowError(f"{storage.url(prefix)}: tensors {missing} not found in {weights}")
    embed = found["embed"]
    head = embed if tied else found["head"]
    vocab, hidden = int(config["vocab_size"]), int(config["hidden_size"])
    for role, x in (("embedding", embed), ("lm_head", head)):
        if tuple(x.shape) != (vocab, hidden):
            raise WindowError(f"{storage.url(prefix)}: {role} has shape {tuple(x.shape)}, "
                              f"config says ({vocab}, {hidden})")
    return TargetWeights(step=step, uri=storage.url(prefix), sha256=manifest.meta["sha256"],
                         config=config, embed=embed, lm_head=head)



def _weight_files(storage: Storage, prefix: str, manifest: Manifest,
                  wanted: Mapping[str, tuple[str, ...]]) -> list[str]:
    """The safetensors files that hold the ``wanted`` tensors: those the sharded index maps
    them to, or every safetensors file of the checkpoint when it has no index."""
    weights = sorted(f.path for f in manifest.files if f.path.endswith(".safetensors"))
    index_name = "model.safetensors.index.json"
    if index_name not in {f.path for f in manifest.files}:
        return weights
    weight_map = json.loads(read_verified(storage, prefix, manifest, index_name)).get(
        "weight_map", {})
    chosen = {weight_map[n] for names in wanted.values() for n in names if n in weight_map}
    return sorted(chosen & set(weights)) or weights
