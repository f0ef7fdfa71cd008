"""Hostile records: whatever a record is made of, it is accepted or quarantined, never a crash.

Each test covers a class of input (keys that are not text, integers beyond int64, cycles,
deep nesting, mappings that raise, numpy values, invisible text, huge quotes) rather than
one example of it.
"""

from __future__ import annotations

import json
import math
import numbers

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.snapshot.render import QUOTE_CHARS, quote, record_to_json
from pipeline.snapshot.schema import (
    DEFAULT_LIMITS,
    INT64_MAX,
    RecordError,
    has_visible_content,
    validate_record,
)
from pipeline.snapshot.sieve import Sieve
from tests.reliability.snapshot_hostile import RaisingMapping

from .conftest import VOCAB, good_record

STEP = 3
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None)


def check(raw):
    """Through the sieve as the writer uses it: the record, or its rejection."""
    sieve = Sieve("writer", VOCAB, STEP, DEFAULT_LIMITS)
    rec = sieve.check(raw, "test", 0, {"policy_uri": "file:///p"})
    assert (rec is None) == bool(sieve.rejections)
    return rec, (sieve.rejections[0] if sieve.rejections else None)


# ---- keys ---------------------------------------------------------------------------------

hashables = st.one_of(
    st.integers(), st.floats(), st.none(), st.booleans(), st.binary(max_size=8),
    st.tuples(st.integers(), st.text(max_size=3)), st.frozensets(st.integers(), max_size=3),
    st.text(max_size=12))


@SETTINGS
@given(extra=st.dictionaries(hashables, st.integers(), min_size=1, max_size=6)
       .filter(lambda d: any(k not in good_record(0) for k in d)))
def test_foreign_keys_of_any_type_are_quarantined_naming_one(extra):
    raw = {**good_record(0), **extra}
    rec, rejection = check(raw)
    assert rec is None
    assert rejection["reason"] in ("unknown field",) or "not text" in rejection["reason"]
    assert len(rejection["field"]) <= QUOTE_CHARS + 20
    rejection["field"].encode("utf-8")  # valid UTF-8, whatever the key was
    json.loads(rejection["record_json"])


@pytest.mark.parametrize("key", ["bad\udcffkey", "\ud800", "rollout_id\udc80"])
def test_lone_surrogate_keys_are_quoted_as_valid_utf8(key):
    rec, rejection = check({**good_record(0), key: 1})
    assert rec is None and rejection["reason"] == "unknown field"
    assert "\\udc" in rejection["field"] or "\\ud8" in rejection["field"]
    assert key in json.loads(rejection["record_json"])  # kept losslessly


def test_message_keys_of_mixed_types_are_quarantined():
    raw = good_record(0)
    raw["messages"] = [{"role": "user", "content": "q", 1: "a", "z": 2, None: 3},
                       *raw["messages"][1:]]
    rec, rejection = check(raw)
    assert rec is None and rejection["field"] == "messages[0]"


# ---- integers and numbers out of range ----------------------------------------------------

@pytest.mark.parametrize("field", ["trainer_step", "generated_by_policy_version"])
@pytest.mark.parametrize("value", [10**400, -(10**400), 2**63, 10**5000, np.uint64(2**64 - 1)],
                         ids=["1e400", "-1e400", "2**63", "1e5000", "uint64-max"])
def test_integers_beyond_int64_are_quarantined(field, value):
    rec, rejection = check({**good_record(0), field: value})
    assert rec is None and rejection["field"] == field
    assert len(rejection["reason"]) < 100


@pytest.mark.parametrize("value", [10**400, -(10**400), 10**5000, math.inf, np.float64("nan")],
                         ids=["1e400", "-1e400", "1e5000", "inf", "np-nan"])
def test_rewards_beyond_float64_are_quarantined(value):
    rec, rejection = check({**good_record(0), "reward": value})
    assert rec is None and rejection["field"] == "reward"


@pytest.mark.parametrize("value", [10**400, -1, 2**31, np.int64(-1), np.uint64(2**64 - 1)],
                         ids=["1e400", "-1", "2**31", "np-neg", "uint64-max"])
def test_token_ids_beyond_the_vocab_are_quarantined(value):
    rec, rejection = check({**good_record(0), "response_token_ids": [1, value]})
    assert rec is None and rejection["field"] == "response_token_ids"


def test_the_largest_int64_step_is_accepted():
    raw = {**good_record(0, INT64_MAX), "policy_uri": "file:///p"}
    assert validate_record(raw, vocab_size=VOCAB, step=INT64_MAX)["trainer_step"] == INT64_MAX


# ---- cycles, depth, hostile objects -------------------------------------------------------

def test_a_cyclic_record_is_quarantined_and_rendered():
    raw = good_record(0)
    raw["self"] = raw
    rec, rejection = check(raw)
    assert rec is None and rejection["field"] == "self"
    assert json.loads(rejection["record_json"])["self"] == {"$cycle": "dict"}


