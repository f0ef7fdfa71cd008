"""Hypothesis strategies for hostile rollout records: each draws a valid record and a
mutation from :data:`MUTATIONS`, which knows whether the result must be refused or may be
accepted.

Classes covered: keys that are not text, unknown keys of mixed types, lone surrogates,
invalid UTF-8 bytes, integers beyond int64 and floats beyond float64, cycles, nesting
thousands deep, mappings and values that raise while read, wrong types, missing fields,
invisible responses and ids, huge values, numpy values (accepted when they keep the
contract), speculative counters (accepted when built from their definitions, refused when
they break one), and records that are not mappings at all.
"""

from __future__ import annotations

import numbers
import unicodedata
from collections.abc import Callable, Mapping
from fractions import Fraction
from types import MappingProxyType
from typing import Any

import numpy as np
from hypothesis import assume
from hypothesis import strategies as st

from .snapshot_reference import BLANKS, STEP, VOCAB, counters_keep_their_meaning

REFUSE, ACCEPT = "refuse", "accept"

# text that shows something by any reading: a letter, number, punctuation or symbol
words = st.text(min_size=1, max_size=16).filter(
    lambda s: any(unicodedata.category(c)[0] in "LNPS" and c not in BLANKS for c in s))
ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)


@st.composite
def valid_record(draw, rid: str) -> dict[str, Any]:
    """A record that keeps the contract, with ``rid`` as its id."""
    rec: dict[str, Any] = {"rollout_id": rid, "trainer_step": STEP,
                           "generated_by_policy_version": draw(st.integers(0, STEP)),
                           "messages": [{"role": "user", "content": draw(words)},
                                        {"role": "assistant", "content": draw(words)}]}
    if draw(st.booleans()):
        response = draw(ids)
        rec |= {"token_fidelity": "exact", "prompt_token_ids": draw(ids),
                "response_token_ids": response,
                "response_loss_mask": draw(st.lists(st.integers(0, 1), min_size=len(response),
                                                    max_size=len(response)))}
    else:
        rec["token_fidelity"] = "retokenized"
    if draw(st.booleans()):
        rec["reward"] = draw(st.floats(-1e6, 1e6, allow_nan=False))
    if draw(st.booleans()):
        rec["finish_reason"] = draw(st.sampled_from(["stop", "length"]))
    return rec


class RaisingMapping(Mapping):
    """A record whose mapping protocol raises ``error`` at ``where``."""

    def __init__(self, data: dict, where: str, error: type[BaseException] = RuntimeError):
        self.data, self.where, self.error = data, where, error

    def _maybe(self, where: str) -> None:
        if self.where == where:
            raise self.error("hostile mapping")

    def __getitem__(self, key):
        self._maybe("getitem")
        return self.data[key]

    def __iter__(self):
        self._maybe("iter")
        return iter(self.data)

    def __len__(self):
        self._maybe("len")
        return len(self.data)

    def get(self, key, default=None):
        self._maybe("get")
        return self.data.get(key, default)


class EndlessMapping(Mapping):
    """Iteration never ends: a record with infinitely many keys."""

    def __getitem__(self, key):
        return 1

    def __iter__(self):
        n = 0
        while True:
            yield f"k{n}"
            n += 1

    def __len__(self):
        return 3


class Unreadable:
    """A number whose value raises when read; its repr raises too."""

    def __index__(self):
        raise ArithmeticError("no value")

    def __float__(self):
        raise ArithmeticError("no value")

    def __repr__(self):
        raise RuntimeError("no repr")


numbers.Integral.register(Unreadable)


def _deep(depth: int) -> list:
    root: list = []
    inner = root
    for _ in range(depth):
        inner.append([])
        inner = inner[0]
    return root


def _with(**changes) -> Callable:
    return lambda rec, draw: rec | changes


def _drop(name: str) -> Callable:
    return lambda rec, draw: {k: v for k, v in rec.items() if k != name}


def _invisible(draw) -> str:
    chars = st.sampled_from(["\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\0", "\x1b",
                             "\u3000", "\u2028", "\u3164", "\u115f", "\u1160", "\uffa0",
                             "\u2800", "\u00ad", " ", "\t", "\n"])
    return "".join(draw(st.lists(chars, min_size=1, max_size=8)))


def _text_only(rec: dict, content: str) -> dict:
    rest = {k: v for k, v in rec.items()
            if k not in ("prompt_token_ids", "response_token_ids", "response_loss_mask")}
    return rest | {"token_fidelity": "retokenized",
                   "messages": [{"role": "user", "content": "q"},
                                {"role": "assistant", "content": content}]}


