"""Draft vocabulary: which target tokens the drafter can propose (``d2t`` / ``t2d``).

EAGLE-3 drafters predict over a reduced vocabulary of the ``draft_vocab_size`` target tokens
seen most often under the loss mask of the training window. Two tensors describe it, in the
layout SGLang loads:

- ``d2t`` int64 ``(Vd,)``: offsets, draft id ``i`` ↦ target id ``i + d2t[i]``;
- ``t2d`` bool ``(V,)``: ``t2d[j]`` is True iff target id ``j`` is in the draft vocab.

Invariants:

- The draft ids are the target ids sorted ascending: ``used = arange(Vd) + d2t`` is strictly
  increasing and equals ``t2d.nonzero()``, so ``x[..., t2d]`` lists target columns in draft
  order.
- Selection is deterministic: count descending, then target id ascending. When fewer than
  ``Vd`` distinct ids were seen, the remaining slots are the smallest unseen ids (count 0
  sorts after every seen id, ties by id).
- ``Vd = min(draft_vocab_size, V)``.
- Counting is vectorised (``torch.bincount`` over buffered masked ids), never a Python loop
  over tokens; ids outside ``[0, V)`` are refused.
- The cache key is a content hash of the inputs' digests (order-free, since counts are) and
  both vocab sizes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from pipeline.contracts import Manifest
from pipeline.eagle3.model import check_vocab_mapping
from pipeline.formats import VOCAB_SCHEMA_VERSION
from pipeline.vocab.config import DEFAULT_DRAFT_VOCAB_SIZE

_FLUSH_TOKENS = 1 << 22  # buffered masked ids per bincount


class TokenCounter:
    """Counts target token ids under the loss mask over a stream of samples.

    Masked ids are buffered and reduced with one ``bincount(minlength=V)`` per ~4M tokens, so
    the per-sample cost is a boolean gather, not an ``O(V)`` pass.
    """

    def __init__(self, target_vocab_size: int, *, flush_tokens: int = _FLUSH_TOKENS):
        if target_vocab_size < 1:
            raise ValueError(f"target_vocab_size must be >= 1, got {target_vocab_size}")
        self.target_vocab_size = target_vocab_size
        self._counts = torch.zeros(target_vocab_size, dtype=torch.int64)
        self._pending: list[torch.Tensor] = []
        self._pending_tokens = 0
        self._flush_tokens = flush_tokens

    def update(self, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> None:
        """Add the ids of ``input_ids`` (any shape) where ``loss_mask`` (same shape) is on."""
        if input_ids.shape != loss_mask.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and loss_mask "
                             f"{tuple(loss_mask.shape)} differ in shape")
        ids = input_ids.reshape(-1)[loss_mask.reshape(-1).to(torch.bool)].to(torch.int64)
        if ids.numel() == 0:
            return
        lo, hi = (int(x) for x in torch.aminmax(ids))
        if lo < 0 or hi >= self.target_vocab_size:
            raise ValueError(f"token id {lo if lo < 0 else hi} is outside the target vocab "
                             f"[0, {self.target_vocab_size})")
        self._pending.append(ids)
        self._pending_tokens += ids.numel()
        if self._pending_tokens >= self._flush_tokens:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            ids = torch.cat(self._pending)
            self._counts += torch.bincount(ids, minlength=self.target_vocab_size)
            self._pending, self._pending_tokens = [], 0

    def counts(self) -> torch.Tensor:
        """``(V,)`` int64 occurrences of each target id under the mask so far (a copy)."""
        self._flush()
        return self._counts.clone()


def count_masked_tokens(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]],
                        target_vocab_size: int) -> torch.Tensor:
    """``(V,)`` int64 counts over a stream of ``(input_ids, loss_mask)`` pairs."""
    counter = TokenCounter(target_vocab_size)
    for input_ids, loss_mask in pairs:
        counter.update(input_ids, loss_mask)
    return counter.counts()


@dataclass(frozen=True, eq=False)
class VocabMapping:
    """A draft vocabulary with the statistics it was chosen from.

    ``coverage`` is the fraction of masked tokens whose id is in the draft vocab.
    """

    d2t: torch.Tensor  # (Vd,) int64 offsets: draft i -> target i + d2t[i]
    t2d: torch.Tensor  # (V,) bool membership of target ids
    counts: torch.Tensor  # (V,) int64 masked-token counts it was built from
    coverage: float
    cache_key: str = ""

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.shape[0])

    @property
    def target_vocab_size(self) -> int:
        return int(self.t2d.shape[0])

    @property
    def draft_to_target(self) -> torch.Tensor:
        """``(Vd,)`` int64 target id of each draft id (ascending)."""
        return torch.arange(self.draft_vocab_size, dtype=torch.int64) + self.d2t

    def summary(self) -> dict[str, int | float | str]:
        """JSON-friendly statistics (for asset metadata and logs)."""
        counts = self.counts
        seen = int((counts > 0).sum())
        return {
            "target_vocab_size": self.target_vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "masked_tokens": int(counts.sum()),
            "distinct_tokens": seen,
            "padded_ids": max(0, self.draft_vocab_size - seen),
            "coverage": self.coverage,
            "cache_key": self.cache_key,
        }


def build_vocab_mapping(counts: torch.Tensor, draft_vocab_size: int = DEFAULT_DRAFT_VOCAB_SIZE,
                        *, cache_key: str = "") -> VocabMapping:
    """The top ``draft_vocab_size`` ids of ``counts`` (``(V,)``), as a :class:`VocabMapping`.

    Raises ``ValueError`` when no token was counted: a draft vocab chosen from nothing would be
    silently arbitrary.
    """
    if counts.dim() != 1 or counts.numel() == 0:
        raise ValueError(f"counts must be a non-empty (V,) tensor, got {tuple(counts.shape)}")
    if draft_vocab_size < 1:
        raise ValueError(f"draft_vocab_size must be >= 1, got {draft_vocab_size}")
    counts = counts.to(torch.int64)
    if bool((counts < 0).any()):
        raise ValueError("counts must be non-negative")
    total = int(counts.sum())
    if total == 0:
        raise ValueError("no masked tokens were counted; cannot choose a draft vocab")
    vocab = counts.numel()
    k = min(draft_vocab_size, vocab)
    # A stable descending sort keeps equal counts in ascending id order: the tie-break rule,
    # and the rule for padding with unseen ids (count 0, smallest ids first).
    order = torch.sort(counts, descending=True, stable=True).indices
    used = torch.sort(order[:k]).values  # (Vd,) ascending target ids
    d2t = used - torch.arange(k, dtype=torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    coverage = int(counts[used].sum()) / total
    return VocabMapping(d2t=d2t, t2d=t2d, counts=counts, coverage=coverage, cache_key=cache_key)


def vocab_cache_key(input_digests: Iterable[str], target_vocab_size: int,
                    draft_vocab_size: int) -> str:
    """Content hash naming a vocab mapping: the inputs' digests (as a set) and both sizes."""
    payload = {
        "kind": "vocab_mapping",
        "version": VOCAB_SCHEMA_VERSION,
        "inputs": sorted(set(input_digests)),
        "target_vocab_size": int(target_vocab_size),
        "draft_vocab_size": int(draft_vocab_size),
    }
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def manifest_digests(manifests: Iterable[Manifest]) -> list[str]:
    """The sha256 of every data file of ``manifests``: the content the vocab is counted from."""
    return [entry.sha256 for m in manifests for entry in m.files]


