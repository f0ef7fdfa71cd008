"""Hidden-state shards: the Parquet files extraction writes and drafter training reads.

Layout: ``shards/step=NNNNNN/shard-00000.parquet …`` plus ``_manifest.json`` (kind
``hidden_state_shards``), written last. One row per sample:

=============  =====================  ==============================================
column         Arrow type             content
=============  =====================  ==============================================
sample_id      string                 the tokenized sample's id (the rollout_id)
step           int64                  RL step of the snapshot
input_ids      list<int32>            ``(T,)``
loss_mask      list<int8>             ``(T,)`` 0/1; read back as a ``torch.bool`` view
aux_hidden     large_binary           bf16 bits of the ``(T, 3H)`` aux states
final_hidden   large_binary           bf16 bits of the ``(T, H)`` post-norm final state
=============  =====================  ==============================================

FP8 (opt-in, ``ShardSpec.encoding``: ``fp8-aux`` for ``aux_hidden``, ``fp8`` for both):
such a column holds :mod:`pipeline.capture.fp8`'s bytes, float8 e4m3 with a float32 scale
per token; those shards are schema version 2, their footer names the encoding, and readers
decode them to bf16, so every consumer sees the same dtype.

Invariants:

- **Exact bf16 bits** (bf16 columns). Arrow has no bf16, so a state tensor is stored as
  the raw bytes of its row-major ``(T, W)`` bf16 tensor, little-endian, one binary value
  per sample. Every bit pattern (NaN payloads, ±inf, subnormals, -0) round-trips unchanged.
- **One copy on read** (bf16 columns; an fp8 column is decoded into a new tensor). The
  Parquet decoder writes each value into an Arrow buffer (after I/O and zstd
  decompression, which any Parquet read does); the tensors handed out are
  ``torch.frombuffer`` views of those Arrow buffers — ``data_ptr`` lies inside them, no
  further copy. They share memory with their row group and keep all of it alive: clone a
  sample to keep it past its group, or to modify it in place. (A ``list<uint16>`` layout
  would decode ~5× slower: it carries a repetition level per element; one binary value per
  sample is a single memcpy.)
- **Streaming.** Writers flush a row group whenever the pending states would exceed
  ``row_group_bytes`` (a single bigger sample forms its own group); readers hold one row
  group at a time. Memory is bounded by the row-group budget, never by the shard or step.
- **Self-describing.** The file's key-value metadata carries the schema version, ``H``,
  ``3H``, the aux layer ids, the dtype, the layout, the step, the provenance (engine, its
  version and the capture conventions, :mod:`pipeline.capture.provenance`: a shard in
  other conventions is refused on read) and (added at close) rows and tokens. Page
  checksums are written and verified on every read.
- **Deterministic bytes.** Same rows, same options and same pyarrow version give the same
  file bytes (no timestamps anywhere).

Limit: one sample's ``aux_hidden`` must stay under 2 GiB (a Parquet value's length is an
int32), e.g. T ≤ 43k tokens at H = 8192; the writer refuses longer samples by name.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pipeline.capture.arrow_tensors import binary_array, binary_views, list_array, list_views
from pipeline.capture.config import DEFAULT_ROW_GROUP_BYTES
from pipeline.capture.fp8 import FP8_LAYOUT, fp8_columns, fp8_decode, fp8_encode, value_bytes
from pipeline.capture.provenance import ENCODING, ENCODINGS, check_provenance
from pipeline.contracts import Manifest
from pipeline.formats import FP8_SCHEMA_VERSION, SHARD_SCHEMA_VERSION
from pipeline.layout import shards_prefix
from pipeline.manifest import DeletedByRetention, deleted_note, deleted_record, read_manifest
from pipeline.parquet import ParquetFileError, open_parquet
from pipeline.storage import Storage, WrittenObject

SHARDS_KIND = "hidden_state_shards"
READABLE_VERSIONS = (SHARD_SCHEMA_VERSION, FP8_SCHEMA_VERSION)
SHARD_DTYPE = ENCODING  # what readers hand states out as, whatever the encoding
SHARD_LAYOUT = "aux_hidden, final_hidden: little-endian bf16 bits of a row-major (T, W) tensor"
_MAX_VALUE_BYTES = (1 << 31) - 1  # a Parquet BYTE_ARRAY value has an int32 length
_KEY = "aerie."  # prefix of Aerie's key-value metadata

SHARD_SCHEMA = pa.schema([
    pa.field("sample_id", pa.string(), nullable=False),
    pa.field("step", pa.int64(), nullable=False),
    pa.field("input_ids", pa.list_(pa.int32()), nullable=False),  # (T,)
    pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),  # (T,) 0/1
    pa.field("aux_hidden", pa.large_binary(), nullable=False),  # bf16 (T, 3H)
    pa.field("final_hidden", pa.large_binary(), nullable=False),  # bf16 (T, H)
])

def shard_name(index: int) -> str:
    return f"shard-{index:05d}.parquet"


@dataclass(frozen=True)
class ShardSample:
    """One row of a shard as tensors (views of Arrow memory when read back)."""

    sample_id: str
    step: int
    input_ids: torch.Tensor  # (T,) int32
    loss_mask: torch.Tensor  # (T,) bool
    aux_hidden: torch.Tensor  # (T, 3H) bfloat16
    final_hidden: torch.Tensor  # (T, H) bfloat16

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True)
class ShardSpec:
    """What every row of a shard shares; ``extra`` goes to the metadata as ``aerie.<key>``."""

    step: int
    hidden_size: int
    aux_layer_ids: tuple[int, ...]
    extra: Mapping[str, str] = field(default_factory=dict)
    provenance: Mapping[str, Any] | None = None  # pipeline.capture.provenance.provenance()
    encoding: str = ENCODING  # bfloat16 | fp8-aux | fp8 (pipeline.capture.provenance)

    @property
    def aux_width(self) -> int:
        return self.hidden_size * len(self.aux_layer_ids)

    @property
    def state_bytes_per_token(self) -> int:
        """Stored bytes per token: aux + final, each bf16 or fp8 with a 4-byte scale."""
        return (value_bytes(1, self.aux_width, self.encoding != ENCODING)
                + value_bytes(1, self.hidden_size, self.encoding == "fp8"))


@dataclass(frozen=True)
class ShardInfo:
    """A shard's footer: what :func:`read_shard_info` finds without reading any data."""

    schema_version: int
    step: int
    hidden_size: int
    aux_width: int
    aux_layer_ids: tuple[int, ...]
    dtype: str
    rows: int
    tokens: int
    row_groups: int
    extra: dict[str, str] = field(default_factory=dict)
    provenance: dict[str, Any] | None = None  # None: written before it was recorded
    encoding: str = ENCODING