def _int_field(rec, draw):
    name = draw(st.sampled_from(["trainer_step", "generated_by_policy_version"]))
    value = draw(st.sampled_from([10**400, -(10**400), 2**63, -(2**63) - 1, 10**5000,
                                  np.uint64(2**64 - 1), -1]))
    return rec | {name: value}


def _token_id(rec, draw):
    value = draw(st.sampled_from([10**400, -1, VOCAB, 2**31, 2**63, np.int64(-3),
                                  np.uint64(2**64 - 1), 1.0, "1", None, True]))
    return rec | {"response_token_ids": [1, value], "response_loss_mask": None}


def _foreign_keys(rec, draw):
    keys = st.one_of(st.integers(), st.none(), st.floats(), st.binary(max_size=4),
                     st.tuples(st.integers()), st.frozensets(st.integers(), max_size=2),
                     st.text(max_size=8).filter(lambda k: k not in rec))
    extra = draw(st.dictionaries(keys, st.integers(), min_size=1, max_size=5))
    return rec | extra


def _surrogate(rec, draw):
    where = draw(st.sampled_from(["key", "rollout_id", "content", "role", "policy_uri"]))
    lone = draw(st.sampled_from(["\ud800", "\udcff", "a\udfffb"]))
    if where == "key":
        return rec | {lone: 1}
    if where in ("content", "role"):
        message = {"role": "user", "content": "q"} | {where: lone}
        return rec | {"messages": [message, *rec["messages"][1:]]}
    return rec | {where: lone}


def _bad_utf8(rec, draw):
    raw = draw(st.sampled_from([b"\xff", b"ok\xc3", b"\xed\xa0\x80", b"\xc0\xaf", b"\x80"]))
    where = draw(st.sampled_from(["rollout_id", "policy_uri", "finish_reason", "content"]))
    if where == "content":
        return rec | {"messages": [{"role": "user", "content": raw}, *rec["messages"][1:]]}
    return rec | {where: raw}


def _cycle(rec, draw):
    rec = dict(rec)
    how = draw(st.sampled_from(["self", "messages", "message"]))
    if how == "self":
        rec["self"] = rec
    elif how == "messages":
        rec["messages"] = [*rec["messages"]]
        rec["messages"].append(rec["messages"])
    else:
        message = {"role": "user"}
        message["content"] = message
        rec["messages"] = [message, *rec["messages"][1:]]
    return rec


def _deep_nesting(rec, draw):
    where = draw(st.sampled_from(["extra", "messages", "response_token_ids", "reward"]))
    return rec | {where: _deep(draw(st.sampled_from([100, 5_000, 50_000])))}


def _raising_mapping(rec, draw):
    where = draw(st.sampled_from(["getitem", "iter"]))
    error = draw(st.sampled_from([RuntimeError, KeyError, TypeError, ValueError,
                                  RecursionError, MemoryError, UnicodeError, OSError]))
    return RaisingMapping(rec, where, error)


def _raising_message(rec, draw):
    message = RaisingMapping({"role": "user", "content": "q"}, "getitem", LookupError)
    return rec | {"messages": [message, *rec["messages"][1:]]}


def _raising_value(rec, draw):
    where = draw(st.sampled_from(["trainer_step", "reward", "response_token_ids"]))
    value = [Unreadable()] if where == "response_token_ids" else Unreadable()
    return rec | {where: value, "response_loss_mask": None}


_WRONG = {  # values of the wrong type for each kind of field
    "text": [3, 3.0, [], {}, object(), True, ["a"], np.int64(1)],
    "int": ["3", 3.0, [], {}, object(), 3 + 0j, True, np.float64(3), Fraction(3), None],
    "reward": ["0.5", [], {}, object(), 3 + 0j, True, np.bool_(True), b"1"],
    "ids": ["1 2", 3, {}, {1: 2}, {1, 2}, object(), b"\x01", np.float64(1)],
    "messages": ["hi", {}, 3, [3], [[]], {("role", "user")}, [None]],
}
_KIND = {"rollout_id": "text", "token_fidelity": "text", "finish_reason": "text",
         "policy_uri": "text", "trainer_step": "int", "generated_by_policy_version": "int",
         "reward": "reward", "prompt_token_ids": "ids", "response_token_ids": "ids",
         "response_loss_mask": "ids", "messages": "messages"}


def _wrong_type(rec, draw):
    name = draw(st.sampled_from(sorted(_KIND)))
    return rec | {name: draw(st.sampled_from(_WRONG[_KIND[name]]))}


