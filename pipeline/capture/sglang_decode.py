"""Decoding of SGLang ``/generate`` bodies that carry hidden states, without a Python float per
value.

SGLang answers ``/generate`` through orjson: every hidden-state value is a JSON number (the
shortest decimal that round-trips the float), so one 3 × 4096 aux row is ~12k numbers and
``json.loads`` spends most of its time building Python floats that are thrown away as soon as
they become a tensor. :func:`loads_generate` parses the body with simdjson instead and copies
each prefill block (``meta_info.hidden_states[0]``) straight into a float64 ``ndarray``; every
other value becomes the Python object ``json.loads`` would give.

Invariants:

- Same values as ``json.loads``: simdjson rounds every decimal to the nearest float64, as
  ``json.loads`` does, so the arrays equal ``numpy.array(json.loads(body)...)`` exactly.
- A block comes back as an ``ndarray`` only when it is a non-empty rectangle of numbers; any
  other block (a null where orjson wrote NaN, ragged rows, a flat row, strings, rows of
  lists) comes back as the plain list, for the caller's validation to name the bad row. One
  malformation goes unseen: arrays nested inside a row whose numbers add up to the row's
  length (``[1, [2]]`` reads as ``[1, 2]``), because simdjson's buffer flattens them and a
  check per value would cost more than the decoding. SGLang writes ``tolist()`` rows.
- A body simdjson refuses (not JSON, or NaN/Infinity literals, which ``json.loads`` accepts)
  is handed to ``json.loads``: it raises ``ValueError`` exactly when ``json.loads`` would.
- Each thread keeps one parser (reusing its buffers saves a third of the time on large
  bodies); no proxy into it outlives a call. A call that fails drops its thread's parser
  (a traceback may keep proxies into it alive), and bodies over :data:`KEEP_PARSER_BYTES`
  get a parser of their own, so no thread holds buffers sized for its largest body.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np
import simdjson

__all__ = ["KEEP_PARSER_BYTES", "loads_generate"]

KEEP_PARSER_BYTES = 64 << 20  # larger bodies are parsed by a parser that is not kept
_local = threading.local()


def loads_generate(content: bytes) -> Any:
    """``json.loads(content)``, except that each ``meta_info.hidden_states[0]`` block of numbers
    is a 2-D float64 ``ndarray`` (see the module invariants)."""
    keep = len(content) <= KEEP_PARSER_BYTES
    parser = getattr(_local, "parser", None) if keep else None
    if parser is None:
        parser = simdjson.Parser()
        if keep:
            _local.parser = parser
    try:
        try:
            doc = parser.parse(content)
        except ValueError:  # not JSON to simdjson (NaN literals, ...): json.loads decides
            return json.loads(content)
        if isinstance(doc, simdjson.Array):
            return [_output(item) for item in doc]
        return _output(doc)
    except BaseException:
        _local.parser = None  # proxies in the traceback may pin it: the next call starts anew
        raise


def _plain(value: Any) -> Any:
    if isinstance(value, simdjson.Array):
        return value.as_list()
    if isinstance(value, simdjson.Object):
        return value.as_dict()
    return value


def _output(value: Any) -> Any:
    if not isinstance(value, simdjson.Object):
        return _plain(value)
    out = {}
    for key in value.keys():
        item = value[key]
        out[key] = (_meta(item) if key == "meta_info" and isinstance(item, simdjson.Object)
                    else _plain(item))
    return out


def _meta(meta: Any) -> dict[str, Any]:
    out = {}
    for key in meta.keys():
        item = meta[key]
        if key == "hidden_states" and isinstance(item, simdjson.Array) and len(item):
            out[key] = [_block(item[0])] + [_plain(step) for step in item[1:]]
        else:
            out[key] = _plain(item)
    return out


def _block(block: Any) -> Any:
    """A rectangle of numbers as a ``[rows, width]`` float64 array, anything else as is."""
    if not isinstance(block, simdjson.Array) or not len(block):
        return _plain(block)
    widths = {len(row) if isinstance(row, simdjson.Array) else -1 for row in block}
    if len(widths) != 1 or -1 in widths:
        return block.as_list()
    try:
        flat = np.frombuffer(block.as_buffer(of_type="d"), dtype=np.float64)
    except TypeError:  # a null or a string among the numbers
        return block.as_list()
    width = widths.pop()
    if flat.size != len(block) * width:  # rows of lists: as_buffer flattens every level
        return block.as_list()
    return flat.reshape(len(block), width)
