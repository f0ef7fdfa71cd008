"""Extraction: a step's tokenized samples → hidden-state shards (DESIGN §3, §4).

``capture.stage.run`` streams ``tokenized/step=NNNNNN/`` (verified against its manifest), cuts
it into shards of at most ``shard_bytes`` of bf16 states, runs each shard's samples through
a :class:`~pipeline.capture.base.CaptureBackend` in batches under a token budget,
validates what comes back and writes ``shards/step=NNNNNN/shard-*.parquet``; the manifest
is written last.

Invariants:

- **Deterministic plan.** Shard ``i`` always holds the same samples: tokenized order is cut
  greedily by token count. Inside a shard, samples are sorted by length (longest first,
  ties in tokenized order) so that batches carry little padding, and rows are written in
  that order. Same inputs, config, backend and software → same shard names and bytes.
- **Resumable.** After a shard is published, a marker ``_progress/shard-NNNNN.json`` records
  its fingerprint (inputs + batch plan + backend + options) and sha256. A re-run keeps a
  shard whose marker fingerprint matches and whose bytes still hash to the marker, and
  computes only the rest. A committed manifest with the same run fingerprint makes the
  whole call a no-op; a manifest from a different configuration is withdrawn first, so
  readers never see a half-rewritten dataset as committed.
- **Data-parallel.** :func:`start` fixes the run fingerprint; :func:`run_part` writes only
  the shards of one part (``index % of``) and commits nothing; the final :func:`run`
  finds every shard finished and commits (``capture.parallel`` drives the processes).
- **Bounded memory.** At any time: one shard's token ids, one batch of captured states and
  at most one row group of pending rows — never the step.
- **Validated states.** Per sample: one result per input, ``aux_hidden`` ``(T, 3H)`` and
  ``final_hidden`` ``(T, H)`` with the backend's H and ``len(aux_layer_ids)``, floating,
  finite. Stored as bf16 (round to nearest even).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from pipeline.capture.base import CaptureBackend, CapturedStates
from pipeline.capture.config import ExtractConfig
from pipeline.capture.heldout import HeldoutSplit
from pipeline.capture.plan import cut_shards, plan_batches, shard_fingerprint
from pipeline.capture.progress import finished_shard, write_marker
from pipeline.capture.provenance import backend_identity, backend_provenance
from pipeline.capture.shards import (
    FP8_SCHEMA_VERSION,
    SHARD_DTYPE,
    SHARD_SCHEMA_VERSION,
    SHARDS_KIND,
    ShardSample,
    ShardSpec,
    WrittenShard,
    shard_name,
    write_shard,
)
from pipeline.contracts import FileEntry, Manifest
from pipeline.eagle3.aux_layers import AUX_CAPTURE
from pipeline.layout import shards_prefix, tokenized_prefix
from pipeline.manifest import (
    deleted_record,
    entry_for,
    manifest_key,
    read_manifest,
    verify_manifest,
    withdraw_manifest,
    write_manifest,
)
from pipeline.records import to_dict
from pipeline.snapshot.policy import PolicyRef
from pipeline.storage import Storage
from pipeline.tokenize.reader import (
    TokenizedReadError,
    TokenizedSample,
    iter_tokenized,
    read_tokenized_manifest,
)

log = logging.getLogger(__name__)

class ExtractionError(RuntimeError):
    """The inputs or a backend's output break the contract; the message says where."""


@dataclass(frozen=True)
class ExtractSummary:
    """What one ``capture.stage.run`` call produced (or found already committed)."""

    step: int
    url: str
    manifest_url: str
    samples: int
    tokens: int
    loss_tokens: int
    padded_tokens: int  # tokens the planned batches run, padding included
    shards: int
    shards_reused: int
    bytes: int
    hidden_size: int
    aux_layer_ids: tuple[int, ...]
    backend: str
    backend_calls: int
    seconds: float
    already_committed: bool = False
    schema_version: int = SHARD_SCHEMA_VERSION
    heldout: int = 0  # samples whose prompt is held out (not in the shards)
    provenance: dict[str, Any] = field(default_factory=dict)  # empty: written before it
    processes: int = 1  # that extracted it (capture.parallel)

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / max(self.tokens, 1)