@dataclass(frozen=True)
class WrittenShard:
    """A published shard: the object (key, bytes, sha256) and its counts."""

    obj: WrittenObject
    rows: int
    tokens: int
    row_groups: int


# -- writing ---------------------------------------------------------------------------
def write_shard(storage: Storage, key: str, spec: ShardSpec, samples: Iterable[ShardSample],
                *, row_group_bytes: int = DEFAULT_ROW_GROUP_BYTES,
                compression: str = "zstd") -> WrittenShard:
    """Atomically write the rows of ``samples`` (consumed lazily) to ``key``.

    Holds at most one row group of samples; an exception from ``samples`` (or a bad row)
    publishes nothing. Raises ``ValueError`` on a row that breaks the schema.
    """
    _require_little_endian()
    schema = SHARD_SCHEMA.with_metadata(_spec_metadata(spec))
    rows = tokens = groups = 0
    pending: list[ShardSample] = []
    pending_bytes = 0
    with storage.open_write(key) as f:
        writer = pq.ParquetWriter(
            f, schema, compression=compression, use_dictionary=False, write_statistics=False,
            write_page_checksum=True)
        try:
            for sample in samples:
                size = _check_sample(sample, spec)
                if pending and pending_bytes + size > row_group_bytes:
                    writer.write_table(_row_group(pending, schema, spec.encoding),
                                       row_group_size=len(pending))
                    groups += 1
                    pending, pending_bytes = [], 0
                pending.append(sample)
                pending_bytes += size
                rows += 1
                tokens += sample.num_tokens
            if pending:
                writer.write_table(_row_group(pending, schema, spec.encoding),
                                       row_group_size=len(pending))
                groups += 1
            pending = []
            writer.add_key_value_metadata({f"{_KEY}rows": str(rows), f"{_KEY}tokens": str(tokens)})
        finally:
            writer.close()
    return WrittenShard(WrittenObject(key, f.bytes, f.hexdigest()), rows, tokens, groups)


