"""The rollout-snapshot record contract: Arrow schema and per-record validation.

An RL trainer hands Aerie one record per rollout (see DESIGN §3). Validation is done on
plain Python values so that it covers records from Aerie's own writer and Parquet written
by other tools alike; string fields may arrive as ``bytes`` (read as binary so that invalid
UTF-8 is caught per record rather than failing a whole column).

:func:`validate_record` either returns the normalised record (exactly the fields of
:data:`ROLLOUT_SCHEMA`) or raises :class:`RecordError` naming the field and the reason.
Duplicate ids are a property of a set of records, checked by the callers.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

ROLLOUT_SCHEMA_VERSION = 1
ROLES = frozenset({"system", "user", "assistant", "tool"})
FIDELITIES = frozenset({"exact", "retokenized"})

_MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
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
    ],
    metadata={"aerie.kind": "rollout_snapshot",
              "aerie.schema_version": str(ROLLOUT_SCHEMA_VERSION)},
)
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


class RecordError(ValueError):
    """A record violates the contract; ``field`` names the offending field."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def validate_record(raw: Mapping[str, Any], *, vocab_size: int, step: int | None = None,
                    limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """The normalised record, or :class:`RecordError` for the first violation found."""
    if not isinstance(raw, Mapping):
        raise RecordError("<record>", f"expected a mapping, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(ROLLOUT_SCHEMA.names))
    if unknown:
        raise RecordError(unknown[0], "unknown field")
    for name in REQUIRED:
        if raw.get(name) is None:
            raise RecordError(name, "missing")

    rec: dict[str, Any] = {}
    rec["rollout_id"] = _text(raw, "rollout_id", limits.max_id_chars, allow_empty=False)
    rec["trainer_step"] = _int(raw, "trainer_step", minimum=0)
    if step is not None and rec["trainer_step"] != step:
        raise RecordError("trainer_step", f"{rec['trainer_step']} in the snapshot of step {step}")
    rec["generated_by_policy_version"] = _int(raw, "generated_by_policy_version", minimum=0)
    if rec["generated_by_policy_version"] > rec["trainer_step"]:
        raise RecordError("generated_by_policy_version",
                          f"{rec['generated_by_policy_version']} is newer than trainer_step "
                          f"{rec['trainer_step']}")
    rec["policy_uri"] = _text(raw, "policy_uri", limits.max_text_chars, allow_empty=False)
    rec["messages"] = _messages(raw.get("messages"), limits)
    rec["prompt"] = _optional_text(raw, "prompt", limits.max_text_chars)
    if rec["messages"] is None and rec["prompt"] is None:
        raise RecordError("messages", "missing (and no prompt either)")
    rec["prompt_token_ids"] = _token_ids(raw, "prompt_token_ids", vocab_size,
                                         limits.max_prompt_tokens)
    rec["response_token_ids"] = _token_ids(raw, "response_token_ids", vocab_size,
                                           limits.max_response_tokens)
    rec["response_loss_mask"] = _loss_mask(raw, rec["response_token_ids"])
    rec["reward"] = _reward(raw.get("reward"))
    rec["finish_reason"] = _optional_text(raw, "finish_reason", 64)
    fidelity = _text(raw, "token_fidelity", 32, allow_empty=False)
    if fidelity not in FIDELITIES:
        raise RecordError("token_fidelity", f"{fidelity!r} is not one of {sorted(FIDELITIES)}")
    rec["token_fidelity"] = fidelity
    if fidelity == "exact":
        for name in ("prompt_token_ids", "response_token_ids"):
            if rec[name] is None:
                raise RecordError(name, "missing although token_fidelity is 'exact'")
    _check_response_present(rec)
    return rec


def _check_response_present(rec: dict[str, Any]) -> None:
    ids = rec["response_token_ids"]
    if ids is not None:
        if not ids:
            raise RecordError("response_token_ids", "empty response")
        return
    messages = rec["messages"] or []
    if not messages or messages[-1]["role"] != "assistant":
        raise RecordError("messages", "no response: the last message is not from the assistant")
    if not messages[-1]["content"].strip():
        raise RecordError("messages", "empty response: the last assistant message is empty")


def _decode(name: str, value: Any) -> str:
    if isinstance(value, bytes | bytearray):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise RecordError(name, f"invalid UTF-8 at byte {e.start}") from None
    if not isinstance(value, str):
        raise RecordError(name, f"expected text, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RecordError(name, f"invalid UTF-8 (unpaired surrogate at {e.start})") from None
    return value


def _text(raw: Mapping[str, Any], name: str, max_chars: int, *, allow_empty: bool) -> str:
    value = _decode(name, raw.get(name))
    if not allow_empty and not value.strip():
        raise RecordError(name, "empty")
    if len(value) > max_chars:
        raise RecordError(name, f"absurd length: {len(value)} chars (limit {max_chars})")
    return value


def _optional_text(raw: Mapping[str, Any], name: str, max_chars: int) -> str | None:
    if raw.get(name) is None:
        return None
    return _text(raw, name, max_chars, allow_empty=True)


def _int(raw: Mapping[str, Any], name: str, *, minimum: int) -> int:
    value = raw.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RecordError(name, f"expected an integer, got {type(value).__name__}")
    if value < minimum:
        raise RecordError(name, f"{value} is below {minimum}")
    return value


def _messages(value: Any, limits: Limits) -> list[dict[str, str]] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple):
        raise RecordError("messages", f"expected a list, got {type(value).__name__}")
    if not value:
        raise RecordError("messages", "empty list")
    if len(value) > limits.max_messages:
        raise RecordError("messages", f"absurd length: {len(value)} messages")
    out, total = [], 0
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise RecordError(where, f"expected a mapping, got {type(message).__name__}")
        if set(message) - {"role", "content"}:
            raise RecordError(where, f"unknown keys {sorted(set(message) - {'role', 'content'})}")
        if message.get("role") is None:
            raise RecordError(f"{where}.role", "missing")
        role = _decode(f"{where}.role", message["role"])
        if role not in ROLES:
            raise RecordError(f"{where}.role", f"{role!r} is not one of {sorted(ROLES)}")
        if message.get("content") is None:
            raise RecordError(f"{where}.content", "missing")
        content = _decode(f"{where}.content", message["content"])
        total += len(content)
        if total > limits.max_text_chars:
            raise RecordError(f"{where}.content", f"absurd length: over {limits.max_text_chars} "
                                                  "chars of message text")
        out.append({"role": role, "content": content})
    return out


def _token_ids(raw: Mapping[str, Any], name: str, vocab_size: int,
               max_tokens: int) -> list[int] | None:
    value = raw.get(name)
    if value is None:
        return None
    if not isinstance(value, list | tuple):
        raise RecordError(name, f"expected a list of token ids, got {type(value).__name__}")
    if len(value) > max_tokens:
        raise RecordError(name, f"absurd length: {len(value)} tokens (limit {max_tokens})")
    for i, tok in enumerate(value):
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise RecordError(name, f"[{i}] expected an integer, got {type(tok).__name__}")
        if not 0 <= tok < vocab_size:
            raise RecordError(name, f"[{i}] = {tok} is outside the tokenizer's range "
                                    f"[0, {vocab_size})")
    return list(value)


def _loss_mask(raw: Mapping[str, Any], response_ids: list[int] | None) -> list[int] | None:
    value = raw.get("response_loss_mask")
    if value is None:
        return None
    if response_ids is None:
        raise RecordError("response_loss_mask", "given without response_token_ids")
    if not isinstance(value, list | tuple):
        raise RecordError("response_loss_mask", f"expected a list, got {type(value).__name__}")
    if len(value) != len(response_ids):
        raise RecordError("response_loss_mask", f"{len(value)} entries for "
                                                f"{len(response_ids)} response tokens")
    if any(isinstance(v, bool) or v not in (0, 1) for v in value):
        raise RecordError("response_loss_mask", "entries must be 0 or 1")
    return [int(v) for v in value]


def _reward(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RecordError("reward", f"expected a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise RecordError("reward", f"not finite: {value}")
    return float(value)


def record_to_json(raw: Any) -> str:
    """A lossless JSON rendering of any record, for the quarantine (bytes kept as base64)."""
    return json.dumps(_jsonable(raw), sort_keys=True, ensure_ascii=True)


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        return {"$base64": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return {"$float": repr(value)}
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return {"$repr": repr(value), "$type": type(value).__name__}
