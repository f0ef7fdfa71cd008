"""Tokenization stage: validated rollouts of one RL step -> ``input_ids`` + ``loss_mask``.

Responsible for choosing each record's token source, checking exact ids against the chat
template, truncating to ``max_length``, and writing ``tokenized/step=NNNNNN/`` (Parquet parts
with :data:`TOKENIZED_SCHEMA`, then the manifest, last).

Token sources, in order of trust:

- ``exact``: ``token_fidelity == "exact"``; the engine's ``prompt_token_ids`` +
  ``response_token_ids`` are the truth (mask 0 on the prompt, 1 on the response, times
  ``response_loss_mask``). When the record has messages, the chat-template path is run too
  and compared; a difference is counted and reported (first differing position, the two
  tokens there), never fixed: the given ids are kept.
- ``chat_template``: messages with an assistant turn, rendered and masked by
  :mod:`pipeline.tokenize.chat_masks`.
- ``given_ids``: no assistant message but ``response_token_ids``; the prompt comes from
  ``prompt_token_ids``, else the messages' generation prompt, else the ``prompt`` text.

Truncation (samples longer than ``max_length``): tokens after the last masked token are
dropped first (nothing is trained on them). If the response end still lies beyond
``max_length``, the sample keeps a head of ``min(prompt length, max_length - keep_tail)``
tokens (the prompt start: system prompt and question) and fills the rest of ``max_length``
with the tokens that end at the response's last masked token. So at least ``keep_tail``
tokens ending at the response end survive, and the masked tokens kept are always those
nearest the end of the response. ``keep_tail >= max_length`` means: simply the last
``max_length`` tokens. Samples left with fewer than ``min_response_tokens`` masked tokens
are dropped and counted with their reason. (The "prompt" of a chat-template sample is
everything before the first assistant content.)

Output is deterministic (same snapshot and tokenizer -> same bytes) and memory is bounded
by one input file plus ``rows_per_file`` output rows.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
from transformers import PreTrainedTokenizerFast

from pipeline.contracts import FileEntry, Manifest
from pipeline.layout import policy_prefix, snapshot_prefix, tokenized_prefix
from pipeline.manifest import entry_for, withdraw_manifest, write_manifest
from pipeline.parquet import write_table
from pipeline.snapshot.policy import POLICY_KIND, PolicyRef, load_policy_ref
from pipeline.snapshot.reader import checked_manifest, read_part
from pipeline.snapshot.schema import READABLE_SCHEMA_VERSIONS, ROLLOUT_SCHEMA
from pipeline.snapshot.sieve import VALIDATED_KIND, SnapshotError
from pipeline.storage import Storage
from pipeline.tokenize.chat_masks import ChatMaskError, encode_chat, encode_prompt
from pipeline.tokenize.config import TokenizeConfig
from pipeline.tokenize.schema import TOKENIZED_KIND, TOKENIZED_SCHEMA, TOKENIZED_SCHEMA_VERSION
from pipeline.verified import committed

log = logging.getLogger(__name__)

_TOKENIZER_FILES = frozenset({"tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                              "chat_template.json", "special_tokens_map.json",
                              "added_tokens.json"})


@dataclass(frozen=True)
class Mismatch:
    """Where exact ids and the chat-template re-tokenization first differ."""

    sample_id: str
    position: int | None  # None: the text path could not be built (see detail)
    exact_len: int
    retokenized_len: int
    exact_token: str | None = None
    retokenized_token: str | None = None
    detail: str = ""


@dataclass(frozen=True)
class RecordResult:
    """One record's outcome: a sample (``dropped`` is None) or a drop reason."""

    sample_id: str
    source: str
    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    truncated: bool = False
    dropped: str | None = None
    detail: str = ""
    checked: bool = False  # exact ids were compared with the chat-template path
    mismatch: Mismatch | None = None


