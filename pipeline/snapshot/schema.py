"""The rollout-snapshot record contract: Arrow schema and per-record validation.

An RL trainer hands Aerie one record per rollout (see DESIGN §3). Validation is done on
plain Python values so that it covers records from Aerie's own writer and Parquet written
by other tools alike; string fields may arrive as ``bytes`` (read as binary so that invalid
UTF-8 is caught per record rather than failing a whole column). Integers may be any
:class:`numbers.Integral` (numpy's included, ``bool`` never), numbers any
:class:`numbers.Real`, and token id lists any 1-D array-like with ``.tolist()``.

:func:`validate_record` either returns the normalised record (exactly the fields of
:data:`ROLLOUT_SCHEMA`, plain Python values that fit its Arrow types) or raises
:class:`RecordError` naming the field and the reason, both quoted within
:data:`~.render.QUOTE_CHARS` characters. It reads a mapping once, into a plain dict, so a
mapping that raises while being read is a :class:`RecordError` too. Duplicate ids are a
property of a set of records, checked by the callers.

Schema 2 adds ``speculative``: the counters of the speculative decoding that generated the
rollout, as the engine reported them (:data:`SPECULATIVE_FIELDS`), and the drafter version
that served it. Schema-1 files are still read (the column is then null).
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import regex

from pipeline.formats import ROLLOUT_SCHEMA_VERSION
from pipeline.snapshot.counters import emitted_by_passes
from pipeline.snapshot.render import int_text, quote, safe_repr, type_name

ROLES = frozenset({"system", "user", "assistant", "tool"})
FIDELITIES = frozenset({"exact", "retokenized"})

NO_DRAFTER_VERSION = "none"  # drafter_version of a rollout the engine generated without a drafter
_MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
# What the rollout engine reported about its speculative decoding of one rollout:
SPECULATIVE_FIELDS = (
    "drafter_version",  # the registry version that drafted it ("none": no drafter)
    "verify_ct",  # draft-verify passes (SGLang spec_verify_ct; the prefill is not one)
    "completion_tokens",  # generated tokens, the prefill token included (SGLang's count)
    "accepted_tokens",  # accepted draft tokens, where the engine reports them
    "draft_tokens",  # proposed draft tokens, where the engine reports them
)
_SPECULATIVE = pa.struct([("drafter_version", pa.string())]
                         + [(name, pa.int64()) for name in SPECULATIVE_FIELDS[1:]])
ROLLOUT_SCHEMA = pa.schema(
    [
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("trainer_step", pa.int64(), nullable=False),
        pa.field("generated_by_policy_version", pa.int64(), nullable=False),
        pa.field("policy_uri", pa.string(), nullable=False),
        pa.field("messages", pa.list_(_MESSAGE)),
        pa.field("prompt", pa.string()),
        pa.field("prompt_token_ids", pa.list_(pa.int32())),
        pa.field("response_token_ids", pa.list_(pa.int32())),
        pa.field("response_loss_mask", pa.list_(pa.int8())),
        pa.field("reward", pa.float64()),
        pa.field("finish_reason", pa.string()),
        pa.field("token_fidelity", pa.string(), nullable=False),
        pa.field("speculative", _SPECULATIVE),
    ],
    metadata={"aerie.kind": "rollout_snapshot",
              "aerie.schema_version": str(ROLLOUT_SCHEMA_VERSION)},
)
READABLE_SCHEMA_VERSIONS = (1, ROLLOUT_SCHEMA_VERSION)  # what this release reads
ADDED_FIELDS = {"speculative": 2}  # nullable fields newer than schema 1: null when absent
REQUIRED = ("rollout_id", "trainer_step", "generated_by_policy_version", "policy_uri",
            "token_fidelity")


@dataclass(frozen=True)
class Limits:
    """Bounds beyond which a record is absurd rather than merely long."""

    max_prompt_tokens: int = 131_072
    max_response_tokens: int = 131_072
    max_text_chars: int = 4_000_000
    max_messages: int = 1_024
    max_id_chars: int = 512


DEFAULT_LIMITS = Limits()
INT64_MAX = 2**63 - 1
_TOKEN_ID_BOUND = 2**31  # token ids are stored as int32, whatever the vocab claims
_MAX_FIELDS = 64  # more keys than that and a mapping is not a record


class RecordError(ValueError):
    """A record violates the contract; ``field`` names the offending field.

    Both ``field`` and ``reason`` are quoted (valid UTF-8, bounded) because they echo
    untrusted input into logs, manifests and Dagster metadata.
    """

    def __init__(self, field: str, reason: str):
        self.field, self.reason = quote(field), quote(reason)
        super().__init__(f"{self.field}: {self.reason}")


# What shows nothing, by Unicode property (the UCD the ``regex`` package carries, newer than
# the interpreter's): default-ignorable code points (zero-width characters, variation
# selectors, the Hangul fillers, tag characters), unassigned code points, controls, format
# characters and separators; plus the braille blank, a symbol drawn as an empty cell.
_INVISIBLE = regex.compile(
    r"[\p{Default_Ignorable_Code_Point}\p{Cn}\p{Cc}\p{Cf}\p{Z}\p{Cs}\N{BRAILLE PATTERN BLANK}]")


def has_visible_content(text: str) -> bool:
    """Whether ``text`` shows anything: a character that is none of :data:`_INVISIBLE`."""
    return _INVISIBLE.sub("", text) != ""


def validate_record(raw: Mapping[str, Any], *, vocab_size: int, step: int | None = None,
                    limits: Limits = DEFAULT_LIMITS,
                    defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The normalised record, or :class:`RecordError` for the first violation found.

    ``defaults`` fill fields the record does not have at all (a field present as ``None``
    stays missing).
    """
    record = _Reads(_read_mapping("<record>", raw))
    try:
        return _checked(record, vocab_size=vocab_size, step=step, limits=limits,
                        defaults=defaults)
    except RecordError:
        raise
    except Exception as e:  # a value whose reading raises (a float subclass, say): its field
        raise RecordError(record.last, f"unreadable: {type_name(e)}: "
                                       f"{quote(safe_repr(e), 100)}") from None