def _spec_metadata(spec: ShardSpec) -> dict[str, str]:
    if spec.encoding not in ENCODINGS:
        raise ValueError(f"shard encoding must be one of {ENCODINGS}, got {spec.encoding!r}")
    fp8 = spec.encoding != ENCODING
    meta = {
        "kind": "hidden_state_shard",
        "schema_version": str(FP8_SCHEMA_VERSION if fp8 else SHARD_SCHEMA_VERSION),
        "step": str(spec.step),
        "hidden_size": str(spec.hidden_size),
        "aux_width": str(spec.aux_width),
        "aux_layer_ids": json.dumps(list(spec.aux_layer_ids)),
        "dtype": SHARD_DTYPE,
        "layout": SHARD_LAYOUT,
    }
    if fp8:
        meta.update(encoding=spec.encoding, layout=f"{SHARD_LAYOUT}; {FP8_LAYOUT}")
    if spec.provenance is not None:
        check_provenance(spec.provenance, spec.aux_layer_ids, "shard spec", spec.encoding)
        meta["provenance"] = json.dumps(dict(spec.provenance), sort_keys=True)
    clash = set(meta) & set(spec.extra)
    if clash:
        raise ValueError(f"extra shard metadata may not override {sorted(clash)}")
    return {f"{_KEY}{k}": v for k, v in sorted({**meta, **spec.extra}.items())}


def _check_sample(s: ShardSample, spec: ShardSpec) -> int:
    """Validate one row against ``spec``; returns its state bytes."""
    t = s.num_tokens
    where = f"sample {s.sample_id!r}"
    if s.step != spec.step:
        raise ValueError(f"{where}: step {s.step} in a shard of step {spec.step}")
    if t < 1 or s.input_ids.dim() != 1 or tuple(s.loss_mask.shape) != (t,):
        raise ValueError(f"{where}: input_ids {tuple(s.input_ids.shape)} and loss_mask "
                         f"{tuple(s.loss_mask.shape)} must both be (T,) with T >= 1")
    if s.input_ids.dtype != torch.int32 or s.loss_mask.dtype not in (torch.bool, torch.int8):
        raise ValueError(f"{where}: input_ids must be int32 and loss_mask bool/int8, got "
                         f"{s.input_ids.dtype}, {s.loss_mask.dtype}")
    if s.loss_mask.dtype == torch.int8 and bool(((s.loss_mask != 0) & (s.loss_mask != 1)).any()):
        raise ValueError(f"{where}: loss_mask values must be 0 or 1")
    for name, x, width, fp8 in zip(("aux_hidden", "final_hidden"), (s.aux_hidden, s.final_hidden),
                                   (spec.aux_width, spec.hidden_size),
                                   fp8_columns(spec.encoding), strict=True):
        if x.dtype != torch.bfloat16 or tuple(x.shape) != (t, width):
            raise ValueError(f"{where}: {name} must be bfloat16 ({t}, {width}), got "
                             f"{x.dtype} {tuple(x.shape)}")
        if fp8 and not bool(torch.isfinite(x).all()):
            raise ValueError(f"{where}: {name} has non-finite values, which {spec.encoding} "
                             "cannot scale; store it as bfloat16")
        if x.numel() * 2 > _MAX_VALUE_BYTES:
            raise ValueError(f"{where}: {name} is {x.numel() * 2} bytes; Parquet values are "
                             "limited to 2 GiB (shorten the sample)")
    return t * spec.state_bytes_per_token


