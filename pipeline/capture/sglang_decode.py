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
- Parsers are reused (a parser's buffers, ~3× the largest body it parsed, cost half the
  time to allocate again: 0.23 vs 0.12 CPU s on a 72 MB body). At most
  :data:`KEEP_PARSERS` are kept, shared by all threads (parsing holds the GIL, so more
  would not run at once); a body over :data:`KEEP_PARSER_BYTES` gets a parser that is not
  kept. So kept buffers stay under ~2 × 3 × 256 MB whatever the thread count. No proxy into
  a parser outlives a call; a call that fails drops its parser (a traceback may keep
  proxies into it alive).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np
import simdjson

__all__ = ["KEEP_PARSERS", "KEEP_PARSER_BYTES", "loads_generate"]

KEEP_PARSERS = 2
KEEP_PARSER_BYTES = 256 << 20  # ~1,800 tokens at 3 × 4096; larger bodies get a parser not kept
_kept: list[simdjson.Parser] = []  # idle parsers, shared by every thread
_kept_lock = threading.Lock()


def loads_generate(content: bytes) -> Any:
    """``json.loads(content)``, except that each ``meta_info.hidden_states[0]`` block of numbers
    is a 2-D float64 ``ndarray`` (see the module invariants)."""
    keep = len(content) <= KEEP_PARSER_BYTES
    with _kept_lock:
        parser = _kept.pop() if keep and _kept else None
    parser = parser or simdjson.Parser()
    try:
        doc = parser.parse(content)
    except ValueError:  # not JSON to simdjson (NaN literals, ...): json.loads decides
        result = json.loads(content)
    else:
        # an exception here drops the parser: proxies in its traceback may pin it
        result = ([_output(item) for item in doc] if isinstance(doc, simdjson.Array)
                  else _output(doc))
        del doc
    if keep:
        with _kept_lock:
            if len(_kept) < KEEP_PARSERS:
                _kept.append(parser)
    return result


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
