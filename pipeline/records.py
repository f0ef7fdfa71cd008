"""Versioned JSON records: frozen dataclasses to JSON and back, in one place.

A record class is a dataclass whose fields are JSON values, other records, ``tuple``/``list``
/``dict`` of those, or ``X | None``. :func:`to_json` writes it with sorted keys;
:func:`from_json` rebuilds it from the class's type hints (nested records, tuples) and, when
the class has a ``schema_version`` field, refuses any other version than the class's
default, so a reader never misreads a record written by a newer, incompatible writer.

Unknown or missing keys are errors that name the record class and the key.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class RecordError(ValueError):
    """A JSON value does not fit the record class it is read as."""


def to_dict(record: Any) -> dict[str, Any]:
    return dataclasses.asdict(record)


def to_json(record: Any) -> str:
    return json.dumps(to_dict(record), indent=2, sort_keys=True)


def from_json(cls: type[T], text: str | bytes) -> T:
    try:
        raw = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RecordError(f"{cls.__name__}: not JSON ({e})") from e
    except RecursionError:
        raise RecordError(f"{cls.__name__}: JSON nested too deeply") from None
    return from_dict(cls, raw)


def from_dict(cls: type[T], raw: Any) -> T:
    """``cls`` rebuilt from ``raw`` (the output of :func:`to_dict`, or parsed JSON)."""
    if not isinstance(raw, Mapping):
        raise RecordError(f"{cls.__name__}: expected an object, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    if "schema_version" in fields:
        expected = fields["schema_version"].default
        readable = getattr(cls, "READABLE_SCHEMA_VERSIONS", (expected,))
        if raw.get("schema_version") not in readable:
            wanted = expected if len(readable) == 1 else f"one of {list(readable)}"
            raise RecordError(f"{cls.__name__} schema_version {raw.get('schema_version')!r} "
                              f"is not supported (expected {wanted})")
    unknown = set(raw) - set(fields)
    if unknown:
        raise RecordError(f"{cls.__name__}: unknown keys {sorted(unknown)}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name in fields:
        if name in raw:
            kwargs[name] = _value(hints[name], raw[name], f"{cls.__name__}.{name}")
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required key is missing
        raise RecordError(f"{cls.__name__}: {e}") from e


def _value(hint: Any, value: Any, where: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _value(inner[0], value, where) if len(inner) == 1 else value
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value)
    if origin in (tuple, list):
        if not isinstance(value, list | tuple):
            raise RecordError(f"{where}: expected a list, got {type(value).__name__}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise RecordError(f"{where}: expected {len(args)} items, got {len(value)}")
            items = [_value(a, v, where) for a, v in zip(args, value, strict=True)]
        else:
            items = [_value(args[0], v, where) for v in value] if args else list(value)
        return tuple(items) if origin is tuple else items
    if origin is dict and args:
        if not isinstance(value, Mapping):
            raise RecordError(f"{where}: expected an object, got {type(value).__name__}")
        return {k: _value(args[1], v, where) for k, v in value.items()}
    if hint in _SCALARS and not _is_scalar(hint, value):
        raise RecordError(f"{where}: expected {hint.__name__}, got {type(value).__name__} "
                          f"{_short(value)}")
    return value


_SCALARS = (int, float, str, bool)


def _is_scalar(hint: type, value: Any) -> bool:
    if hint is float:  # JSON writes 1.0 as 1.0 but other writers may write 1
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"