@dataclass
class _Counts:
    """Running totals of one call (backend_calls grows while shards are being written)."""

    samples: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    padded_tokens: int = 0
    backend_calls: int = 0
    heldout: int = 0  # samples skipped: their prompt is held out for evaluation
    shard_meta: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Part:
    """Which shards one process of a data-parallel extraction writes: ``index % of``."""

    index: int = 0
    of: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.of:
            raise ValueError(f"part {self.index} of {self.of}: need 0 <= index < of")

    def owns(self, shard: int) -> bool:
        return shard % self.of == self.index


@dataclass(frozen=True)
class PartSummary:
    """What one process wrote of a step (``run_part``); nothing is committed by it."""

    part: Part
    shards_written: int
    shards_kept: int
    backend_calls: int


@dataclass(frozen=True)
class _Plan:
    """What fixes a step's bytes: the shard layout, the run fingerprint, the inputs."""

    step: int
    spec: ShardSpec
    fingerprint: str
    schema_version: int
    identity: dict[str, Any]
    tokenized: Manifest
    policy: PolicyRef | None


def run(storage: Storage, step: int, backend: CaptureBackend,
        config: ExtractConfig = ExtractConfig(), *,
        policy: PolicyRef | None = None, parts_finished: bool = False) -> ExtractSummary:
    """Capture and shard the hidden states of ``step``'s tokenized samples.

    ``policy`` (the checkpoint ``backend`` runs) is recorded as lineage and is part of the
    fingerprint. Raises :class:`ExtractionError` on missing or corrupt input and on states
    that break the contract; whatever shards were finished stay for the next call.
    ``parts_finished``: the parts of this very run (``run_part``) have just written every
    shard, so a shard whose marker matches is checked by size, not downloaded and hashed.
    """
    started = time.perf_counter()
    plan = _plan(storage, step, backend, config, policy)
    committed = _committed_or_withdrawn(storage, plan, started)
    if committed is not None:
        return committed
    counts = _Counts()
    entries, reused = _extract(storage, plan, backend, config, counts, Part(),
                               rehash=not parts_finished)
    return _commit(storage, plan, config, counts, entries, reused, started)


@dataclass(frozen=True)
class Started:
    """A step ready for its parts: the fingerprint each must match, how many shards."""

    fingerprint: str
    shards: int