def _row_group(samples: list[ShardSample], schema: pa.Schema, encoding: str) -> pa.Table:
    """Arrow columns over the samples' memory: one chunk per sample, no concatenation."""
    if not samples:
        return schema.empty_table()
    columns: dict[str, list[pa.Array]] = {name: [] for name in schema.names}
    aux_fp8, final_fp8 = fp8_columns(encoding)
    for s in samples:
        columns["sample_id"].append(pa.array([s.sample_id], pa.string()))
        columns["step"].append(pa.array([s.step], pa.int64()))
        columns["input_ids"].append(list_array(s.input_ids, pa.int32()))
        columns["loss_mask"].append(list_array(s.loss_mask.view(torch.int8), pa.int8()))
        columns["aux_hidden"].append(binary_array(fp8_encode(s.aux_hidden) if aux_fp8
                                                else s.aux_hidden))
        columns["final_hidden"].append(binary_array(fp8_encode(s.final_hidden) if final_fp8
                                                  else s.final_hidden))
    arrays = [pa.chunked_array(columns[f.name], f.type) for f in schema]
    return pa.Table.from_arrays(arrays, schema=schema)


# -- reading ---------------------------------------------------------------------------
def _info(pf: pq.ParquetFile, url: str) -> ShardInfo:
    raw = {k.decode(): v.decode() for k, v in (pf.metadata.metadata or {}).items()
           if k.startswith(_KEY.encode())}
    meta = {k[len(_KEY):]: v for k, v in raw.items()}
    try:
        version = int(meta["schema_version"])
        if meta.get("kind") != "hidden_state_shard" or version not in READABLE_VERSIONS:
            raise ValueError(f"kind {meta.get('kind')!r} version {version} is not a "
                             f"hidden_state_shard of version {READABLE_VERSIONS}")
        if meta["dtype"] != SHARD_DTYPE:
            raise ValueError(f"dtype {meta['dtype']!r} is not {SHARD_DTYPE}")
        encoding = meta.get("encoding", ENCODING) if version == FP8_SCHEMA_VERSION else ENCODING
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding {encoding!r} is not one of {ENCODINGS}")
        known = {"kind", "schema_version", "step", "hidden_size", "aux_width",
                 "aux_layer_ids", "dtype", "layout", "rows", "tokens", "provenance", "encoding"}
        aux_layer_ids = tuple(json.loads(meta["aux_layer_ids"]))
        record = json.loads(meta["provenance"]) if "provenance" in meta else None
        if record is not None:
            check_provenance(record, aux_layer_ids, "footer", encoding)
        info = ShardInfo(
            schema_version=version, step=int(meta["step"]),
            hidden_size=int(meta["hidden_size"]), aux_width=int(meta["aux_width"]),
            aux_layer_ids=aux_layer_ids, dtype=meta["dtype"],
            rows=int(meta["rows"]), tokens=int(meta["tokens"]),
            row_groups=pf.metadata.num_row_groups,
            extra={k: v for k, v in meta.items() if k not in known}, provenance=record,
            encoding=encoding)
    except (KeyError, ValueError) as e:
        raise ParquetFileError(f"{url}: not a readable hidden-state shard ({e})") from e
    if info.rows != pf.metadata.num_rows:
        raise ParquetFileError(f"{url}: footer says {info.rows} rows, file has "
                               f"{pf.metadata.num_rows}")
    return info


def read_shard_info(storage: Storage, key: str) -> ShardInfo:
    """The shard's metadata (schema version, shapes, aux ids, counts), footer only."""
    with open_parquet(storage, key) as pf:
        return _info(pf, storage.url(key))


def iter_shard_row_groups(storage: Storage, key: str) -> Iterator[list[ShardSample]]:
    """The shard one row group at a time; a group is freed once its samples are dropped."""
    _require_little_endian()
    url = storage.url(key)
    with open_parquet(storage, key) as pf:
        info = _info(pf, url)
        for i in range(pf.metadata.num_row_groups):
            group = _read_row_group(pf, i, info, url)
            yield group
            del group  # before reading the next one: one group resident, not two


def _read_row_group(pf: pq.ParquetFile, i: int, info: ShardInfo, url: str
                    ) -> list[ShardSample]:
    try:
        table = pf.read_row_group(i)
    except (pa.ArrowException, OSError) as e:
        raise ParquetFileError(f"{url}: row group {i} is corrupt ({e})") from e
    return [s for batch in table.to_batches() for s in samples_of_batch(batch, info, url)]


