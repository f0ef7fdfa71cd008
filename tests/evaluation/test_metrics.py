"""AcceptanceStats: definitions of tau and alpha_k, merging, JSON round trip."""

from __future__ import annotations

import json
import math

import pytest

from pipeline.evaluation.metrics import AcceptanceStats
from pipeline.records import from_dict, to_dict


def example() -> AcceptanceStats:
    s = AcceptanceStats(3, prompts=2, prefill_tokens=2)
    s.add_cycle(2, 3, bonus=True)  # rejected at position 2
    s.add_cycle(3, 3, bonus=True)  # everything accepted
    s.add_cycle(0, 1, bonus=True)  # rejected at once
    s.add_cycle(1, 1, bonus=False)  # truncated after one emitted draft token
    s.draft_seconds, s.verify_seconds, s.prefill_seconds = 1.0, 3.0, 0.5
    return s


def test_definitions():
    s = example()
    assert s.cycles == 4 and s.emitted_tokens == 3 + 4 + 1 + 1 and s.bonus_tokens == 3
    assert s.tau == 9 / 4
    assert s.server_accept_length == (9 + 2) / 4
    assert s.accept_hist == [1, 1, 1, 1]
    assert s.position_attempts == [4, 2, 2] and s.position_accepts == [3, 2, 1]
    assert s.alpha == [0.75, 1.0, 0.5]
    assert s.accept_length_histogram == {0: 0.25, 1: 0.25, 2: 0.25, 3: 0.25}
    split = s.time_split()
    assert split["draft_fraction"] == 0.25 and split["tokens_per_second"] == 11 / 4.5


@pytest.mark.parametrize("accepted, attempted", [(2, 1), (0, 2), (3, 4), (-1, 0)])
def test_inconsistent_cycles_are_refused(accepted, attempted):
    with pytest.raises(ValueError, match="inconsistent"):
        AcceptanceStats(3).add_cycle(accepted, attempted, bonus=True)


def test_empty_is_undefined_not_zero():
    s = AcceptanceStats(2)
    assert math.isnan(s.tau) and all(math.isnan(a) for a in s.alpha)
    summary = s.summary()
    assert summary["tau"] is None and summary["alpha"] == [None, None]
    json.dumps(summary, allow_nan=False)


def test_merge_sums_counts_before_dividing():
    a, b = AcceptanceStats(3, prompts=1), AcceptanceStats(3, prompts=1)
    a.add_cycle(3, 3, bonus=True)  # one cycle of 4 tokens
    for _ in range(3):
        b.add_cycle(0, 1, bonus=True)  # three cycles of 1 token
    merged = a.merge(b)
    assert merged.tau == 7 / 4  # not the mean of 4.0 and 1.0
    assert merged.counts() == b.merge(a).counts()
    assert merged.prompts == 2 and merged.position_attempts == [4, 1, 1]
    with pytest.raises(ValueError, match="num_steps"):
        a.merge(AcceptanceStats(2))


def test_json_round_trip():
    s = example()
    back = from_dict(AcceptanceStats, json.loads(json.dumps(to_dict(s), allow_nan=False)))
    assert back == s
    json.dumps(s.summary(), allow_nan=False)


@pytest.mark.parametrize("change, message", [
    ({"schema_version": 99}, "schema_version 99 is not supported"),
    ({"extra": 1}, "unknown keys"),
    ({"emitted_tokens": 10}, "disagrees"),
    ({"accept_hist": [1, 1]}, "entries"),
])
def test_from_dict_validates(change, message):
    raw = {**to_dict(example()), **change}
    with pytest.raises(ValueError, match=message):
        from_dict(AcceptanceStats, raw)