def truncate(input_ids: Sequence[int], loss_mask: Sequence[int], response_start: int,
             config: TokenizeConfig) -> tuple[list[int], list[int], bool]:
    """Cut a sample to ``config.max_length`` keeping the end of the response."""
    ids, mask = list(input_ids), list(loss_mask)
    limit = config.max_length
    if len(ids) <= limit:
        return ids, mask, False
    end = max((i + 1 for i in range(len(mask) - 1, -1, -1) if mask[i]), default=len(ids))
    if end <= limit:
        return ids[:limit], mask[:limit], True
    head = max(0, min(response_start, limit - min(config.keep_tail, limit)))
    tail = end - (limit - head)
    return ids[:head] + ids[tail:end], mask[:head] + mask[tail:end], True


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index where ``a`` and ``b`` differ (the shorter length if one is a prefix)."""
    if list(a) == list(b):
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def _compare(tokenizer: PreTrainedTokenizerFast, sample_id: str, exact: list[int],
             retokenized: list[int]) -> Mismatch | None:
    pos = first_difference(exact, retokenized)
    if pos is None:
        return None

    def token(ids: list[int]) -> str | None:
        return tokenizer.convert_ids_to_tokens(ids[pos]) if pos < len(ids) else None

    return Mismatch(sample_id, pos, len(exact), len(retokenized), token(exact),
                    token(retokenized))


def _check_exact(tokenizer: PreTrainedTokenizerFast, rec: Mapping[str, Any], prompt: list[int],
                 ids: list[int], eot: Sequence[str] | None) -> tuple[bool, Mismatch | None]:
    """Re-tokenize the messages and compare them with the engine's ids."""
    messages, sid = rec.get("messages"), rec["rollout_id"]
    if not messages:
        return False, None
    try:
        if messages[-1]["role"] == "assistant":
            text_ids, text_mask = encode_chat(tokenizer, messages, sample_id=sid,
                                              end_of_turn=eot)
            end = max((i + 1 for i, m in enumerate(text_mask) if m), default=len(text_ids))
            return True, _compare(tokenizer, sid, ids, text_ids[:end])
        return True, _compare(tokenizer, sid, prompt, encode_prompt(tokenizer, messages,
                                                                    sample_id=sid))
    except ChatMaskError as e:
        return True, Mismatch(sid, None, len(ids), 0, detail=str(e))


def tokenize_record(tokenizer: PreTrainedTokenizerFast, rec: Mapping[str, Any],
                    config: TokenizeConfig = TokenizeConfig()) -> RecordResult:
    """Build one training sample from a validated rollout record."""
    sid = rec["rollout_id"]
    eot = config.end_of_turn_tokens or None
    messages = rec.get("messages") or []
    response = rec.get("response_token_ids")
    checked, mismatch = False, None
    if rec["token_fidelity"] == "exact" and rec.get("prompt_token_ids") is not None \
            and response is not None:
        source, prompt = "exact", list(rec["prompt_token_ids"])
        ids = prompt + list(response)
        mask = [0] * len(prompt) + list(rec.get("response_loss_mask") or [1] * len(response))
        checked, mismatch = _check_exact(tokenizer, rec, prompt, ids, eot)
        response_start = len(prompt)
    elif any(m["role"] == "assistant" for m in messages):
        source = "chat_template"
        try:
            ids, mask = encode_chat(tokenizer, messages, sample_id=sid, end_of_turn=eot)
        except ChatMaskError as e:
            return RecordResult(sid, source, dropped=f"chat_template: {e.kind}", detail=str(e))
        response_start = next((i for i, m in enumerate(mask) if m), len(ids))
    elif response is not None:
        source = "given_ids"
        try:
            prompt = _given_prompt(tokenizer, rec, messages)
        except ChatMaskError as e:
            return RecordResult(sid, source, dropped=f"chat_template: {e.kind}", detail=str(e))
        ids = prompt + list(response)
        mask = [0] * len(prompt) + list(rec.get("response_loss_mask") or [1] * len(response))
        response_start = len(prompt)
    else:
        return RecordResult(sid, "none", dropped="no_response",
                            detail="no assistant message and no response_token_ids")
    if not any(mask):
        return RecordResult(sid, source, dropped="no_masked_tokens", checked=checked,
                            mismatch=mismatch, detail="the loss mask is all zeros")
    ids, mask, truncated = truncate(ids, mask, response_start, config)
    if sum(mask) < config.min_response_tokens:
        return RecordResult(sid, source, truncated=truncated, dropped="too_few_masked_tokens",
                            checked=checked, mismatch=mismatch,
                            detail=f"{sum(mask)} masked tokens after truncation")
    return RecordResult(sid, source, ids, mask, truncated, checked=checked, mismatch=mismatch)