def test_deep_nesting_is_quarantined_and_rendered():
    deep: list = []
    inner = deep
    for _ in range(50_000):
        inner.append([])
        inner = inner[0]
    for raw in ({**good_record(0), "extra": deep},
                {**good_record(0), "messages": deep},
                {**good_record(0), "response_token_ids": deep}):
        rec, rejection = check(raw)
        assert rec is None
        assert json.loads(rejection["record_json"])  # depth-capped, parseable


@pytest.mark.parametrize("where", ["getitem", "iter"])
@pytest.mark.parametrize("error", [RuntimeError, KeyError, TypeError, RecursionError,
                                   UnicodeDecodeError.__mro__[1]])
def test_a_mapping_that_raises_while_read_is_quarantined_with_the_error_type(where, error):
    rec, rejection = check(RaisingMapping(good_record(0), where, error))
    assert rec is None and rejection["field"] == "<record>"
    assert error.__name__ in rejection["reason"]
    json.loads(rejection["record_json"])


class RaisingFloat(float):
    """A number whose conversion raises."""

    def __float__(self):
        raise RuntimeError("no float")


class RaisingList(list):
    def __iter__(self):
        raise RuntimeError("no items")


@pytest.mark.parametrize("field, value", [
    ("reward", RaisingFloat(1.0)), ("prompt_token_ids", RaisingList([1])),
    ("response_token_ids", RaisingList([4, 5])),
    ("messages", RaisingList([{"role": "user", "content": "hi"}]))])
def test_a_value_that_raises_is_quarantined_under_its_own_field(field, value):
    rec, rejection = check({**good_record(0), field: value})
    assert rec is None and rejection["field"] == field
    assert "RuntimeError" in rejection["reason"]


@pytest.mark.parametrize("where", ["get", "len"])
def test_a_mapping_read_through_its_protocol_needs_no_get_or_len(where):
    rec, rejection = check(RaisingMapping(good_record(0), where))
    assert rejection is None and rec["rollout_id"] == "r3-0"


def test_interrupts_are_not_swallowed():
    with pytest.raises(KeyboardInterrupt):
        check(RaisingMapping(good_record(0), "getitem", KeyboardInterrupt))


class BadIndex:
    """An integer whose value cannot be read."""

    def __index__(self):
        raise ArithmeticError("no value")


numbers.Integral.register(BadIndex)


class BadRepr:
    def __repr__(self):
        raise RuntimeError("no repr")


def test_values_that_raise_are_quarantined_with_the_error_type():
    rec, rejection = check({**good_record(0), "response_token_ids": [1, BadIndex()]})
    assert rec is None and "ArithmeticError" in rejection["reason"]
    assert rejection["field"] == "response_token_ids"  # its field, not <record>
    rec, rejection = check({**good_record(0), "reward": BadRepr()})
    assert rec is None and rejection["field"] == "reward"
    assert "BadRepr" in json.loads(rejection["record_json"])["reward"]["$repr"]


# ---- record_to_json is total --------------------------------------------------------------

class Opaque:
    def __repr__(self):
        return "Opaque()" * 1000


leaves = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(10**500), max_value=10**500),
    st.floats(), st.text(alphabet=st.characters(codec=None)), st.binary(max_size=16),
    st.builds(Opaque), st.builds(BadRepr), st.just(np.arange(3)), st.just(np.float32(1.5)))
values = st.recursive(leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.tuples(inner, inner),
    st.dictionaries(hashables, inner, max_size=4)), max_leaves=20)


@SETTINGS
@given(value=values)
def test_record_to_json_is_total_ascii_json(value):
    text = record_to_json(value)
    assert text.isascii()
    json.loads(text)
    assert len(text) < 10_000_000


def test_record_to_json_keeps_non_text_keys_apart():
    assert json.loads(record_to_json({1: "a", "1": "b"})) == {"$items": [[1, "a"], ["1", "b"]]}


# ---- numpy --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint16, np.uint64])
def test_numpy_ids_and_rewards_are_accepted_as_plain_values(dtype):
    raw = {**good_record(0), "trainer_step": np.int64(STEP),
           "generated_by_policy_version": np.uint8(STEP),
           "prompt_token_ids": np.array([1, 2, 3], dtype=dtype),
           "response_token_ids": [dtype(4), dtype(5)],
           "response_loss_mask": np.array([0, 1], dtype=np.int8),
           "reward": np.float32(0.25), "rollout_id": np.str_("np-0")}
    rec, rejection = check(raw)
    assert rejection is None
    assert rec["prompt_token_ids"] == [1, 2, 3] and rec["response_token_ids"] == [4, 5]
    assert rec["response_loss_mask"] == [0, 1] and rec["reward"] == 0.25
    values = [rec["trainer_step"], rec["generated_by_policy_version"], rec["reward"],
              *rec["prompt_token_ids"], *rec["response_token_ids"], *rec["response_loss_mask"]]
    assert {type(v) for v in values} <= {int, float}
    assert type(rec["rollout_id"]) is str