class _Reads(dict):
    """A record's fields, remembering the one read last: the field whose value was being
    checked when something other than a :class:`RecordError` was raised."""

    last = "<record>"

    def get(self, key: Any, default: Any = None) -> Any:
        self.last = key
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.last = key
        return super().__getitem__(key)


def _checked(record: _Reads, *, vocab_size: int, step: int | None, limits: Limits,
             defaults: Mapping[str, Any] | None) -> dict[str, Any]:
    for key in record:
        if not isinstance(key, str):
            raise RecordError(safe_repr(key), f"field name is {type_name(key)}, not text")
        if key not in _FIELDS:  # an invisible name is shown as its repr
            raise RecordError(key if has_visible_content(key) else ascii(key), "unknown field")
    for name, value in (defaults or {}).items():
        record.setdefault(name, value)
    for name in REQUIRED:
        if record.get(name) is None:
            raise RecordError(name, "missing")

    rec: dict[str, Any] = {}
    rec["rollout_id"] = _text(record, "rollout_id", limits.max_id_chars, allow_empty=False)
    rec["trainer_step"] = _int(record, "trainer_step", minimum=0)
    if step is not None and rec["trainer_step"] != step:
        raise RecordError("trainer_step", f"{rec['trainer_step']} in the snapshot of step {step}")
    rec["generated_by_policy_version"] = _int(record, "generated_by_policy_version", minimum=0)
    if rec["generated_by_policy_version"] > rec["trainer_step"]:
        raise RecordError("generated_by_policy_version",
                          f"{rec['generated_by_policy_version']} is newer than trainer_step "
                          f"{rec['trainer_step']}")
    rec["policy_uri"] = _text(record, "policy_uri", limits.max_text_chars, allow_empty=False)
    rec["messages"] = _messages(record.get("messages"), limits)
    rec["prompt"] = _optional_text(record, "prompt", limits.max_text_chars)
    if rec["messages"] is None and rec["prompt"] is None:
        raise RecordError("messages", "missing (and no prompt either)")
    rec["prompt_token_ids"] = _token_ids(record, "prompt_token_ids", vocab_size,
                                         limits.max_prompt_tokens)
    rec["response_token_ids"] = _token_ids(record, "response_token_ids", vocab_size,
                                           limits.max_response_tokens)
    rec["response_loss_mask"] = _loss_mask(record, rec["response_token_ids"])
    rec["reward"] = _reward(record.get("reward"))
    rec["finish_reason"] = _optional_text(record, "finish_reason", 64)
    fidelity = _text(record, "token_fidelity", 32, allow_empty=False)
    if fidelity not in FIDELITIES:
        raise RecordError("token_fidelity", f"{fidelity!r} is not one of {sorted(FIDELITIES)}")
    rec["token_fidelity"] = fidelity
    if fidelity == "exact":
        for name in ("prompt_token_ids", "response_token_ids"):
            if rec[name] is None:
                raise RecordError(name, "missing although token_fidelity is 'exact'")
    _check_response_present(rec)
    rec["speculative"] = _speculative(record.get("speculative"))
    _check_counters_fit_response(rec)
    return rec



