"""Hidden-state shards: exact bf16 bits, zero-copy reads, metadata, streaming, corruption."""

from __future__ import annotations

import gc
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.capture.provenance import provenance
from pipeline.capture.shards import (
    SHARD_SCHEMA_VERSION,
    SHARDS_KIND,
    ShardSample,
    ShardSpec,
    iter_shard,
    iter_shard_row_groups,
    read_shard_info,
    samples_of_batch,
    write_shard,
)
from pipeline.contracts import Manifest
from pipeline.manifest import entry_for, read_manifest, verify_manifest, write_manifest
from pipeline.parquet import ParquetFileError
from pipeline.storage import Storage
from tests.conftest import on_every_storage

H = 16
SPEC = ShardSpec(step=4, hidden_size=H, aux_layer_ids=(1, 2, 3), extra={"backend": "test"})
KEY = "shards/step=000004/shard-00000.parquet"


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16)


def sample(i: int, t: int, *, seed: int = 0) -> ShardSample:
    g = torch.Generator().manual_seed(seed * 1000 + i)
    return ShardSample(
        sample_id=f"r4-{i}", step=4,
        input_ids=torch.randint(0, 1000, (t,), generator=g, dtype=torch.int32),
        loss_mask=torch.rand(t, generator=g) < 0.5,
        aux_hidden=torch.randn(t, 3 * H, generator=g).to(torch.bfloat16),
        final_hidden=torch.randn(t, H, generator=g).to(torch.bfloat16))


def assert_same(a: ShardSample, b: ShardSample) -> None:
    assert (a.sample_id, a.step) == (b.sample_id, b.step)
    assert torch.equal(a.input_ids, b.input_ids) and b.input_ids.dtype == torch.int32
    assert torch.equal(a.loss_mask, b.loss_mask) and b.loss_mask.dtype == torch.bool
    assert b.aux_hidden.dtype == b.final_hidden.dtype == torch.bfloat16
    assert torch.equal(bits(a.aux_hidden), bits(b.aux_hidden))  # bits: NaN != NaN otherwise
    assert torch.equal(bits(a.final_hidden), bits(b.final_hidden))


@pytest.fixture
def local(tmp_path) -> Storage:
    return Storage(tmp_path.as_uri())


@on_every_storage
def test_round_trip_on_local_and_s3(storage):
    """``storage`` (tests/conftest.py) is a local directory and a bucket on moto_server."""
    rows = [sample(i, t) for i, t in enumerate((5, 1, 9))]
    written = write_shard(storage, KEY, SPEC, rows, row_group_bytes=1)
    assert (written.obj.bytes, written.obj.sha256) == storage.sha256(KEY)
    assert read_shard_info(storage, KEY).row_groups == 3
    for a, b in zip(rows, iter_shard(storage, KEY), strict=True):
        assert_same(a, b)


