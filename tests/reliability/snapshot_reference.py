"""The yardstick of the snapshot reliability corpus: an independent contract check and the
tally every case reports to.

:func:`contract_violations` restates the rollout record contract (DESIGN §3) from scratch,
without importing the validator, so that an accepted record is judged by a second reading
of the contract rather than by the code under test. It is deliberately simple and a little
looser than the validator (the validator may refuse more, never less).

:data:`TALLY` counts, over every generated case of ``tests/reliability/test_snapshot_*``:
cases, crashes (any exception other than a SnapshotError/ManifestError naming a file),
quarantined and accepted records, named-file errors, step errors, silent accepts (a
record that breaks the contract, or one built to be refused, found among the accepted)
and wrongful quarantines. ``test_snapshot_tally`` writes it to a JSON report and asserts
on it.
"""

from __future__ import annotations

import math
import traceback
import unicodedata
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from pipeline.manifest import ManifestError
from pipeline.snapshot.sieve import SnapshotError

STEP = 3
VOCAB = 64
FIELDS = {"rollout_id", "trainer_step", "generated_by_policy_version", "policy_uri",
          "messages", "prompt", "prompt_token_ids", "response_token_ids",
          "response_loss_mask", "reward", "finish_reason", "token_fidelity", "speculative"}
ROLES = {"system", "user", "assistant", "tool"}
# blank although neither control, format nor separator (Hangul fillers, braille blank)
BLANKS = {"\u3164", "\u115f", "\u1160", "\uffa0", "\u2800"}
MAX_QUOTE = 260  # what a field, a reason or a quoted id may take in the quarantine


# Default_Ignorable_Code_Point, as Unicode 16's DerivedCoreProperties.txt lists it
IGNORABLE = ((0x00AD, 0x00AD), (0x034F, 0x034F), (0x061C, 0x061C), (0x115F, 0x1160),
             (0x17B4, 0x17B5), (0x180B, 0x180F), (0x200B, 0x200F), (0x202A, 0x202E),
             (0x2060, 0x206F), (0x3164, 0x3164), (0xFE00, 0xFE0F), (0xFEFF, 0xFEFF),
             (0xFFA0, 0xFFA0), (0xFFF0, 0xFFF8), (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A),
             (0xE0000, 0xE0FFF))


def visible(text: str) -> bool:
    """Some character is neither default-ignorable, a control, format or separator
    character, nor a blank (a character this interpreter's Unicode data does not know yet
    may be either: it is not held against the record)."""
    return any(unicodedata.category(c) not in {"Cc", "Cf", "Zs", "Zl", "Zp"}
               and c not in BLANKS
               and not any(lo <= ord(c) <= hi for lo, hi in IGNORABLE) for c in text)


def _utf8(text: Any) -> bool:
    if type(text) is not str:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _ids(value: Any, vocab: int) -> bool:
    return isinstance(value, list) and all(type(t) is int and 0 <= t < vocab for t in value)


def contract_violations(rec: dict[str, Any], *, step: int = STEP,
                        vocab: int = VOCAB) -> list[str]:
    """What an accepted record breaks of the contract; empty when it keeps it."""
    bad = []
    if set(rec) != FIELDS:
        return [f"fields {sorted(set(rec) ^ FIELDS)}"]
    if not (_utf8(rec["rollout_id"]) and visible(rec["rollout_id"])
            and len(rec["rollout_id"]) <= 512):
        bad.append("rollout_id")
    if type(rec["trainer_step"]) is not int or rec["trainer_step"] != step:
        bad.append("trainer_step")
    version = rec["generated_by_policy_version"]
    if type(version) is not int or not 0 <= version <= step:
        bad.append("generated_by_policy_version")
    if not (_utf8(rec["policy_uri"]) and visible(rec["policy_uri"])):
        bad.append("policy_uri")
    messages = rec["messages"]
    if messages is not None and not (
            isinstance(messages, list) and messages
            and all(isinstance(m, dict) and set(m) == {"role", "content"}
                    and m["role"] in ROLES and _utf8(m["content"]) for m in messages)):
        bad.append("messages")
    if rec["prompt"] is not None and not _utf8(rec["prompt"]):
        bad.append("prompt")
    if messages is None and rec["prompt"] is None:
        bad.append("messages/prompt")
    for name in ("prompt_token_ids", "response_token_ids"):
        if rec[name] is not None and not _ids(rec[name], vocab):
            bad.append(name)
    mask, response = rec["response_loss_mask"], rec["response_token_ids"]
    if mask is not None and not (isinstance(response, list) and isinstance(mask, list)
                                 and len(mask) == len(response)
                                 and all(type(v) is int and v in (0, 1) for v in mask)):
        bad.append("response_loss_mask")
    reward = rec["reward"]
    if reward is not None and not (type(reward) is float and math.isfinite(reward)):
        bad.append("reward")
    if rec["finish_reason"] is not None and not (_utf8(rec["finish_reason"])
                                                 and len(rec["finish_reason"]) <= 64):
        bad.append("finish_reason")
    fidelity = rec["token_fidelity"]
    if fidelity not in ("exact", "retokenized"):
        bad.append("token_fidelity")
    if fidelity == "exact" and (rec["prompt_token_ids"] is None or response is None):
        bad.append("token_fidelity exact without ids")
    if response is not None:
        if not response:
            bad.append("empty response ids")
    elif not (isinstance(messages, list) and messages and isinstance(messages[-1], dict)
              and messages[-1].get("role") == "assistant"
              and visible(messages[-1].get("content") or "")):
        bad.append("no visible response")
    spec = rec["speculative"]
    if spec is not None and not counters_keep_their_meaning(
            spec, response if isinstance(response, list) else None):
        bad.append("speculative")
    return bad