@pytest.mark.parametrize("mutation", [
    {"trainer_step": np.bool_(True)},
    {"reward": np.bool_(False)},
    {"response_loss_mask": np.array([True, False])},
    {"response_loss_mask": [np.bool_(True), 1]},
    {"prompt_token_ids": np.array([[1, 2], [3, 4]])},
    {"prompt_token_ids": np.array(3)},
    {"prompt_token_ids": np.array([1.0, 2.0])},
    {"response_loss_mask": [1.0, 0.0]},
], ids=repr)
def test_numpy_values_that_break_the_contract_are_quarantined(mutation):
    rec, rejection = check({**good_record(0), **mutation})
    assert rec is None and rejection["field"] == next(iter(mutation))


# ---- invisible text -----------------------------------------------------------------------

INVISIBLE = ["\u200b", "\u200c\u200d", "\u2060\ufeff", "\0\0", "\x7f\x1b\t", "\u3000 \u00a0",
             "\u2028\u2029", "\u3164", "\u115f\u1160", "\uffa0", "\u2800\u2800", "\u00ad",
             "\ufe0f", "\U000e0001\U000e0020"]


@pytest.mark.parametrize("blank", INVISIBLE, ids=ascii)
def test_responses_showing_nothing_are_quarantined_as_empty(blank):
    raw = {**good_record(0), "response_token_ids": None, "token_fidelity": "retokenized",
           "messages": [{"role": "user", "content": "q"},
                        {"role": "assistant", "content": blank}]}
    rec, rejection = check(raw)
    assert rec is None and rejection["field"] == "messages"
    assert "empty" in rejection["reason"]
    for field in ("rollout_id", "policy_uri"):
        rec, rejection = check({**good_record(0), field: blank})
        assert rec is None and rejection["field"] == field and "empty" in rejection["reason"]


# Default_Ignorable_Code_Point as Unicode 16's DerivedCoreProperties.txt lists it
DEFAULT_IGNORABLE = [(0x00AD, 0x00AD), (0x034F, 0x034F), (0x061C, 0x061C), (0x115F, 0x1160),
                     (0x17B4, 0x17B5), (0x180B, 0x180F), (0x200B, 0x200F), (0x202A, 0x202E),
                     (0x2060, 0x206F), (0x3164, 0x3164), (0xFE00, 0xFE0F), (0xFEFF, 0xFEFF),
                     (0xFFA0, 0xFFA0), (0xFFF0, 0xFFF8), (0x1BCA0, 0x1BCA3),
                     (0x1D173, 0x1D17A), (0xE0000, 0xE0FFF)]
ignorable = st.sampled_from(DEFAULT_IGNORABLE).flatmap(
    lambda r: st.integers(*r)).map(chr)
# unassigned in every Unicode version so far (noncharacters and unallocated planes)
unassigned = st.sampled_from([0xFDD0, 0xFDEF, 0xFFFE, 0x1FFFE, 0x2FFFF, 0x3FFFE, 0x5ABCD,
                              0x8FFFF, 0xDFFFF]).map(chr)
blank = st.sampled_from(["\t", "\n", " ", "\u00a0", "\u2028", "\u3000", "\x00", "\u2800"])


@SETTINGS
@given(st.text(alphabet=st.one_of(ignorable, unassigned, blank), min_size=1, max_size=20),
       st.sampled_from(["a", "7", "é", "漢", "?", "😀", "\U0001FAE9", "\uE000"]))
def test_visibility_is_decided_by_unicode_properties(text, shown):
    """Default-ignorable, unassigned, control, format and separator characters show
    nothing; a letter, digit, mark of punctuation, symbol (an emoji newer than this
    interpreter's Unicode data included) or private-use character does."""
    assert not has_visible_content(text)
    assert has_visible_content(text + shown) and has_visible_content(shown + text)


# ---- bounded quotes -----------------------------------------------------------------------

@pytest.mark.parametrize("raw", [
    {**good_record(0), "x" * 1_500_000: 1},
    {**good_record(0), "token_fidelity": "y" * 1_500_000},
    {**good_record(0), "messages": [{"role": "r" * 1_500_000, "content": "c"}]},
    {**good_record(0), "rollout_id": "i" * 1_500_000},
], ids=["key", "fidelity", "role", "id"])
def test_quarantine_quotes_are_bounded_and_the_record_kept(raw):
    rec, rejection = check(raw)
    assert rec is None
    for column in ("field", "reason", "rollout_id"):
        assert len(rejection[column] or "") <= QUOTE_CHARS + 20, column
    assert len(rejection["record_json"]) > 1_500_000


def test_record_error_quotes_its_field_and_reason():
    e = RecordError("k" * 10_000, "\udcff" + "r" * 10_000)
    assert len(e.field) <= QUOTE_CHARS + 20 and "(10000 chars)" in e.field
    assert e.reason.startswith("\\udcff") and len(str(e)) < 2 * QUOTE_CHARS + 60
    assert quote("short") == "short"
