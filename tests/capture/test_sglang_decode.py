"""``loads_generate`` against ``json.loads``: the same values for SGLang's real body shape
(orjson floats from bf16 and fp32 tensors), blocks as arrays only when they are rectangles
of numbers, and every malformed body refused (or left to validation) as ``json.loads``
leaves it."""

from __future__ import annotations

import json
import math

import numpy as np
import orjson
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.capture.engine_http import TransientFailure
from pipeline.capture.sglang import parse_generate_response
from pipeline.capture.sglang_decode import loads_generate


def sglang_body(blocks, *, single=False, **meta):
    """A /generate answer as SGLang writes it: ``tensor.tolist()`` through orjson."""
    outs = [{"text": "hi", "output_ids": [3, 4],
             "meta_info": {"id": f"r{i}", "cached_tokens": 0, "finish_reason": {"type": "length"},
                           "hidden_states": hs, **meta}}
            for i, hs in enumerate(blocks)]
    return orjson.dumps(outs[0] if single else outs)


def same(fast, reference):
    """``fast`` equals ``reference`` with each ndarray read as the nested lists it replaced."""
    if isinstance(fast, np.ndarray):
        assert fast.dtype == np.float64
        assert isinstance(reference, list) and fast.tolist() == reference
        # == on floats would let 0.0 and -0.0 pass: compare the bits too
        assert fast.tobytes() == np.array(reference, dtype=np.float64).tobytes()
        return
    assert type(fast) is type(reference)
    if isinstance(fast, dict):
        assert fast.keys() == reference.keys()
        for key in fast:
            same(fast[key], reference[key])
    elif isinstance(fast, list):
        assert len(fast) == len(reference)
        for a, b in zip(fast, reference, strict=True):
            same(a, b)
    elif isinstance(fast, float) and math.isnan(fast):
        assert math.isnan(reference)
    else:
        assert fast == reference


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 6), width=st.integers(1, 9), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e4]))
def test_prefill_blocks_equal_json_loads_for_sglang_floats(rows, width, seed, dtype, scale):
    g = torch.Generator().manual_seed(seed)
    states = (torch.randn(rows, width, generator=g) * scale).to(dtype)
    states[0, 0] = -0.0
    decode_rows = [torch.randn(width, generator=g).to(dtype).tolist()]
    body = sglang_body([[states.tolist(), *decode_rows], [states[:1].tolist()]])
    fast, reference = loads_generate(body), json.loads(body)
    same(fast, reference)
    assert isinstance(fast[0]["meta_info"]["hidden_states"][0], np.ndarray)
    assert isinstance(fast[0]["meta_info"]["hidden_states"][1], list)  # decode steps as is
    np.testing.assert_array_equal(fast[0]["meta_info"]["hidden_states"][0],
                                  states.to(torch.float64).numpy())


def test_a_single_object_body_and_extreme_values():
    tiny, huge = 5e-324, 1.7976931348623157e308
    block = [[tiny, -huge, 0.1, 1e-7], [1, 2, 3, 4]]  # ints where a server wrote 1, not 1.0
    body = sglang_body([[block]], single=True, prompt_tokens=2)
    fast = loads_generate(body)
    same(fast, json.loads(body))
    assert fast["meta_info"]["prompt_tokens"] == 2


@pytest.mark.parametrize("block", [
    [[0.0, 1.0], [0.0]],              # ragged
    [[0.0, None], [1.0, 2.0]],        # orjson's NaN
    [0.5, 1.5],                       # a flat row (return_hidden_states="last")
    [[0.5, "x"]],                     # a string
    [[[0.5, 1.5]], [[2.5, 3.5]]],     # one level too deep
    [],                               # no rows
    [[], []],                         # rows without values
])
def test_blocks_that_are_not_rectangles_of_numbers_stay_lists(block):
    body = sglang_body([[block]])
    fast = loads_generate(body)
    same(fast, json.loads(body))
    if block and block[0] == []:
        assert fast[0]["meta_info"]["hidden_states"][0].shape == (2, 0)
    else:
        assert isinstance(fast[0]["meta_info"]["hidden_states"][0], list)


@pytest.mark.parametrize("body", [
    b'[{"meta_info": {"hidden_states": [[[NaN, 1.0]]]}}]',       # json.dumps's NaN
    b'[{"meta_info": {"hidden_states": [[[Infinity, 1.0]]]}}]',
    b'[{"meta_info": {"hidden_states": [[[1e999, 1.0]]]}}]',     # overflows to inf
])
def test_what_simdjson_refuses_but_json_accepts_is_decoded_by_json(body):
    same(loads_generate(body), json.loads(body))


@pytest.mark.parametrize("body", [b"", b"{oops", b'{"meta_info": [truncated', b"[1, 2"])
def test_malformed_bodies_raise_value_error(body):
    with pytest.raises(ValueError):
        json.loads(body)
    with pytest.raises(ValueError):
        loads_generate(body)


def test_other_shapes_decode_as_json_loads():
    for body in (b"[]", b"null", b'{"error": {"message": "x"}}', b'[{"meta_info": 3}]',
                 b'[{"meta_info": {"hidden_states": []}}]', b"[1, [2.5], {}]"):
        same(loads_generate(body), json.loads(body))


@pytest.mark.parametrize(("rows", "reason"), [
    ([[0.0, 1.0], [0.0]], "ragged rows"),
    ([[0.0, None], [1.0, 2.0]], "null value in row 0"),
    ([[0.0, 1.0], [float("nan"), 2.0]], "(null|non-finite) value in row 1"),
    ([[0.0, 1.0]], "1 rows for 2 input tokens"),
])
@pytest.mark.parametrize("dumps", [orjson.dumps, lambda x: json.dumps(x).encode()],
                         ids=["orjson", "json"])
def test_validation_names_the_row_after_fast_decoding(rows, reason, dumps):
    body = loads_generate(dumps([{"meta_info": {"hidden_states": [rows], "cached_tokens": 0}}]))
    with pytest.raises(TransientFailure, match=reason):
        parse_generate_response(body, url="u", samples=[0], lengths=[2], width=2,
                                role="final", hidden_size=2)


def test_a_failed_call_leaves_no_parser_behind_and_big_bodies_get_their_own(monkeypatch):
    import pipeline.capture.sglang_decode as decode

    body = sglang_body([[[[0.5, 1.5]]]])
    loads_generate(body)
    kept = list(decode._kept)
    assert 1 <= len(kept) <= decode.KEEP_PARSERS
    loads_generate(body)
    assert decode._kept == kept  # reused, not added to
    monkeypatch.setattr(decode, "_output", lambda doc: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        loads_generate(body)
    assert len(decode._kept) == len(kept) - 1  # the failed call's parser is dropped
    monkeypatch.undo()
    same(loads_generate(body), json.loads(body))  # a fresh parser, not "re-use" errors
    monkeypatch.setattr(decode, "KEEP_PARSER_BYTES", len(body) - 1)
    before = list(decode._kept)
    same(loads_generate(body), json.loads(body))
    assert decode._kept == before  # the big body's parser was not kept


def test_the_parser_is_reused_across_calls_and_threads():
    from concurrent.futures import ThreadPoolExecutor

    bodies = [sglang_body([[[[float(i), 0.5]] * (i + 1)]]) for i in range(16)]
    for _ in range(2):
        with ThreadPoolExecutor(4) as pool:
            for body, fast in zip(bodies, pool.map(loads_generate, bodies), strict=True):
                same(fast, json.loads(body))
    import pipeline.capture.sglang_decode as decode

    assert 1 <= len(decode._kept) <= decode.KEEP_PARSERS  # shared, bounded