def test_every_bf16_bit_pattern_round_trips(local):
    """All 65,536 patterns: ±0, subnormals, ±inf, quiet/signalling NaNs with payloads."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    grid = every.view(torch.bfloat16).reshape(1024, 4 * H)  # each pattern exactly once
    aux, final = grid[:, :3 * H].contiguous(), grid[:, 3 * H:].contiguous()
    rows = [ShardSample("all", 4, torch.arange(1024, dtype=torch.int32),
                        torch.ones(1024, dtype=torch.bool), aux, final),
            ShardSample("flipped", 4, torch.zeros(1024, dtype=torch.int32),
                        torch.zeros(1024, dtype=torch.bool), aux.flip(0), final.flip(1))]
    assert torch.isnan(aux.float()).any() and torch.isinf(aux.float()).any()
    write_shard(local, KEY, SPEC, rows)
    got = list(iter_shard(local, KEY))
    assert len(got) == 2
    for a, b in zip(rows, got, strict=True):
        assert_same(a, b)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6),
       group_bytes=st.integers(1, 20_000), raw=st.binary(min_size=64, max_size=64))
def test_round_trip_property(local, lengths, group_bytes, raw):
    """Random lengths, random bits and any row-group budget read back identically."""
    pattern = torch.frombuffer(bytearray(raw), dtype=torch.int16)  # 32 arbitrary patterns
    rows = []
    for i, t in enumerate(lengths):
        s = sample(i, t)
        noise = pattern.repeat(t * 4 * H // 32 + 1)
        aux = noise[: t * 3 * H].view(torch.bfloat16).reshape(t, 3 * H)
        final = noise[t * 3 * H: t * 4 * H].view(torch.bfloat16).reshape(t, H)
        rows.append(ShardSample(s.sample_id, 4, s.input_ids, s.loss_mask, aux, final))
    written = write_shard(local, KEY, SPEC, rows, row_group_bytes=group_bytes)
    assert (written.rows, written.tokens) == (len(lengths), sum(lengths))
    for a, b in zip(rows, iter_shard(local, KEY), strict=True):
        assert_same(a, b)


def test_read_is_zero_copy_views_of_the_arrow_buffers(local):
    rows = [sample(i, t) for i, t in enumerate((3, 7, 5))]
    write_shard(local, KEY, SPEC, rows)
    table = pq.read_table(local.local_path(KEY))
    (batch,) = table.to_batches()
    info = read_shard_info(local, KEY)
    gc.collect()  # earlier tests' Arrow garbage freed now, not during the measurement
    gc.disable()
    try:
        before = pa.total_allocated_bytes()
        got = samples_of_batch(batch, info)
        assert pa.total_allocated_bytes() == before  # nothing new from Arrow's pool
    finally:
        gc.enable()

    def inside(t: torch.Tensor, column: str, buffer_index: int) -> bool:
        buf = batch.column(column).buffers()[buffer_index]
        start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        return buf.address <= start and end <= buf.address + buf.size

    for s in got:
        assert inside(s.aux_hidden, "aux_hidden", 2) and inside(s.final_hidden, "final_hidden", 2)
        assert inside(s.input_ids, "input_ids", 3) and inside(s.loss_mask, "loss_mask", 3)
    # consecutive rows are adjacent slices of one buffer (no per-row allocation)
    a, b = got[0].aux_hidden, got[1].aux_hidden
    assert b.data_ptr() == a.data_ptr() + a.numel() * 2
    for a, b in zip(rows, got, strict=True):
        assert_same(a, b)


def test_metadata_describes_the_shard(local):
    rows = [sample(i, t) for i, t in enumerate((3, 7))]
    written = write_shard(local, KEY, SPEC, rows)
    info = read_shard_info(local, KEY)
    assert (info.schema_version, info.step, info.hidden_size, info.aux_width) == (
        SHARD_SCHEMA_VERSION, 4, H, 3 * H)
    assert info.aux_layer_ids == (1, 2, 3) and info.dtype == "bfloat16"
    assert (info.rows, info.tokens, info.extra) == (2, 10, {"backend": "test"})
    raw = pq.read_metadata(local.local_path(KEY)).metadata
    assert raw[b"aerie.aux_layer_ids"] == b"[1, 2, 3]" and raw[b"aerie.hidden_size"] == b"16"
    assert b"little-endian bf16" in raw[b"aerie.layout"]
    assert written.obj.bytes == local.sha256(KEY)[0]
    assert written.obj.sha256 == local.sha256(KEY)[1]


def test_row_groups_respect_the_byte_budget(local):
    per_token = SPEC.state_bytes_per_token
    lengths = [4, 4, 4, 20, 4, 4]
    written = write_shard(local, KEY, SPEC, [sample(i, t) for i, t in enumerate(lengths)],
                          row_group_bytes=10 * per_token)
    groups = [[s.num_tokens for s in g] for g in iter_shard_row_groups(local, KEY)]
    assert groups == [[4, 4], [4], [20], [4, 4]]  # an oversized sample stands alone
    assert written.row_groups == 4 == read_shard_info(local, KEY).row_groups


def test_identical_rows_give_identical_bytes(tmp_path):
    digests = []
    for run in ("a", "b"):
        st_ = Storage((tmp_path / run).as_uri())
        written = write_shard(st_, KEY, SPEC, [sample(i, 5) for i in range(4)])
        digests.append((written.obj.bytes, written.obj.sha256))
    assert digests[0] == digests[1]


def _flip_byte(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def test_corruption_is_detected_by_page_checksums_and_the_manifest(local):
    rows = [sample(i, 64) for i in range(3)]
    written = write_shard(local, KEY, SPEC, rows, compression="none")
    prefix = "shards/step=000004"
    write_manifest(local, prefix, Manifest(kind=SHARDS_KIND, kind_version=1, files=(
        entry_for(prefix, written.obj, rows=written.rows),)))
    path = local.local_path(KEY)
    _flip_byte(path, path.stat().st_size // 2)  # inside a data page
    with pytest.raises(ParquetFileError, match="corrupt"):
        list(iter_shard(local, KEY))
    problems = verify_manifest(local, prefix, read_manifest(local, prefix))
    assert len(problems) == 1 and "sha256" in problems[0]


def test_truncated_shard_is_refused(local):
    write_shard(local, KEY, SPEC, [sample(0, 8)])
    path = local.local_path(KEY)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ParquetFileError, match="shard-00000.parquet"):
        read_shard_info(local, KEY)


@pytest.mark.parametrize("bad, message", [
    (lambda s: ShardSample(s.sample_id, 5, s.input_ids, s.loss_mask, s.aux_hidden,
                           s.final_hidden), "step 5"),
    (lambda s: ShardSample(s.sample_id, 4, s.input_ids, s.loss_mask, s.aux_hidden.float(),
                           s.final_hidden), "bfloat16"),
    (lambda s: ShardSample(s.sample_id, 4, s.input_ids, s.loss_mask, s.aux_hidden[:, :H],
                           s.final_hidden), r"\(6, 48\)"),
    (lambda s: ShardSample(s.sample_id, 4, s.input_ids.long(), s.loss_mask, s.aux_hidden,
                           s.final_hidden), "int32"),
    (lambda s: ShardSample(s.sample_id, 4, s.input_ids, torch.full((6,), 2, dtype=torch.int8),
                           s.aux_hidden, s.final_hidden), "0 or 1"),
])
def test_bad_rows_are_refused_and_nothing_is_published(local, bad, message):
    rows = [sample(0, 6), bad(sample(1, 6))]
    with pytest.raises(ValueError, match=message):
        write_shard(local, KEY, SPEC, rows, row_group_bytes=1)  # row 0 already flushed
    assert not local.exists(KEY)
    assert local.list("shards") == []  # no temp file left either


def test_an_error_from_the_row_source_publishes_nothing(local):
    def rows():
        yield sample(0, 4)
        raise RuntimeError("backend died")

    with pytest.raises(RuntimeError, match="backend died"):
        write_shard(local, KEY, SPEC, rows(), row_group_bytes=1)
    assert not local.exists(KEY)


# ---- provenance ---------------------------------------------------------------------------


def test_provenance_is_in_the_footer_and_read_back(local):
    record = provenance("sglang", "0.5.23", (1, 2, 3))
    spec = ShardSpec(step=4, hidden_size=H, aux_layer_ids=(1, 2, 3), provenance=record)
    write_shard(local, KEY, spec, [sample(0, 3)])
    info = read_shard_info(local, KEY)
    assert info.provenance == record and "provenance" not in info.extra
    assert record["engine_aux_layer_ids"] == [1, 2, 3]
    assert (record["aux_capture"], record["final_capture"], record["encoding"]) == (
        "layer_output", "post_norm", "bfloat16")
    write_shard(local, KEY, SPEC, [sample(0, 3)])  # written before provenance existed
    assert read_shard_info(local, KEY).provenance is None


def _rewrite_footer(storage: Storage, key: str, **changes) -> None:
    """The same rows under a footer whose provenance says something else (another writer)."""
    path = storage.local_path(key)
    table = pq.read_table(path)
    meta = dict(table.schema.metadata)
    record = json.loads(meta[b"aerie.provenance"])
    meta[b"aerie.provenance"] = json.dumps({**record, **changes}).encode()
    pq.write_table(table.replace_schema_metadata(meta), path)


@pytest.mark.parametrize(("field", "value"), [
    ("aux_capture", "layer_input"),         # vLLM's numbering: id k = input of layer k
    ("final_capture", "pre_norm"),          # vLLM's last layer, before the final norm
    ("encoding", "float8_e4m3fn"),
    ("aux_layer_ids", [2, 3, 4]),           # an engine's +1 applied twice
])
def test_a_shard_in_other_conventions_is_refused_by_name(local, field, value):
    spec = ShardSpec(step=4, hidden_size=H, aux_layer_ids=(1, 2, 3),
                     provenance=provenance("transformers", "5.3.0", (1, 2, 3)))
    write_shard(local, KEY, spec, [sample(0, 3)])
    _rewrite_footer(local, KEY, **{field: value})
    with pytest.raises(ParquetFileError, match=f"shard-00000.parquet.*provenance {field}"):
        read_shard_info(local, KEY)
    with pytest.raises(ParquetFileError, match=f"provenance {field}"):
        list(iter_shard(local, KEY))


def test_the_writer_refuses_a_provenance_in_other_conventions(local):
    record = {**provenance("sglang", "0.5.23", (1, 2, 3)), "final_capture": "pre_norm"}
    spec = ShardSpec(step=4, hidden_size=H, aux_layer_ids=(1, 2, 3), provenance=record)
    with pytest.raises(ValueError, match="provenance final_capture is 'pre_norm'"):
        write_shard(local, KEY, spec, [sample(0, 3)])
    assert not local.exists(KEY)


# ---- fp8 encoding ---------------------------------------------------------------------------

E4M3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()
E4M3 = torch.unique(E4M3[torch.isfinite(E4M3)])  # every finite float8 e4m3fn value, sorted


def reference_fp8(x: torch.Tensor) -> torch.Tensor:
    """Per-token scaled e4m3 by enumeration: each row's scale is its float32 amax/448; each
    float32 quotient may go to any e4m3 value nearest to it (both on a tie), decoded as
    value × scale in float32, then bf16. Returns which decoded values are allowed and
    those values, ``(T, W, 253)``."""
    rows = x.float()
    scale = (rows.abs().amax(dim=1) / 448).clamp_min(1e-12)
    distance = (rows / scale[:, None]).double()[..., None].sub(E4M3).abs()
    nearest = distance <= distance.min(dim=-1, keepdim=True).values
    decoded = (E4M3.float() * scale[:, None, None]).to(torch.bfloat16).double()
    return nearest, decoded


@pytest.mark.parametrize("encoding", ["fp8-aux", "fp8"])
def test_fp8_shards_decode_to_the_nearest_e4m3_value_per_token(local, encoding):
    spec = ShardSpec(step=4, hidden_size=H, aux_layer_ids=(1, 2, 3), encoding=encoding)
    rows = [sample(i, t, seed=3) for i, t in enumerate((5, 1, 9))]
    rows[1] = ShardSample(rows[1].sample_id, 4, rows[1].input_ids, rows[1].loss_mask,
                          torch.zeros_like(rows[1].aux_hidden), rows[1].final_hidden)
    write_shard(local, KEY, spec, rows, row_group_bytes=1)
    info = read_shard_info(local, KEY)
    assert (info.schema_version, info.encoding, info.dtype) == (2, encoding, "bfloat16")
    for original, back in zip(rows, iter_shard(local, KEY), strict=True):
        assert back.aux_hidden.dtype == back.final_hidden.dtype == torch.bfloat16
        assert torch.equal(back.input_ids, original.input_ids)
        for name, fp8 in (("aux_hidden", True), ("final_hidden", encoding == "fp8")):
            x, got = getattr(original, name), getattr(back, name)
            if not fp8:
                assert torch.equal(bits(got), bits(x))
                continue
            nearest, decoded = reference_fp8(x)
            allowed = nearest & (decoded == got.double()[..., None])
            assert bool(allowed.any(dim=-1).all()), name
    assert not bool(next(iter_shard(local, KEY)).aux_hidden.isnan().any())
    assert bool((list(iter_shard(local, KEY))[1].aux_hidden == 0).all())  # zeros stay zeros


def test_fp8_values_at_unaligned_offsets_decode(local):
    """Odd widths and lengths put a sample's float32 scales at any byte offset."""
    spec = ShardSpec(step=4, hidden_size=5, aux_layer_ids=(1, 2, 3), encoding="fp8")
    g = torch.Generator().manual_seed(7)
    rows = [ShardSample(f"r4-{i}", 4, torch.arange(t, dtype=torch.int32),
                        torch.ones(t, dtype=torch.bool),
                        torch.randn(t, 15, generator=g).to(torch.bfloat16),
                        torch.randn(t, 5, generator=g).to(torch.bfloat16))
            for i, t in enumerate((3, 1, 5, 2))]
    write_shard(local, KEY, spec, rows)
    for original, back in zip(rows, iter_shard(local, KEY), strict=True):
        nearest, decoded = reference_fp8(original.aux_hidden)
        assert bool((nearest & (decoded == back.aux_hidden.double()[..., None]))
                    .any(dim=-1).all())


