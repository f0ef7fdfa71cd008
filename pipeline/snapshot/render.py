"""Total, bounded renderings of untrusted values: what the quarantine quotes.

Records come from RL trainers and from Parquet written by other tools, so anything in them
may be hostile: keys that are not text, lone surrogates, integers of a million digits,
cycles, nesting thousands deep, objects whose ``repr`` or iteration raises. Both functions
here are total (they never raise on such input) and bounded:

- :func:`quote` is what a message, a field name or a quarantine column may echo: valid
  UTF-8, at most :data:`QUOTE_CHARS` characters plus a note of the original length.
- :func:`record_to_json` keeps the whole record for ``quarantine.parquet`` as ASCII JSON,
  lossless for JSON-like values (bytes as base64, non-text keys as ``$items`` pairs) and
  cut short only where it has to be: past :data:`MAX_DEPTH` levels, on a cycle, past
  :data:`MAX_ITEMS` entries of a list or :data:`MAX_KEYS` of a mapping, and for reprs and
  huge integers.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping
from typing import Any

QUOTE_CHARS = 200
MAX_DEPTH = 64
MAX_ITEMS = 1_000_000  # of a list (token ids run to 131,072)
MAX_KEYS = 1_000  # of a mapping (a record has 12 fields)
_REPR_CHARS = 1_000
_INT64 = range(-(2**63), 2**63)


def quote(text: Any, limit: int = QUOTE_CHARS) -> str:
    """``text`` (or the repr of a non-text value) as valid UTF-8 of at most ``limit`` chars;
    longer text ends in ``…`` and its original length."""
    text = str.__str__(text) if isinstance(text, str) else safe_repr(text, limit + 1)
    head = text[: limit + 1].encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) <= limit and len(head) <= limit:
        return head
    return f"{head[:limit]}… ({len(text)} chars)"


def safe_repr(value: Any, limit: int = _REPR_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` chars, or a note when even that raises."""
    if type(value) is int and value not in _INT64:
        return int_text(value)
    try:
        text = str.__str__(repr(value))
    except Exception as e:  # a hostile __repr__ must not take the caller down
        return f"<{type_name(value)} whose repr raised {type_name(e)}>"
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} chars)"


def int_text(value: int) -> str:
    """An integer in decimal, or its size when the decimal would be absurd (Python refuses to
    print more than 4300 digits)."""
    if -(10**18) < value < 10**18:
        return str(value)
    return f"{'-' if value < 0 else ''}<integer of {abs(value).bit_length()} bits>"


def type_name(value: Any) -> str:
    return quote(type(value).__name__, 60)


def record_to_json(raw: Any) -> str:
    """A JSON rendering of any record for the quarantine (ASCII, sorted keys); never raises."""
    return json.dumps(_jsonable(raw, 0, set()), sort_keys=True, ensure_ascii=True)


def _jsonable(value: Any, depth: int, path: set[int]) -> Any:
    """``value`` as JSON-able data; ``path`` holds the ids of the containers above it."""
    try:
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, str):
            return str.__str__(value)  # ensure_ascii escapes lone surrogates
        if type(value) is int:
            if value in _INT64:
                return value
            return {"$int": hex(value)[:_REPR_CHARS], "$bits": abs(value).bit_length()}
        if type(value) is float:
            return value if math.isfinite(value) else {"$float": repr(value)}
        if isinstance(value, bytes | bytearray | memoryview):
            return {"$base64": base64.b64encode(bytes(value)).decode()}
        if depth >= MAX_DEPTH:
            return {"$deeper_than": MAX_DEPTH}
        if id(value) in path:
            return {"$cycle": type_name(value)}
        path.add(id(value))
        try:
            if isinstance(value, Mapping):
                return _mapping(value, depth, path)
            if isinstance(value, list | tuple):
                return _sequence(value, depth, path)
            return _opaque(value, depth, path)
        finally:
            path.discard(id(value))
    except Exception as e:  # whatever the value does while being read, the record is kept
        return {"$unreadable": type_name(value), "$error": type_name(e)}


def _bounded(items: Any, limit: int) -> tuple[list[Any], bool]:
    """The first ``limit`` of ``items``, and whether there were more."""
    out = []
    for item in items:
        if len(out) == limit:
            return out, True
        out.append(item)
    return out, False


def _sequence(value: list | tuple, depth: int, path: set[int]) -> list[Any]:
    items, cut = _bounded(value, MAX_ITEMS)
    out = [_jsonable(v, depth + 1, path) for v in items]
    return [*out, {"$more_than": MAX_ITEMS}] if cut else out


def _mapping(value: Mapping, depth: int, path: set[int]) -> dict[str, Any]:
    pairs, cut = _bounded(value.items(), MAX_KEYS)
    more = {"$more_than": MAX_KEYS} if cut else {}
    if all(type(k) is str for k, _ in pairs):
        return {k: _jsonable(v, depth + 1, path) for k, v in pairs} | more
    # keys that are not text would collide once written as text: keep them as pairs
    return {"$items": [[_jsonable(k, depth + 1, path), _jsonable(v, depth + 1, path)]
                       for k, v in pairs]} | more


def _opaque(value: Any, depth: int, path: set[int]) -> Any:
    """A value of another type: its items when it is an array-like, else its repr."""
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        listed = tolist()
        if isinstance(listed, list | int | float | bool):
            return {"$type": type_name(value), "$value": _jsonable(listed, depth + 1, path)}
    return {"$type": type_name(value), "$repr": safe_repr(value)}