def counters_keep_their_meaning(spec: Any, response: list | None) -> bool:
    """The counters are well formed and what their passes emitted fits in ``response``
    (after its first, prefill, token; not checked without response ids)."""
    if not _speculative_ok(spec):
        return False
    if response is None or not spec["verify_ct"]:
        return True
    emitted = (spec["completion_tokens"] - 1 if spec["completion_tokens"] is not None
               else spec["accepted_tokens"] + spec["verify_ct"])
    return emitted <= len(response) - 1


def _speculative_ok(spec: Any) -> bool:
    """The engine's counters: a visible drafter version, counts that are non-negative ints
    (verify passes always; emitted tokens by one count or the other), at least one token per
    verify pass after the prefill token, no more accepted drafts than proposed ones nor than
    emitted tokens, and without a pass (never one for drafter ``none``) nothing drafted,
    accepted or emitted but the prefill token."""
    names = ("verify_ct", "completion_tokens", "accepted_tokens", "draft_tokens")
    if not (isinstance(spec, dict) and set(spec) == {"drafter_version", *names}):
        return False
    version = spec["drafter_version"]
    counts = [spec[n] for n in names]
    if not (_utf8(version) and visible(version)) or counts[0] is None:
        return False
    if not all(c is None or (type(c) is int and c >= 0) for c in counts):
        return False
    verify, completion, accepted, drafted = counts
    if verify == 0:  # no pass: nothing drafted, accepted or emitted past the prefill token
        return ((completion is not None or accepted is not None) and not accepted
                and not drafted and (completion is None or completion <= 1))
    return ((completion is not None or accepted is not None)
            and version != "none"  # no drafter, no verify pass
            and (completion is None or completion >= verify + 1)
            and (accepted is None or drafted is None or accepted <= drafted)
            and (accepted is None or completion is None or accepted <= completion - 1))


def names_file(error: BaseException, prefixes: list[str]) -> bool:
    """Whether ``error`` names a file under one of the dataset ``prefixes``."""
    text = str(error)
    return any(p in text for p in prefixes) and (".json" in text or ".parquet" in text)


@dataclass
class Tally:
    cases: int = 0
    crashes: int = 0
    quarantined: int = 0
    accepted: int = 0
    named_file_errors: int = 0
    step_errors: int = 0
    silently_accepted: int = 0
    wrongly_quarantined: int = 0
    classes: Counter = field(default_factory=Counter)
    first_failures: list[str] = field(default_factory=list)

    def fail(self, what: str, kind: str) -> str:
        setattr(self, kind, getattr(self, kind) + 1)
        if len(self.first_failures) < 20:
            self.first_failures.append(what[:2000])
        return what

    def report(self) -> dict[str, Any]:
        out = asdict(self)
        out["classes"] = dict(sorted(self.classes.items()))
        return out


TALLY = Tally()


def expect_named_error(error: BaseException, prefixes: list[str]) -> str | None:
    """Tally an error a reader raised: a named-file error, or a crash (returned)."""
    if isinstance(error, SnapshotError | ManifestError) and names_file(error, prefixes):
        TALLY.named_file_errors += 1
        return None
    return TALLY.fail(f"crash: {type(error).__name__}: {error}\n"
                      + "".join(traceback.format_exception(error)[-6:]), "crashes")