def _given_prompt(tokenizer: PreTrainedTokenizerFast, rec: Mapping[str, Any],
                  messages: list) -> list[int]:
    if rec.get("prompt_token_ids") is not None:
        return list(rec["prompt_token_ids"])
    if messages:
        return encode_prompt(tokenizer, messages, sample_id=rec["rollout_id"])
    return list(tokenizer(rec.get("prompt") or "", add_special_tokens=False)["input_ids"])


# -- the stage ----------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenizeSummary:
    """Counts and lineage of one step's tokenization; ``to_meta`` is the manifest meta.

    ``records_in = samples + dropped``; ``truncated`` counts written samples that were cut;
    ``sources`` counts records by token source (``exact``, ``chat_template``, ``given_ids``).
    """

    step: int
    url: str
    records_in: int
    samples: int
    tokens: int
    masked_tokens: int
    truncated: int
    dropped: int
    dropped_reasons: dict[str, int]
    dropped_examples: list[dict[str, str]]
    sources: dict[str, int]
    retokenize_checked: int
    retokenize_mismatches: int
    mismatch_examples: list[dict[str, Any]]
    policy_uri: str  # storage key of the policy checkpoint
    tokenizer_fingerprint: str

    def to_meta(self) -> dict[str, Any]:
        """The manifest's meta: every count, no URL (the manifest sits where the data is)."""
        exact = self.sources.get("exact", 0)
        meta = {k: v for k, v in asdict(self).items() if k != "url"}
        return meta | {"exact": exact, "retokenized": self.records_in - exact}


class _Tally:
    """Accumulates per-record results into the summary's counts and examples."""

    def __init__(self, max_examples: int):
        self.max_examples = max_examples
        self.records = self.samples = self.tokens = self.masked = self.truncated = 0
        self.checked = self.mismatches = 0
        self.reasons: Counter[str] = Counter()
        self.sources: Counter[str] = Counter()
        self.dropped_examples: list[dict[str, str]] = []
        self.mismatch_examples: list[dict[str, Any]] = []

    def add(self, r: RecordResult) -> None:
        self.records += 1
        self.sources[r.source] += 1
        self.checked += r.checked
        if r.mismatch is not None:
            self.mismatches += 1
            if len(self.mismatch_examples) < self.max_examples:
                self.mismatch_examples.append(asdict(r.mismatch))
        if r.dropped is not None:
            self.reasons[r.dropped] += 1
            if len(self.dropped_examples) < self.max_examples:
                self.dropped_examples.append(
                    {"sample_id": r.sample_id, "reason": r.dropped, "detail": r.detail})
            return
        self.samples += 1
        self.truncated += r.truncated
        self.tokens += len(r.input_ids)
        self.masked += sum(r.loss_mask)


