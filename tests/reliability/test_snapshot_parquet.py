"""Hostile Parquet parts: files another tool wrote into a raw snapshot, with loose types,
invalid UTF-8, integers beyond int64, values Python cannot hold, unknown columns. Each row
is accepted or quarantined; nothing crashes the stage and the counts add up."""

from __future__ import annotations

import json
from dataclasses import asdict
from decimal import Decimal

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.layout import raw_prefix
from pipeline.manifest import entry_for
from pipeline.parquet import write_table
from pipeline.snapshot import stage as snapshot_stage
from pipeline.snapshot.stage import read_accepted

from .snapshot_reference import STEP, TALLY, VOCAB, contract_violations

pytestmark = pytest.mark.integration

PARQUET = settings(max_examples=2, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow,
                                          HealthCheck.function_scoped_fixture])
TEMPLATE_ACCEPTED, TEMPLATE_QUARANTINED = 6, 2


def _ids(n: int) -> list[str]:
    return [f"foreign-{i}" for i in range(n)]


# column -> variant -> (array for n rows, whether rows stay valid)
VARIANTS = {
    "rollout_id": {
        "string": lambda n: (pa.array(_ids(n)), True),
        "large_string": lambda n: (pa.array(_ids(n), pa.large_string()), True),
        "dictionary": lambda n: (pa.array(_ids(n)).dictionary_encode(), True),
        "binary, valid UTF-8": lambda n: (pa.array([i.encode() for i in _ids(n)]), True),
        "binary, invalid UTF-8": lambda n: (pa.array([b"f\xff" + bytes([48 + i])
                                                      for i in range(n)]), False),
        "int64": lambda n: (pa.array(range(n), pa.int64()), False),
        "nulls": lambda n: (pa.nulls(n, pa.string()), False),
        "zero-width": lambda n: (pa.array(["\u200b" * (i + 1) for i in range(n)]), False),
    },
    "trainer_step": {
        "int64": lambda n: (pa.array([STEP] * n, pa.int64()), True),
        "int8": lambda n: (pa.array([STEP] * n, pa.int8()), True),
        "uint64 max": lambda n: (pa.array([2**64 - 1] * n, pa.uint64()), False),
        "float64": lambda n: (pa.array([float(STEP)] * n), False),
        "string": lambda n: (pa.array([str(STEP)] * n), False),
        "decimal": lambda n: (pa.array([Decimal(STEP)] * n, pa.decimal128(5, 0)), False),
        "timestamp beyond Python": lambda n: (pa.array([2**62] * n, pa.timestamp("ms")), False),
        "bool": lambda n: (pa.array([True] * n), False),
    },
    "generated_by_policy_version": {
        "int64": lambda n: (pa.array([STEP] * n, pa.int64()), True),
        "newer than the step": lambda n: (pa.array([STEP + 1] * n, pa.int64()), False),
        "int64 min": lambda n: (pa.array([-(2**63)] * n, pa.int64()), False),
    },
    "response_token_ids": {
        "list<int64>": lambda n: (pa.array([[1, 2]] * n, pa.list_(pa.int64())), True),
        "large_list<int32>": lambda n: (pa.array([[3]] * n, pa.large_list(pa.int32())), True),
        "fixed_size_list": lambda n: (pa.array([[1, 2]] * n, pa.list_(pa.int64(), 2)), True),
        "list<uint64> huge": lambda n: (pa.array([[2**64 - 1]] * n,
                                                 pa.list_(pa.uint64())), False),
        "list<int64> beyond the vocab": lambda n: (pa.array([[VOCAB]] * n), False),
        "list<float64>": lambda n: (pa.array([[1.0]] * n), False),
        "list<string>": lambda n: (pa.array([["1"]] * n), False),
        "empty lists": lambda n: (pa.array([[]] * n, pa.list_(pa.int64())), False),
        "int64": lambda n: (pa.array([1] * n), False),
    },
    "reward": {
        "float64": lambda n: (pa.array([0.5] * n), True),
        "float32": lambda n: (pa.array([0.25] * n, pa.float32()), True),
        "int64": lambda n: (pa.array([2**62] * n), True),
        "nan": lambda n: (pa.array([float("nan")] * n), False),
        "string": lambda n: (pa.array(["0.5"] * n), False),
        "decimal": lambda n: (pa.array([Decimal("0.5")] * n, pa.decimal128(3, 1)), False),
    },
    "messages": {
        "list<struct>": lambda n: (pa.array([[{"role": "user", "content": "q"},
                                               {"role": "assistant", "content": "a"}]] * n),
                                   True),
        "struct with an extra field": lambda n: (pa.array(
            [[{"role": "user", "content": "q", "tone": "polite"}]] * n), False),
        "struct with binary invalid UTF-8": lambda n: (pa.array(
            [[{"role": b"user", "content": b"\xff"}]] * n), False),
        "map": lambda n: (pa.array([[("role", "user")]] * n,
                                   pa.map_(pa.string(), pa.string())), False),
    },
    "token_fidelity": {
        "retokenized": lambda n: (pa.array(["retokenized"] * n), True),
        "other": lambda n: (pa.array(["approximate"] * n), False),
        "large_binary invalid UTF-8": lambda n: (pa.array([b"\xfe"] * n,
                                                          pa.large_binary()), False),
    },
    "extra column": {
        "none": lambda n: (None, True),
        "int64 column 'score'": lambda n: (pa.array([1] * n), False),
        "all-null column 'x'": lambda n: (pa.nulls(n), False),
    },
}