_FIELDS = frozenset(ROLLOUT_SCHEMA.names)


def _read_mapping(where: str, value: Any) -> dict[Any, Any]:
    """``value`` copied into a plain dict, read once; anything it raises is the record's."""
    if not isinstance(value, Mapping):
        raise RecordError(where, f"expected a mapping, got {type_name(value)}")
    out: dict[Any, Any] = {}
    try:
        for key in value:
            if len(out) == _MAX_FIELDS:
                raise RecordError(where, f"more than {_MAX_FIELDS} fields")
            out[key] = value[key]
    except RecordError:
        raise
    except Exception as e:  # a Mapping whose iteration or __getitem__ raises
        raise RecordError(where, f"unreadable mapping: {type_name(e)}: "
                                 f"{quote(safe_repr(e), 100)}") from None
    return out


def _check_response_present(rec: dict[str, Any]) -> None:
    ids = rec["response_token_ids"]
    if ids is not None:
        if not ids:
            raise RecordError("response_token_ids", "empty response")
        return
    messages = rec["messages"] or []
    if not messages or messages[-1]["role"] != "assistant":
        raise RecordError("messages", "no response: the last message is not from the assistant")
    if not has_visible_content(messages[-1]["content"]):
        raise RecordError("messages", "empty response: the last assistant message shows nothing")


def _decode(name: str, value: Any) -> str:
    if isinstance(value, bytes | bytearray):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise RecordError(name, f"invalid UTF-8 at byte {e.start}") from None
    if not isinstance(value, str):
        raise RecordError(name, f"expected text, got {type_name(value)}")
    value = str.__str__(value)  # a plain str, whatever subclass came in (numpy's str_)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RecordError(name, f"invalid UTF-8 (unpaired surrogate at {e.start})") from None
    return value


def _text(record: dict[str, Any], name: str, max_chars: int, *, allow_empty: bool) -> str:
    value = _decode(name, record.get(name))
    if not allow_empty and not has_visible_content(value):
        raise RecordError(name, "empty (nothing visible)")
    if len(value) > max_chars:
        raise RecordError(name, f"absurd length: {len(value)} chars (limit {max_chars})")
    return value


def _optional_text(record: dict[str, Any], name: str, max_chars: int) -> str | None:
    if record.get(name) is None:
        return None
    return _text(record, name, max_chars, allow_empty=True)


