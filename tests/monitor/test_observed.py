"""Observed τ is robust to counters validation cannot see: a rollout claiming more tokens
per verify pass than its drafter's served draft depth allows is left out and counted, so no
single rollout moves a version's τ past what its drafter could produce."""

from __future__ import annotations

import random

from pipeline.eagle3.spec import SpecParams
from pipeline.monitor.observed import pass_limits, summarise
from pipeline.records import to_json
from pipeline.serving_now import ServingManifest, ServingTarget, entry_key
from pipeline.storage import Storage

NAME = "aerie-drafter-demo"


def _honest(rng: random.Random, version: str = "3", depth: int = 3) -> dict:
    """Counters of a rollout built from the definition: each pass emits 1..depth+1 tokens."""
    passes = rng.randint(1, 20)
    emitted = sum(rng.randint(1, depth + 1) for _ in range(passes))
    return {"drafter_version": version, "verify_ct": passes, "completion_tokens": emitted + 1,
            "accepted_tokens": None, "draft_tokens": None}


def test_no_single_rollout_moves_tau_past_what_its_drafter_can_emit():
    rng = random.Random(0)
    for case in range(60):
        honest = [_honest(rng) for _ in range(rng.randint(1, 9))]
        passes = rng.randint(1, 5)
        claim = {"drafter_version": "3", "verify_ct": passes,
                 "completion_tokens": rng.choice([passes * 4 + 2, 10 ** rng.randint(2, 17)]),
                 "accepted_tokens": None, "draft_tokens": None}
        rollouts = [*honest, claim, None]
        rng.shuffle(rollouts)
        clean = summarise(5, [*honest, None], {"3": 4}).of("3")
        got = summarise(5, rollouts, {"3": 4})
        v = got.of("3")
        assert got.with_counters == len(honest) + 1 and v.impossible == 1, case
        assert (v.tau, v.rollouts, v.verify_ct) == (clean.tau, clean.rollouts,
                                                    clean.verify_ct), case
        assert v.tau <= 4


def test_a_rollout_at_the_limit_counts_and_an_unbounded_version_is_summed():
    at_limit = {"drafter_version": "3", "verify_ct": 2, "completion_tokens": 9,
                "accepted_tokens": None, "draft_tokens": None}  # 8 tokens from 2 passes
    assert summarise(1, [at_limit], {"3": 4}).of("3").tau == 4.0
    unknown = {**at_limit, "drafter_version": "unknown", "completion_tokens": 101}
    assert summarise(1, [unknown], {"3": 4}).of("unknown").tau == 50.0  # no bound known


def test_pass_limits_follow_the_served_settings(tmp_path):
    storage = Storage(str(tmp_path))
    served = [("1", SpecParams(3, 1, 4)), ("2", SpecParams(5, 1, 6)), ("1", SpecParams(7, 1, 8)),
              (None, SpecParams(3, 1, 4))]
    for sequence, (version, settings) in enumerate(served, start=1):
        target = None if version is None else ServingTarget(
            f"drafters/v{version}", "f" * 64, NAME, version)
        manifest = ServingManifest(NAME, sequence, "manifest", target, settings, (),
                                   "2026-11-28T00:00:00Z")
        storage.write_bytes(entry_key(NAME, sequence), to_json(manifest).encode())
    assert pass_limits(storage, NAME) == {"1": 8, "2": 6}  # the deepest it was served with
    assert pass_limits(storage, "other") == {}