# -- persistence -------------------------------------------------------------------------
def vocab_mapping_to_bytes(mapping: VocabMapping) -> bytes:
    """safetensors bytes: ``d2t``, ``t2d``, ``counts`` plus JSON-safe metadata."""
    meta = {
        "kind": "vocab_mapping",
        "schema_version": str(VOCAB_SCHEMA_VERSION),
        "coverage": repr(mapping.coverage),
        "cache_key": mapping.cache_key,
        "draft_vocab_size": str(mapping.draft_vocab_size),
        "target_vocab_size": str(mapping.target_vocab_size),
    }
    tensors = {"d2t": mapping.d2t.contiguous(), "t2d": mapping.t2d.contiguous(),
               "counts": mapping.counts.contiguous()}
    return _sorted_header(st_save(tensors, metadata=meta))


def _sorted_header(data: bytes) -> bytes:
    """safetensors ``data`` with its JSON header's keys sorted. The writer keeps metadata in
    a hash map, so without this one mapping gives different bytes (and sha256) from one
    process to the next. Offsets count from the end of the header: the tensors stay put."""
    n = int.from_bytes(data[:8], "little")
    header = json.dumps(json.loads(data[8:8 + n]), sort_keys=True,
                        separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the format pads the header to 8 bytes
    return len(header).to_bytes(8, "little") + header + data[8 + n:]


def vocab_mapping_from_bytes(data: bytes) -> VocabMapping:
    """Inverse of :func:`vocab_mapping_to_bytes`; validates the mapping's invariants."""
    meta = _safetensors_metadata(data)
    if meta.get("kind") != "vocab_mapping" or meta.get("schema_version") != str(
            VOCAB_SCHEMA_VERSION):
        raise ValueError(f"not a vocab mapping v{VOCAB_SCHEMA_VERSION}: metadata {meta}")
    tensors = st_load(data)
    mapping = VocabMapping(d2t=tensors["d2t"], t2d=tensors["t2d"], counts=tensors["counts"],
                           coverage=float(meta["coverage"]), cache_key=meta.get("cache_key", ""))
    check_vocab_mapping(mapping.d2t, mapping.t2d)
    return mapping


def save_vocab_mapping(mapping: VocabMapping, path: str | Path) -> Path:
    """Write ``mapping`` to a local safetensors file atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(vocab_mapping_to_bytes(mapping))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_vocab_mapping(path: str | Path) -> VocabMapping:
    return vocab_mapping_from_bytes(Path(path).read_bytes())


def _safetensors_metadata(data: bytes) -> Mapping[str, str]:
    """The ``__metadata__`` of a safetensors blob (8-byte LE header length, JSON header)."""
    if len(data) < 8:
        raise ValueError("not a safetensors blob (too short)")
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    return header.get("__metadata__", {})