CASES = [(column, variant) for column, variants in VARIANTS.items() for variant in variants]


@st.composite
def foreign_part(draw, column: str, variant: str, others_valid: bool):
    """A table of 1-4 rows whose ``column`` is ``variant`` and the other columns drawn (from
    their valid variants only when ``others_valid``); with its plan and validity."""
    n = draw(st.integers(1, 4))
    plan, columns, valid = {}, {}, True
    for name, variants in VARIANTS.items():
        choices = sorted(v for v in variants if not others_valid or variants[v](1)[1])
        plan[name] = variant if name == column else draw(st.sampled_from(choices))
        array, ok = variants[plan[name]](n)
        valid = valid and ok
        if array is not None:
            columns["score" if name == "extra column" else name] = array
    columns["policy_uri"] = pa.array(["file:///policy"] * n)
    return pa.table(columns), valid, plan, n


@pytest.mark.parametrize("others_valid", [True, False], ids=["others-valid", "others-random"])
@pytest.mark.parametrize("column, variant", CASES, ids=[f"{c}={v}" for c, v in CASES])
@PARQUET
@given(data=st.data())
def test_foreign_parts_are_read_row_by_row(fresh_copy, column, variant, others_valid, data):
    table, valid, plan, n = data.draw(foreign_part(column, variant, others_valid))
    TALLY.cases += 1
    TALLY.classes[f"parquet: {column}"] += 1
    storage = fresh_copy()
    prefix = raw_prefix(STEP)
    written = write_table(storage, f"{prefix}/part-00009.parquet", table)
    manifest = json.loads(storage.read_bytes(f"{prefix}/_manifest.json"))
    manifest["files"].append(asdict(entry_for(prefix, written, rows=n)))
    manifest["meta"]["records_in"] += n
    storage.write_bytes(f"{prefix}/_manifest.json", json.dumps(manifest).encode())
    try:
        summary = snapshot_stage.run(storage, STEP)
        accepted = read_accepted(storage, STEP).to_pylist()
    except Exception as e:
        raise AssertionError(TALLY.fail(f"crash on {plan}: {type(e).__name__}: {e!s:.500}",
                                        "crashes")) from e
    TALLY.accepted += len(accepted)
    TALLY.quarantined += summary.quarantined
    foreign = n if valid else 0
    broken = [(r["rollout_id"], contract_violations(r)) for r in accepted
              if contract_violations(r)]
    if broken or summary.accepted > TEMPLATE_ACCEPTED + foreign:
        raise AssertionError(TALLY.fail(f"silently accepted {broken} from {plan}",
                                        "silently_accepted"))
    if summary.accepted < TEMPLATE_ACCEPTED + foreign:
        raise AssertionError(TALLY.fail(f"wrongly quarantined from {plan}: {summary}",
                                        "wrongly_quarantined"))
    assert summary.quarantined == TEMPLATE_QUARANTINED + n - foreign
    assert summary.records_in == summary.accepted + summary.quarantined