def iter_shard(storage: Storage, key: str) -> Iterator[ShardSample]:
    """The shard's samples in order, holding one row group in memory."""
    for group in iter_shard_row_groups(storage, key):
        yield from group
        del group


def samples_of_batch(batch: pa.RecordBatch, info: ShardInfo, url: str = "<batch>"
                     ) -> list[ShardSample]:
    """Tensors over ``batch``'s Arrow buffers, one :class:`ShardSample` per row, no copies."""
    ids_off, ids = list_views(batch.column("input_ids"), torch.int32)
    mask_off, mask = list_views(batch.column("loss_mask"), torch.int8)
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ParquetFileError(f"{url}: loss_mask values outside 0/1")
    mask = mask.view(torch.bool)
    aux_off, aux = binary_views(batch.column("aux_hidden"))
    fin_off, fin = binary_views(batch.column("final_hidden"))
    aux_fp8, final_fp8 = fp8_columns(info.encoding)
    sample_ids = batch.column("sample_id").to_pylist()
    steps = batch.column("step").to_pylist()
    out = []
    for r in range(batch.num_rows):
        t = int(ids_off[r + 1] - ids_off[r])
        if (int(mask_off[r + 1] - mask_off[r]) != t
                or int(aux_off[r + 1] - aux_off[r]) != value_bytes(t, info.aux_width, aux_fp8)
                or int(fin_off[r + 1] - fin_off[r]) != value_bytes(t, info.hidden_size,
                                                                    final_fp8)):
            raise ParquetFileError(f"{url}: row {r} ({sample_ids[r]!r}) has inconsistent "
                                   f"lengths for T={t}, H={info.hidden_size} "
                                   f"({info.encoding})")
        out.append(ShardSample(
            sample_id=sample_ids[r], step=steps[r],
            input_ids=ids[ids_off[r]:ids_off[r + 1]],
            loss_mask=mask[mask_off[r]:mask_off[r + 1]],
            aux_hidden=_states(aux[aux_off[r]:aux_off[r + 1]], t, info.aux_width, aux_fp8),
            final_hidden=_states(fin[fin_off[r]:fin_off[r + 1]], t, info.hidden_size,
                                 final_fp8)))
    return out


def _states(raw: torch.Tensor, tokens: int, width: int, fp8: bool) -> torch.Tensor:
    """bf16 ``(T, W)`` states of one value: a view of the bf16 bytes, or fp8 decoded."""
    if fp8:
        return fp8_decode(raw, tokens, width)
    return raw.view(torch.bfloat16).view(tokens, width)


def _require_little_endian() -> None:
    if sys.byteorder != "little":
        raise RuntimeError("hidden-state shards store little-endian bf16 bits; this host is "
                           "big-endian")


# -- datasets --------------------------------------------------------------------------
class ShardsDeletedError(DeletedByRetention):
    """The step's shards were deleted by storage retention; its manifest remains."""


def read_shards_manifest(storage: Storage, step: int, *, data: bool = True) -> Manifest:
    """The committed shard dataset of ``step``; raises when it is unfinished or foreign,
    and (``data``: the caller reads the shards) :class:`ShardsDeletedError` when retention
    deleted its files."""
    prefix = shards_prefix(step)
    manifest = read_manifest(storage, prefix)
    if manifest is None:
        raise FileNotFoundError(f"{storage.url(prefix)}: no committed hidden-state shards")
    if manifest.kind != SHARDS_KIND or manifest.kind_version not in READABLE_VERSIONS:
        raise ValueError(f"{storage.url(prefix)}: {manifest.kind} v{manifest.kind_version} is "
                         f"not {SHARDS_KIND} of version {READABLE_VERSIONS}")
    deleted = deleted_record(manifest)
    if data and deleted is not None:
        raise ShardsDeletedError(
            f"{deleted_note(storage.url(prefix), deleted)}; extract the step again (re-run "
            f"ingest_step for partition {step})")
    return manifest


def iter_step(storage: Storage, step: int) -> Iterator[ShardSample]:
    """Every sample of a committed step, shard by shard, one row group in memory."""
    prefix = shards_prefix(step)
    for entry in read_shards_manifest(storage, step).files:
        yield from iter_shard(storage, f"{prefix}/{entry.path}")