def load_step_tokenizer(storage: Storage, step: int) -> tuple[PreTrainedTokenizerFast, PolicyRef]:
    """The fast tokenizer (with chat template) of the policy checkpoint of ``step``.

    Only the small tokenizer files are downloaded; their sha256 must match the checkpoint's
    manifest. Raises when the checkpoint has no fast tokenizer or no chat template.
    """
    ref = load_policy_ref(storage, step)
    prefix = policy_prefix(step)
    manifest = committed(storage, prefix, POLICY_KIND)  # refuses one retention deleted
    entries = [e for e in manifest.files if e.path in _TOKENIZER_FILES]
    if "tokenizer.json" not in {e.path for e in entries}:
        raise FileNotFoundError(f"{ref.uri}: no tokenizer.json (a fast tokenizer is needed "
                                "for offsets)")
    with tempfile.TemporaryDirectory(prefix="aerie-tokenizer-") as tmp:
        for entry in entries:
            data = storage.read_bytes(f"{prefix}/{entry.path}")
            if len(data) != entry.bytes or hashlib.sha256(data).hexdigest() != entry.sha256:
                raise SnapshotError(f"{ref.uri}/{entry.path}: differs from its manifest")
            (Path(tmp) / entry.path).write_bytes(data)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp, local_files_only=True)
    if not tokenizer.chat_template:
        raise ValueError(f"{ref.uri}: the tokenizer has no chat template")
    return tokenizer, ref


def _accepted_records(storage: Storage, step: int) -> Iterator[dict[str, Any]]:
    """The validated records of ``step``, one input file and 1024 rows at a time."""
    prefix = snapshot_prefix(step)
    manifest = checked_manifest(storage, prefix, VALIDATED_KIND, READABLE_SCHEMA_VERSIONS)
    if manifest is None:
        raise SnapshotError(f"{storage.url(prefix)}: snapshot not validated yet")
    for entry in manifest.files:
        if entry.path.startswith("accepted-"):
            table = read_part(storage, prefix, entry, claimed=True, schema=ROLLOUT_SCHEMA)
            for batch in table.to_batches(max_chunksize=1024):
                yield from batch.to_pylist()


def run(storage: Storage, step: int,
        config: TokenizeConfig = TokenizeConfig()) -> TokenizeSummary:
    """Tokenize the validated snapshot of ``step`` and commit ``tokenized/step=NNNNNN/``."""
    tokenizer, policy = load_step_tokenizer(storage, step)
    prefix = tokenized_prefix(step)
    withdraw_manifest(storage, prefix)
    tally = _Tally(config.max_examples)
    entries: list[FileEntry] = []
    rows: list[dict[str, Any]] = []

    def flush() -> None:
        table = pa.Table.from_pylist(rows, schema=TOKENIZED_SCHEMA)
        written = write_table(storage, f"{prefix}/part-{len(entries):05d}.parquet", table)
        entries.append(entry_for(prefix, written, rows=table.num_rows))
        rows.clear()

    for rec in _accepted_records(storage, step):
        result = tokenize_record(tokenizer, rec, config)
        tally.add(result)
        if result.dropped is None:
            rows.append({"sample_id": result.sample_id, "step": step,
                         "input_ids": result.input_ids, "loss_mask": result.loss_mask})
            if len(rows) == config.rows_per_file:
                flush()
    if rows or not entries:
        flush()
    summary = TokenizeSummary(
        step=step, url=storage.url(prefix), records_in=tally.records, samples=tally.samples,
        tokens=tally.tokens, masked_tokens=tally.masked, truncated=tally.truncated,
        dropped=sum(tally.reasons.values()), dropped_reasons=dict(sorted(tally.reasons.items())),
        dropped_examples=tally.dropped_examples, sources=dict(sorted(tally.sources.items())),
        retokenize_checked=tally.checked, retokenize_mismatches=tally.mismatches,
        mismatch_examples=tally.mismatch_examples, policy_uri=policy.key,
        tokenizer_fingerprint=policy.tokenizer_fingerprint)
    write_manifest(storage, prefix, Manifest(
        kind=TOKENIZED_KIND, kind_version=TOKENIZED_SCHEMA_VERSION, files=tuple(entries),
        meta=summary.to_meta() | {"config": asdict(config),
                                  "source": snapshot_prefix(step)}))
    if summary.dropped or summary.retokenize_mismatches:
        log.warning("step %d: dropped %d of %d records (%s); %d of %d exact records differ "
                    "from their re-tokenized text", step, summary.dropped, summary.records_in,
                    summary.dropped_reasons, summary.retokenize_mismatches,
                    summary.retokenize_checked)
    return summary