def _is_integer(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _int(record: dict[str, Any], name: str, *, minimum: int, where: str | None = None
         ) -> int:
    value, where = record.get(name), where or name
    if not _is_integer(value):
        raise RecordError(where, f"expected an integer, got {type_name(value)}")
    value = operator.index(value)
    if value < minimum:
        raise RecordError(where, f"{int_text(value)} is below {minimum}")
    if value > INT64_MAX:
        raise RecordError(where, f"{int_text(value)} is beyond the int64 range")
    return value


def _messages(value: Any, limits: Limits) -> list[dict[str, str]] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple):
        raise RecordError("messages", f"expected a list, got {type_name(value)}")
    if not value:
        raise RecordError("messages", "empty list")
    if len(value) > limits.max_messages:
        raise RecordError("messages", f"absurd length: {len(value)} messages")
    out, total = [], 0
    for i, item in enumerate(value):
        where = f"messages[{i}]"
        message = _read_mapping(where, item)
        for key in message:
            if not isinstance(key, str):
                raise RecordError(where, f"key {safe_repr(key, 60)} is {type_name(key)}, "
                                         "not text")
            if key not in ("role", "content"):
                raise RecordError(where, f"unknown key {quote(key, 60)}")
        if message.get("role") is None:
            raise RecordError(f"{where}.role", "missing")
        role = _decode(f"{where}.role", message["role"])
        if role not in ROLES:
            raise RecordError(f"{where}.role", f"{quote(role, 60)!r} is not one of "
                                               f"{sorted(ROLES)}")
        if message.get("content") is None:
            raise RecordError(f"{where}.content", "missing")
        content = _decode(f"{where}.content", message["content"])
        total += len(content)
        if total > limits.max_text_chars:
            raise RecordError(f"{where}.content", f"absurd length: over {limits.max_text_chars} "
                                                  "chars of message text")
        out.append({"role": role, "content": content})
    return out


def _as_list(name: str, value: Any, what: str) -> list[Any]:
    """A list or tuple as a list; a 1-D array-like (numpy) through its ``.tolist()``."""
    if isinstance(value, list | tuple):
        return list(value)
    if not isinstance(value, str | bytes | bytearray | Mapping):
        tolist = getattr(value, "tolist", None)
        if callable(tolist):
            listed = tolist()
            if isinstance(listed, list):
                return listed
    raise RecordError(name, f"expected a list of {what}, got {type_name(value)}")


def _token_ids(record: dict[str, Any], name: str, vocab_size: int,
               max_tokens: int) -> list[int] | None:
    value = record.get(name)
    if value is None:
        return None
    value = _as_list(name, value, "token ids")
    if len(value) > max_tokens:
        raise RecordError(name, f"absurd length: {len(value)} tokens (limit {max_tokens})")
    bound = min(vocab_size, _TOKEN_ID_BOUND)
    out = []
    for i, tok in enumerate(value):
        if type(tok) is not int:  # the common case stays cheap
            if not _is_integer(tok):
                raise RecordError(name, f"[{i}] expected an integer, got {type_name(tok)}")
            tok = operator.index(tok)
        if not 0 <= tok < bound:
            raise RecordError(name, f"[{i}] = {int_text(tok)} is outside the tokenizer's range "
                                    f"[0, {bound})")
        out.append(tok)
    return out


def _loss_mask(record: dict[str, Any], response_ids: list[int] | None) -> list[int] | None:
    value = record.get("response_loss_mask")
    if value is None:
        return None
    if response_ids is None:
        raise RecordError("response_loss_mask", "given without response_token_ids")
    value = _as_list("response_loss_mask", value, "0/1 entries")
    if len(value) != len(response_ids):
        raise RecordError("response_loss_mask", f"{len(value)} entries for "
                                                f"{len(response_ids)} response tokens")
    if not all(_is_integer(v) and operator.index(v) in (0, 1) for v in value):
        raise RecordError("response_loss_mask", "entries must be the integers 0 or 1")
    return [operator.index(v) for v in value]


