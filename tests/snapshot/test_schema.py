"""Per-record validation: good records pass unchanged, each kind of bad record is named."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.snapshot.schema import (
    ROLLOUT_SCHEMA,
    Limits,
    RecordError,
    has_visible_content,
    validate_record,
)

from .conftest import VOCAB

text = st.text(min_size=1, max_size=40).filter(has_visible_content)
ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30)


@st.composite
def records(draw):
    step = draw(st.integers(0, 1000))
    n_turns = draw(st.integers(1, 3))
    messages = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(text)})
    for _ in range(n_turns):
        messages.append({"role": draw(st.sampled_from(["user", "tool"])), "content": draw(text)})
        messages.append({"role": "assistant", "content": draw(text)})
    response = draw(ids)
    return {
        "rollout_id": draw(text), "trainer_step": step,
        "generated_by_policy_version": draw(st.integers(0, step)),
        "policy_uri": "file:///p", "messages": messages, "prompt_token_ids": draw(ids),
        "response_token_ids": response,
        "response_loss_mask": draw(st.lists(st.integers(0, 1), min_size=len(response),
                                            max_size=len(response))),
        "reward": draw(st.floats(-10, 10, allow_nan=False)), "finish_reason": "stop",
        "token_fidelity": "exact",
    }


@given(records())
def test_valid_records_pass_unchanged(rec):
    out = validate_record(rec, vocab_size=VOCAB)
    assert set(out) == set(ROLLOUT_SCHEMA.names)
    assert {k: v for k, v in out.items() if v is not None} == rec


def _drop(name):
    return lambda r, d: {k: v for k, v in r.items() if k != name}


def _set(name, value):
    return lambda r, d: {**r, name: value}


def _last_assistant(content):
    return lambda r, d: {**r, "response_token_ids": None, "response_loss_mask": None,
                         "token_fidelity": "retokenized",
                         "messages": r["messages"][:-1] + [{"role": "assistant",
                                                            "content": content}]}


# (mutation, field the rejection must name)
MUTATIONS = {
    "missing id": (_drop("rollout_id"), "rollout_id"),
    "missing step": (_drop("trainer_step"), "trainer_step"),
    "missing fidelity": (_drop("token_fidelity"), "token_fidelity"),
    "missing text": (lambda r, d: {k: v for k, v in r.items() if k != "messages"}, "messages"),
    "step as str": (_set("trainer_step", "7"), "trainer_step"),
    "step as bool": (_set("trainer_step", True), "trainer_step"),
    "step as float": (_set("trainer_step", 7.0), "trainer_step"),
    "reward as str": (_set("reward", "0.5"), "reward"),
    "reward nan": (_set("reward", math.nan), "reward"),
    "ids not list": (_set("prompt_token_ids", "1 2 3"), "prompt_token_ids"),
    "id as float": (lambda r, d: {**r, "response_token_ids": [1.0]}, "response_token_ids"),
    "id too big": (lambda r, d: {**r, "response_token_ids": [d.draw(st.integers(VOCAB, 10**9))]},
                   "response_token_ids"),
    "id negative": (lambda r, d: {**r, "prompt_token_ids": [d.draw(st.integers(-10**9, -1))]},
                    "prompt_token_ids"),
    "empty response ids": (lambda r, d: {**r, "response_token_ids": [],
                                         "response_loss_mask": None}, "response_token_ids"),
    "empty assistant text": (_last_assistant("  "), "messages"),
    "no assistant turn": (lambda r, d: {**r, "response_token_ids": None,
                                        "response_loss_mask": None,
                                        "token_fidelity": "retokenized",
                                        "messages": r["messages"][:-1]}, "messages"),
    "invalid utf-8 bytes": (lambda r, d: {**r, "rollout_id": b"ok\xff\xfe"}, "rollout_id"),
    "lone surrogate": (lambda r, d: {**r, "messages": [{"role": "user", "content": "a\udcff"}]
                                     + r["messages"][1:]}, "messages[0].content"),
    "bad role": (lambda r, d: {**r, "messages": [{"role": "robot", "content": "x"}]
                               + r["messages"][1:]}, "messages[0].role"),
    "absurd response": (lambda r, d: {**r, "response_token_ids": [1] * 2001,
                                      "response_loss_mask": None}, "response_token_ids"),
    "absurd text": (lambda r, d: {**r, "messages": [{"role": "user", "content": "x" * 5001}]
                                  + r["messages"][1:]}, "messages[0].content"),
    "mask length": (lambda r, d: {**r, "response_loss_mask": [1] * 99}, "response_loss_mask"),
    "mask value": (lambda r, d: {**r, "response_loss_mask": [2] * len(r["response_token_ids"])},
                   "response_loss_mask"),
    "exact without ids": (_drop("prompt_token_ids"), "prompt_token_ids"),
    "future policy": (lambda r, d: {**r, "generated_by_policy_version": r["trainer_step"] + 1},
                      "generated_by_policy_version"),
    "unknown field": (_set("reponse_ids", [1]), "reponse_ids"),
    "bad fidelity": (_set("token_fidelity", "approx"), "token_fidelity"),
}
LIMITS = Limits(max_response_tokens=2000, max_text_chars=5000)


@pytest.mark.parametrize("name", sorted(MUTATIONS))
@settings(max_examples=25)
@given(rec=records(), data=st.data())
def test_each_bad_record_is_rejected_naming_the_field(name, rec, data):
    mutate, field = MUTATIONS[name]
    bad = mutate(rec, data)
    with pytest.raises(RecordError) as err:
        validate_record(bad, vocab_size=VOCAB, limits=LIMITS)
    assert err.value.field == field, (name, err.value)


def test_step_mismatch_and_non_mapping():
    rec = {"rollout_id": "a", "trainer_step": 2, "generated_by_policy_version": 1,
           "policy_uri": "p", "prompt": "q", "response_token_ids": [1],
           "token_fidelity": "retokenized"}
    assert validate_record(rec, vocab_size=VOCAB, step=2)["prompt"] == "q"
    with pytest.raises(RecordError, match="snapshot of step 3"):
        validate_record(rec, vocab_size=VOCAB, step=3)
    with pytest.raises(RecordError, match="mapping"):
        validate_record(["not", "a", "dict"], vocab_size=VOCAB)