def _huge(rec, draw):
    size = draw(st.sampled_from([50_000, 300_000]))
    where = draw(st.sampled_from(["key", "unknown", "rollout_id", "role", "fidelity"]))
    big = draw(st.sampled_from("xé☃\U0001f600")) * size
    if where == "key":
        return rec | {big: 1}
    if where == "unknown":
        return rec | {"junk": big}
    if where == "role":
        return rec | {"messages": [{"role": big, "content": "q"}, *rec["messages"][1:]]}
    return rec | {"rollout_id" if where == "rollout_id" else "token_fidelity": big}


def _invisible_response(rec, draw):
    return _text_only(rec, _invisible(draw))


def _invisible_id(rec, draw):
    return rec | {draw(st.sampled_from(["rollout_id", "policy_uri"])): _invisible(draw)}


def _numpy_bad(rec, draw):
    return rec | draw(st.sampled_from([
        {"trainer_step": np.bool_(True)}, {"reward": np.bool_(False)},
        {"trainer_step": np.float64(STEP)}, {"reward": np.float64("nan")},
        {"response_token_ids": np.array([[1, 2], [3, 4]]), "response_loss_mask": None},
        {"response_token_ids": np.array([1.0, 2.0]), "response_loss_mask": None},
        {"response_token_ids": np.array(5), "response_loss_mask": None},
        {"prompt_token_ids": np.array([VOCAB], dtype=np.int64)},
        {"response_token_ids": np.array([1, 2]),
         "response_loss_mask": np.array([True, False])}]))


def _not_a_mapping(rec, draw):
    return draw(st.sampled_from([None, [("rollout_id", "x")], "record", 7, b"{}",
                                 list(rec.items()), {1, 2}]))


def _contradiction(rec, draw):
    return draw(st.sampled_from([
        rec | {"trainer_step": STEP + 1}, rec | {"generated_by_policy_version": STEP + 1},
        rec | {"response_loss_mask": [1] * 99, "response_token_ids": [1, 2]},
        rec | {"response_loss_mask": [2, 2], "response_token_ids": [1, 2]},
        rec | {"token_fidelity": "exact", "prompt_token_ids": None},
        rec | {"token_fidelity": "approximately"},
        rec | {"response_token_ids": [], "response_loss_mask": None},
        _text_only(rec, "fine") | {"messages": [{"role": "user", "content": "q"}]},
        rec | {"messages": [{"role": "robot", "content": "x"}, *rec["messages"][1:]]},
        rec | {"messages": [{"role": "user", "content": "q", "extra": 1}]},
        rec | {"messages": [{"role": "user"}] * 2000},
        {k: v for k, v in rec.items() if k != "messages"}]))


def _numpy_good(rec, draw):
    dtype = draw(st.sampled_from([np.int8, np.int16, np.int32, np.int64, np.uint8,
                                  np.uint32, np.uint64]))
    out = rec | {"trainer_step": np.int64(STEP),
                 "generated_by_policy_version": dtype(rec["generated_by_policy_version"]),
                 "rollout_id": np.str_(rec["rollout_id"])}
    if "reward" in rec:
        out["reward"] = draw(st.sampled_from([np.float32, np.float64, np.float16]))(0.5)
    if "response_token_ids" in rec:
        out["response_token_ids"] = np.array(rec["response_token_ids"], dtype=dtype)
        out["prompt_token_ids"] = [dtype(t) for t in rec["prompt_token_ids"]]
        out["response_loss_mask"] = np.array(rec["response_loss_mask"], dtype=np.int8)
    return out


def _other_containers(rec, draw):
    how = draw(st.sampled_from(["tuples", "proxy", "get-raises", "len-raises", "bytes",
                                "fraction-reward", "int-reward"]))
    if how == "tuples":
        return rec | {"messages": tuple(rec["messages"]),
                      **{k: tuple(rec[k]) for k in ("prompt_token_ids", "response_token_ids")
                         if k in rec}}
    if how == "proxy":
        return MappingProxyType(rec)
    if how in ("get-raises", "len-raises"):
        return RaisingMapping(rec, how.split("-")[0], RuntimeError)
    if how == "bytes":
        return rec | {"rollout_id": rec["rollout_id"].encode(), "token_fidelity":
                      rec["token_fidelity"].encode()}
    return rec | {"reward": Fraction(1, 4) if how == "fraction-reward" else 10**18}