def _reward(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RecordError("reward", f"expected a number, got {type_name(value)}")
    try:
        reward = float(value)
    except OverflowError:
        raise RecordError("reward", "beyond the float64 range") from None
    if not math.isfinite(reward):
        raise RecordError("reward", f"not finite: {reward}")
    return reward


def _speculative(value: Any) -> dict[str, Any] | None:
    """The engine's speculative counters of one rollout: ``drafter_version`` and
    ``verify_ct`` always, with ``completion_tokens`` or ``accepted_tokens`` (or both);
    ``draft_tokens`` optional. Checked against their definitions: every token after the
    prefill token is emitted by a verify pass, each pass emits at least one, and an accepted
    draft token is one of those emitted; so without a pass (``verify_ct`` 0, always for
    drafter ``none``) nothing was drafted, accepted or emitted past the prefill token."""
    if value is None:
        return None
    raw = _read_mapping("speculative", value)
    for key in raw:
        if key not in SPECULATIVE_FIELDS:
            raise RecordError("speculative", f"unknown key {quote(safe_repr(key), 60)}")
    if raw.get("drafter_version") is None:
        raise RecordError("speculative.drafter_version", "missing")
    out: dict[str, Any] = {"drafter_version": _version_text(raw["drafter_version"])}
    for name in SPECULATIVE_FIELDS[1:]:
        if raw.get(name) is None:
            if name == "verify_ct":
                raise RecordError("speculative.verify_ct", "missing")
            out[name] = None
        else:
            out[name] = _int(raw, name, minimum=0, where=f"speculative.{name}")
    verify, completion, accepted, drafted = (out[n] for n in SPECULATIVE_FIELDS[1:])
    if completion is None and accepted is None:
        raise RecordError("speculative", "needs completion_tokens or accepted_tokens to "
                                         "count what the verify passes emitted")
    if completion is not None and verify > 0 and completion < verify + 1:
        raise RecordError("speculative.completion_tokens",
                          f"{completion} tokens from {verify} verify passes (each emits >= 1, "
                          f"after the prefill token)")
    if accepted is not None and drafted is not None and accepted > drafted:
        raise RecordError("speculative.accepted_tokens",
                          f"{accepted} accepted of {drafted} drafted")
    if out["drafter_version"] == NO_DRAFTER_VERSION and verify:
        raise RecordError("speculative.verify_ct",
                          f"{verify} verify passes with drafter_version 'none' (no drafter "
                          f"verifies nothing)")
    if verify == 0:
        for name in ("accepted_tokens", "draft_tokens"):
            if out[name]:
                raise RecordError(f"speculative.{name}",
                                  f"{out[name]} without a verify pass (verify_ct 0)")
        if completion is not None and completion > 1:
            raise RecordError("speculative.completion_tokens",
                              f"{completion} tokens without a verify pass (verify_ct 0: the "
                              f"prefill token at most)")
    if accepted is not None and completion is not None and accepted > completion - 1:
        raise RecordError("speculative.accepted_tokens",
                          f"{accepted} accepted of {completion - 1} emitted after the prefill "
                          f"token (completion_tokens {completion})")
    return out


def _check_counters_fit_response(rec: dict[str, Any]) -> None:
    """The tokens the counters say verify passes emitted are tokens of the response: no more
    than it holds after its first (prefill) token."""
    spec, response = rec["speculative"], rec["response_token_ids"]
    if spec is None or response is None or not spec["verify_ct"]:
        return
    emitted = emitted_by_passes(spec)
    if emitted > len(response) - 1:
        field = ("completion_tokens" if spec["completion_tokens"] is not None
                 else "accepted_tokens")
        raise RecordError(f"speculative.{field}",
                          f"{emitted} tokens emitted by {spec['verify_ct']} verify passes, "
                          f"but the response holds {len(response)} (the prefill token "
                          f"included)")


def _version_text(value: Any) -> str:
    """A registry version as text (an integer, as MLflow numbers them, is written out)."""
    if _is_integer(value) and operator.index(value) >= 0:
        return str(operator.index(value))
    text = _decode("speculative.drafter_version", value)
    if not has_visible_content(text) or len(text) > 128:
        raise RecordError("speculative.drafter_version",
                          "empty (nothing visible)" if not has_visible_content(text)
                          else f"absurd length: {len(text)} chars (limit 128)")
    return text
