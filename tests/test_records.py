"""pipeline.records: nested records round-trip; other versions, unknown and missing keys and
wrong shapes are refused naming the record and the field."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from pipeline.records import RecordError, from_dict, from_json, to_dict, to_json


@dataclass(frozen=True)
class Inner:
    ids: tuple[int, ...]
    note: str | None = None


@dataclass(frozen=True)
class Outer:
    inner: Inner
    by_name: dict[str, Inner]
    maybe: Inner | None
    pair: tuple[str, int]
    extra: dict[str, object] = field(default_factory=dict)
    schema_version: int = 3


VALUE = Outer(Inner((1, 2)), {"a": Inner((3,), "x")}, None, ("k", 4), {"n": [1, 2]})


def test_nested_records_round_trip_with_their_types():
    back = from_json(Outer, to_json(VALUE))
    assert back == VALUE
    assert isinstance(back.inner, Inner) and isinstance(back.inner.ids, tuple)
    assert isinstance(back.by_name["a"], Inner) and back.pair == ("k", 4)


@pytest.mark.parametrize(("change", "message"), [
    ({"schema_version": 4}, r"Outer schema_version 4 is not supported \(expected 3\)"),
    ({"surprise": 1}, r"Outer: unknown keys \['surprise'\]"),
    ({"inner": {"ids": 5}}, r"Inner.ids: expected a list"),
    ({"by_name": [1]}, r"Outer.by_name: expected an object"),
    ({"inner": {"note": "n"}}, r"Inner: .*missing .*'ids'"),
    ({"pair": ["k", 4, 5]}, r"Outer.pair: expected 2 items, got 3"),
])
def test_bad_values_are_refused_naming_the_field(change, message):
    with pytest.raises(RecordError, match=message):
        from_dict(Outer, {**to_dict(VALUE), **change})


def test_not_json_names_the_record():
    with pytest.raises(RecordError, match="Outer: not JSON"):
        from_json(Outer, "{")