def start(storage: Storage, step: int, backend: CaptureBackend,
          config: ExtractConfig = ExtractConfig(), *,
          policy: PolicyRef | None = None) -> ExtractSummary | Started:
    """What a data-parallel extraction does before its processes start: the committed
    summary when there is nothing to do, else what its parts need (a manifest from another
    configuration is withdrawn, leftovers swept, inputs checked)."""
    started = time.perf_counter()
    plan = _plan(storage, step, backend, config, policy)
    committed = _committed_or_withdrawn(storage, plan, started)
    if committed is not None:
        return committed
    samples = _without_heldout(_tokenized(storage, step, plan.tokenized),
                               HeldoutSplit(config.heldout_fraction), _Counts())
    tokens_per_shard = max(1, config.shard_bytes // plan.spec.state_bytes_per_token)
    return Started(plan.fingerprint, sum(1 for _ in cut_shards(samples, tokens_per_shard)))


def run_part(storage: Storage, step: int, backend: CaptureBackend, config: ExtractConfig,
             part: Part, fingerprint: str, *, policy: PolicyRef | None = None) -> PartSummary:
    """Write the shards ``part`` owns (keeping those already finished) and commit nothing.

    ``fingerprint`` is the one :func:`start` returned: a process whose backend, config or
    inputs differ would write other bytes, and is refused before it computes anything.
    """
    plan = _plan(storage, step, backend, config, policy)
    if plan.fingerprint != fingerprint:
        raise ExtractionError(
            f"step {step}, part {part.index} of {part.of}: this process's backend, config or "
            f"inputs differ from the run's ({_mismatch(plan.identity, fingerprint)}); every "
            f"part must load the same policy with the same dtype and options")
    counts = _Counts()
    entries, reused = _extract(storage, plan, backend, config, counts, part)
    return PartSummary(part, len(entries) - reused, reused, counts.backend_calls)


def _mismatch(identity: dict[str, Any], fingerprint: str) -> str:
    return f"run {fingerprint[:12]}, this backend {json.dumps(identity, sort_keys=True)}"


def _plan(storage: Storage, step: int, backend: CaptureBackend, config: ExtractConfig,
          policy: PolicyRef | None) -> _Plan:
    try:
        tokenized = read_tokenized_manifest(storage, step)
    except TokenizedReadError as e:
        raise ExtractionError(str(e)) from e
    identity = backend_identity(backend)
    aux_ids = tuple(int(i) for i in backend.aux_layer_ids)
    spec = ShardSpec(step=step, hidden_size=int(backend.hidden_size), aux_layer_ids=aux_ids,
                     extra={"backend": json.dumps(identity, sort_keys=True),
                            "policy_sha256": policy.sha256 if policy else ""},
                     provenance=backend_provenance(backend, identity, aux_ids,
                                                    config.encoding),
                     encoding=config.encoding)
    schema_version = (SHARD_SCHEMA_VERSION if config.encoding == SHARD_DTYPE
                      else FP8_SCHEMA_VERSION)
    settings = asdict(config)
    if config.encoding == SHARD_DTYPE:  # added later: bf16 steps committed before keep
        del settings["encoding"]        # their fingerprint
    params = {
        "kind": SHARDS_KIND, "schema_version": schema_version, "step": step,
        "hidden_size": spec.hidden_size, "aux_layer_ids": list(spec.aux_layer_ids),
        "backend": identity, "policy_sha256": policy.sha256 if policy else None,
        "config": settings,
        "tokenized": [[f.path, f.sha256] for f in tokenized.files],
    }
    return _Plan(step, spec, _sha256_json(params), schema_version, identity, tokenized, policy)


def _committed_or_withdrawn(storage: Storage, plan: _Plan, started: float
                            ) -> ExtractSummary | None:
    """The summary of an intact commit of this very run; otherwise None, with any other
    commit withdrawn, what a killed run left swept, and the inputs verified."""
    step, out_prefix = plan.step, shards_prefix(plan.step)
    existing = read_manifest(storage, out_prefix)
    if existing is not None and deleted_record(existing) is not None:
        log.info("step %d: shards were deleted by storage retention (%s); extracting again",
                 step, deleted_record(existing))
        existing = None
    damaged = (verify_manifest(storage, out_prefix, existing)
               if existing is not None and existing.meta.get("fingerprint") == plan.fingerprint
               else None)
    if damaged == []:
        log.info("step %d: hidden-state shards already committed (%s)", step,
                 plan.fingerprint[:12])
        return _summary(storage, out_prefix, existing, shards_reused=len(existing.files),
                        backend_calls=0, started=started, already_committed=True)
    if damaged:
        log.warning("step %d: committed shards differ from their manifest (%s); withdrawing "
                    "it and re-extracting the damaged shards", step, "; ".join(damaged[:3]))
    elif existing is not None:
        log.warning("step %d: committed shards were made with another configuration; "
                    "withdrawing the manifest and rebuilding", step)
    withdraw_manifest(storage, out_prefix)  # also sweeps what a killed run left

    problems = verify_manifest(storage, tokenized_prefix(step), plan.tokenized)
    if problems:
        raise ExtractionError("corrupt tokenized input: " + "; ".join(problems))
    return None


def _extract(storage: Storage, plan: _Plan, backend: CaptureBackend, config: ExtractConfig,
             counts: _Counts, part: Part, rehash: bool = True) -> tuple[list[FileEntry], int]:
    """Write (or keep) the shards ``part`` owns; their entries and how many were kept."""
    out_prefix = shards_prefix(plan.step)
    tokens_per_shard = max(1, config.shard_bytes // plan.spec.state_bytes_per_token)
    entries: list[FileEntry] = []
    reused = 0
    split = HeldoutSplit(config.heldout_fraction)
    samples = _without_heldout(_tokenized(storage, plan.step, plan.tokenized), split, counts)
    for index, shard_samples in enumerate(cut_shards(samples, tokens_per_shard)):
        if not part.owns(index):
            continue
        batches = plan_batches(shard_samples, config)
        shard_fp = shard_fingerprint(plan.fingerprint, index, batches)
        name = shard_name(index)
        written = finished_shard(storage, out_prefix, name, shard_fp, rehash=rehash)
        if written is None:
            written = _write_one_shard(storage, f"{out_prefix}/{name}", plan.spec, shard_fp,
                                       batches, backend, config, counts)
        else:
            reused += 1
            log.info("step %d: kept finished %s", plan.step, name)
        counts.samples += written.rows
        counts.tokens += written.tokens
        counts.loss_tokens += sum(int(s.loss_mask.sum()) for s in shard_samples)
        counts.padded_tokens += sum(len(b) * max(s.num_tokens for s in b) for b in batches)
        counts.shard_meta.append({"path": name, "rows": written.rows, "tokens": written.tokens,
                                  "row_groups": written.row_groups, "fingerprint": shard_fp})
        entries.append(entry_for(out_prefix, written.obj, rows=written.rows))
    return entries, reused


def _commit(storage: Storage, plan: _Plan, config: ExtractConfig, counts: _Counts,
            entries: list[FileEntry], reused: int, started: float) -> ExtractSummary:
    step, spec, policy, out_prefix = plan.step, plan.spec, plan.policy, shards_prefix(plan.step)
    manifest = Manifest(kind=SHARDS_KIND, kind_version=plan.schema_version,
                        files=tuple(entries), meta={
                            "step": step, "fingerprint": plan.fingerprint,
                            "samples": counts.samples, "tokens": counts.tokens,
                            "loss_tokens": counts.loss_tokens,
                            "padded_tokens": counts.padded_tokens,
                            "heldout": {**to_dict(HeldoutSplit(config.heldout_fraction)),
                                        "samples": counts.heldout},
                            "hidden_size": spec.hidden_size, "aux_width": spec.aux_width,
                            "aux_layer_ids": list(spec.aux_layer_ids),
                            "aux_capture": AUX_CAPTURE, "dtype": SHARD_DTYPE,
                            "encoding": config.encoding,
                            "provenance": dict(spec.provenance or {}),
                            "backend": plan.identity.get("backend", "?"),
                            "backend_config": plan.identity,
                            "policy_uri": policy.key if policy else None,
                            "policy_sha256": policy.sha256 if policy else None,
                            "tokenized_uri": tokenized_prefix(step),
                            "config": asdict(config), "shards": counts.shard_meta})
    write_manifest(storage, out_prefix, manifest)
    return _summary(storage, out_prefix, manifest, shards_reused=reused,
                    backend_calls=counts.backend_calls, started=started)


def _summary(storage: Storage, prefix: str, manifest: Manifest, *, shards_reused: int,
             backend_calls: int, started: float, already_committed: bool = False
             ) -> ExtractSummary:
    m = manifest.meta
    return ExtractSummary(
        step=m["step"], url=storage.url(prefix), manifest_url=storage.url(manifest_key(prefix)),
        samples=m["samples"], tokens=m["tokens"], loss_tokens=m["loss_tokens"],
        padded_tokens=m["padded_tokens"], shards=len(manifest.files),
        shards_reused=shards_reused, bytes=manifest.total_bytes, hidden_size=m["hidden_size"],
        aux_layer_ids=tuple(m["aux_layer_ids"]), backend=m["backend"],
        backend_calls=backend_calls, seconds=time.perf_counter() - started,
        already_committed=already_committed, schema_version=manifest.kind_version,
        heldout=m["heldout"]["samples"], provenance=m.get("provenance", {}))


def _without_heldout(samples: Iterator[TokenizedSample], split: HeldoutSplit, counts: _Counts
                     ) -> Iterator[TokenizedSample]:
    for s in samples:
        if split.holds_out(s.input_ids, s.loss_mask):
            counts.heldout += 1
        else:
            yield s


def _sha256_json(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


# -- capture ----------------------------------------------------------------------------
def _write_one_shard(storage: Storage, key: str, spec: ShardSpec, fingerprint: str,
                     batches: Sequence[list[TokenizedSample]], backend: CaptureBackend,
                     config: ExtractConfig, counts: _Counts) -> WrittenShard:
    """Capture ``batches`` and publish them as shard ``key``, then its progress marker."""
    shard_spec = ShardSpec(step=spec.step, hidden_size=spec.hidden_size,
                           aux_layer_ids=spec.aux_layer_ids,
                           extra={**spec.extra, "fingerprint": fingerprint},
                           provenance=spec.provenance, encoding=spec.encoding)
    written = write_shard(storage, key, shard_spec,
                          _captured_rows(backend, batches, spec, counts),
                          row_group_bytes=config.row_group_bytes,
                          compression=config.compression)
    prefix, name = key.rsplit("/", 1)
    write_marker(storage, prefix, name, fingerprint, written)
    log.info("%s: %d samples, %d tokens, %d bytes", storage.url(key), written.rows,
             written.tokens, written.obj.bytes)
    return written


def _captured_rows(backend: CaptureBackend, batches: Sequence[list[TokenizedSample]],
                   spec: ShardSpec,
                   counts: _Counts) -> Iterator[ShardSample]:
    """Rows of one shard, capturing batch by batch as the writer asks for them."""
    for batch in batches:
        states = backend.capture([s.input_ids.tolist() for s in batch])
        counts.backend_calls += 1
        if len(states) != len(batch):
            raise ExtractionError(f"backend returned {len(states)} results for a batch of "
                                  f"{len(batch)}")
        yield from (_to_row(sample, st, spec) for sample, st in zip(batch, states, strict=True))
        del states  # before the next capture: hold one batch of states, not two


def _to_row(sample: TokenizedSample, st: CapturedStates, spec: ShardSpec) -> ShardSample:
    t = sample.num_tokens
    for name, x, width in (("aux_hidden", st.aux_hidden, spec.aux_width),
                           ("final_hidden", st.final_hidden, spec.hidden_size)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ExtractionError(f"sample {sample.sample_id!r}: {name} is not a float tensor")
        if tuple(x.shape) != (t, width):
            raise ExtractionError(f"sample {sample.sample_id!r}: {name} has shape "
                                  f"{tuple(x.shape)}, expected ({t}, {width})")
        if not bool(torch.isfinite(x).all()):
            raise ExtractionError(f"sample {sample.sample_id!r}: {name} has non-finite values")
    return ShardSample(
        sample_id=sample.sample_id, step=spec.step,
        input_ids=torch.from_numpy(sample.input_ids),
        loss_mask=torch.from_numpy(sample.loss_mask).view(torch.bool),
        aux_hidden=st.aux_hidden.to(torch.bfloat16).contiguous(),  # (T, 3H)
        final_hidden=st.final_hidden.to(torch.bfloat16).contiguous())  # (T, H)


def _tokenized(storage: Storage, step: int, manifest: Manifest) -> Iterator[TokenizedSample]:
    try:
        yield from iter_tokenized(storage, step, manifest)
    except TokenizedReadError as e:
        raise ExtractionError(str(e)) from e
