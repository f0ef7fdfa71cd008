"""The rollout record's ``speculative`` field from what each engine reports per request.

- SGLang (0.5.21–0.5.23), ``meta_info`` of a finished request: ``spec_verify_ct`` (absent when
  the request stopped at its prefill token), ``completion_tokens``, and where the release
  reports them ``spec_num_correct_drafts`` / ``spec_num_proposed_drafts`` (0.5.14's aliases
  ``spec_accepted_drafts`` / ``spec_proposed_drafts``).
- slime, a sample's ``spec_info``: ``spec_verify_ct``, ``completion_token_num``,
  ``spec_accept_token_num``, ``spec_draft_token_num``, summed over every SGLang request of
  the sample (a multi-turn or partial rollout has several, each with its own prefill token),
  so τ is counted from the accepted tokens, which hold per verify pass; all zeros means
  the engine did not speculate.
- vLLM with ``--per-request-spec-decode-metrics``, ``metrics.speculative_decoding``:
  ``num_spec_steps`` (verify passes: its mean acceptance length is ``1 +
  num_accepted_draft_tokens / num_spec_steps``), ``num_accepted_draft_tokens``,
  ``num_draft_tokens``; it counts no completion tokens, so τ comes from the accepted ones.

Each returns None when the engine reported nothing speculative (no drafter), never a guess;
the values are checked by the record contract (:mod:`pipeline.snapshot.schema`), not here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

UNKNOWN_DRAFTER = "unknown"  # counters whose drafter the dump does not name


def from_sglang(meta_info: Mapping[str, Any], drafter_version: str) -> dict[str, Any] | None:
    """Counters of one SGLang request served with ``drafter_version``."""
    verify = meta_info.get("spec_verify_ct")
    completion = meta_info.get("completion_tokens")
    if verify is None:
        if completion is None or completion > 1:  # speculation off: nothing to report
            return None
        verify = 0  # stopped at the prefill token: SGLang omits the key
    return {"drafter_version": drafter_version, "verify_ct": verify,
            "completion_tokens": completion,
            "accepted_tokens": _first(meta_info, "spec_num_correct_drafts",
                                      "spec_accepted_drafts"),
            "draft_tokens": _first(meta_info, "spec_num_proposed_drafts",
                                   "spec_proposed_drafts")}


def from_slime(spec_info: Mapping[str, Any] | None, drafter_version: str
               ) -> dict[str, Any] | None:
    """Counters of one slime sample (``Sample.spec_info``); the completion tokens only where
    slime reports no accepted ones (they carry one prefill token per request)."""
    if not spec_info or spec_info.get("spec_verify_ct") is None:
        return None
    accepted = spec_info.get("spec_accept_token_num")
    if not spec_info["spec_verify_ct"] and not spec_info.get("completion_token_num"):
        return None  # slime's zeroed SpecInfo: no speculation
    return {"drafter_version": drafter_version, "verify_ct": spec_info["spec_verify_ct"],
            "completion_tokens": spec_info.get("completion_token_num")
            if accepted is None else None,
            "accepted_tokens": accepted, "draft_tokens": spec_info.get("spec_draft_token_num")}


def from_vllm(speculative_decoding: Mapping[str, Any] | None, drafter_version: str
              ) -> dict[str, Any] | None:
    """Counters of one vLLM request (``RequestOutput.metrics.speculative_decoding``)."""
    if not speculative_decoding or speculative_decoding.get("num_spec_steps") is None:
        return None
    return {"drafter_version": drafter_version,
            "verify_ct": speculative_decoding["num_spec_steps"],
            "accepted_tokens": speculative_decoding.get("num_accepted_draft_tokens"),
            "draft_tokens": speculative_decoding.get("num_draft_tokens")}


def _first(mapping: Mapping[str, Any], *names: str) -> Any:
    return next((mapping[n] for n in names if mapping.get(n) is not None), None)