def _counters_keeping_their_meaning(rec, draw):
    """Counters built from their definitions: every token after the prefill one emitted by a
    verify pass, each pass one token plus the drafts it accepted, within the response."""
    response = rec.get("response_token_ids")
    budget = len(response) - 1 if response is not None else 40  # what passes may emit
    verify = draw(st.integers(0, budget))
    if verify == 0:
        return rec | {"speculative": {"drafter_version": draw(st.sampled_from(["3", "none"])),
                                      "verify_ct": 0,
                                      "completion_tokens": draw(st.integers(0, 1))}}
    emitted = draw(st.integers(verify, budget))
    spec = {"drafter_version": draw(st.sampled_from(["3", "unknown"])), "verify_ct": verify}
    reported = draw(st.sampled_from(["completion", "accepted", "both"]))
    if reported != "accepted":
        spec["completion_tokens"] = emitted + 1
    if reported != "completion":
        spec["accepted_tokens"] = emitted - verify
        if draw(st.booleans()):
            spec["draft_tokens"] = emitted - verify + draw(st.integers(0, 20))
    return rec | {"speculative": spec}


def _counters_contradicting_their_meaning(rec, draw):
    """Any counts, up to 10^18, that break a definition (the reference says which)."""
    count = st.one_of(st.none(), st.integers(0, 10**18), st.integers(0, 50))
    spec = {"drafter_version": draw(st.sampled_from(["3", "none", "unknown"])),
            "verify_ct": draw(st.one_of(st.integers(0, 10**18), st.integers(0, 50)))}
    spec |= {n: draw(count) for n in ("completion_tokens", "accepted_tokens", "draft_tokens")}
    assume(not counters_keep_their_meaning(spec, rec.get("response_token_ids")))
    return rec | {"speculative": spec}


# name -> (mutation, verdict)
MUTATIONS: dict[str, tuple[Callable[[dict, Any], Any], str]] = {
    "foreign keys": (_foreign_keys, REFUSE),
    "lone surrogates": (_surrogate, REFUSE),
    "invalid UTF-8 bytes": (_bad_utf8, REFUSE),
    "int beyond int64": (_int_field, REFUSE),
    "reward beyond float64": (lambda rec, draw: rec | {"reward": draw(st.sampled_from(
        [10**400, -(10**400), 10**5000, float("inf"), float("nan")]))}, REFUSE),
    "token id out of range": (_token_id, REFUSE),
    "cycle": (_cycle, REFUSE),
    "deep nesting": (_deep_nesting, REFUSE),
    "raising mapping": (_raising_mapping, REFUSE),
    "raising message": (_raising_message, REFUSE),
    "endless mapping": (lambda rec, draw: EndlessMapping(), REFUSE),
    "raising value": (_raising_value, REFUSE),
    "wrong type": (_wrong_type, REFUSE),
    "missing field": (lambda rec, draw: _drop(draw(st.sampled_from(
        ["rollout_id", "trainer_step", "generated_by_policy_version", "token_fidelity"])))(
        rec, draw), REFUSE),
    "huge value": (_huge, REFUSE),
    "invisible response": (_invisible_response, REFUSE),
    "invisible id": (_invisible_id, REFUSE),
    "numpy breaking the contract": (_numpy_bad, REFUSE),
    "not a mapping": (_not_a_mapping, REFUSE),
    "contradiction": (_contradiction, REFUSE),
    "counters contradicting their meaning": (_counters_contradicting_their_meaning, REFUSE),
    "numpy keeping the contract": (_numpy_good, ACCEPT),
    "counters keeping their meaning": (_counters_keeping_their_meaning, ACCEPT),
    "other containers": (_other_containers, ACCEPT),
    "unchanged": (lambda rec, draw: rec, ACCEPT),
}


@st.composite
def hostile_batch(draw, first: str) -> tuple[list[Any], list[tuple[str, str, str]]]:
    """A record mutated by ``first``, then 0-3 more, each with its plan entry: (rollout id,
    mutation name, verdict). A later valid record may repeat the first one's id: refused
    when a record of that id was accepted before, accepted otherwise."""
    records, plan = [], []
    names = [first, *draw(st.lists(st.sampled_from(sorted(MUTATIONS)), max_size=3))]
    for i, name in enumerate(names):
        if i and draw(st.integers(0, 3)) == 3:
            rid = plan[0][0]
            taken = any(r == rid and v == ACCEPT for r, _, v in plan)
            records.append(draw(valid_record(rid)))
            plan.append((rid, "duplicate id", REFUSE if taken else ACCEPT))
            continue
        rid = f"r{i}-{draw(st.integers(0, 99))}"
        mutate, verdict = MUTATIONS[name]
        records.append(mutate(draw(valid_record(rid)), draw))
        plan.append((rid, name, verdict))
    return records, plan