def test_fp8_bytes_per_token_and_the_schema_version_of_each_encoding():
    h4096 = {e: ShardSpec(step=0, hidden_size=4096, aux_layer_ids=(1, 2, 3), encoding=e)
             for e in ("bfloat16", "fp8-aux", "fp8")}
    assert h4096["bfloat16"].state_bytes_per_token == 32768  # 32 KiB, as the issue measured
    assert h4096["fp8-aux"].state_bytes_per_token == 12288 + 4 + 8192
    assert h4096["fp8"].state_bytes_per_token == 12288 + 4 + 4096 + 4  # 0.50x


def test_fp8_refuses_non_finite_states_and_unknown_encodings(local):
    bad = sample(0, 4)
    bad.aux_hidden[1, 2] = float("inf")
    spec = ShardSpec(step=4, hidden_size=H, aux_layer_ids=(1, 2, 3), encoding="fp8-aux")
    with pytest.raises(ValueError, match="sample 'r4-0': aux_hidden has non-finite values"):
        write_shard(local, KEY, spec, [bad])
    with pytest.raises(ValueError, match="encoding must be one of"):
        write_shard(local, KEY, ShardSpec(step=4, hidden_size=H, aux_layer_ids=(1, 2, 3),
                                          encoding="int4"), [sample(0, 4)])
    assert not local.exists(KEY)
