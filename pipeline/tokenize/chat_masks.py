"""Loss masks from chat messages: which tokens of a rendered conversation the policy wrote.

Responsible for rendering a conversation with the policy tokenizer's own chat template,
locating every assistant message in the rendered text, tokenizing it with offsets and
turning character spans into a per-token ``loss_mask``.

How an assistant message is located (no guessing about the template's markup): the
conversation is rendered twice, once as is and once with that message's content replaced by
a sentinel character that occurs nowhere in the real rendering. Everything the template
emits around the content (headers, injected ``<think>\\n\\n</think>\\n\\n``, default system
prompts, history rewriting) is identical in both renders, so the text before the first and
after the last sentinel pins the content's exact place. The content found there must equal
the message content, or the content with whitespace trimmed at either end (``| trim``,
``lstrip('\\n')``); anything else (content altered, rendered twice, dropped) is a
:class:`ChatMaskError` naming the sample and the message index.

Masking rules (pinned by the golden tests in ``tests/tokenize/golden/``):

- **Closing tokens.** An assistant span runs from the start of its content through the
  end-of-turn special token that follows it (optionally after whitespace the template puts
  between them): ``<|eot_id|>``, ``<|im_end|>``, the EOS token. That token is what the policy
  generated to stop. Text after it (ChatML's ``\\n`` before the next header) is template glue
  the policy never generates, so it is not masked. No end-of-turn token right after the
  content is an error.
- **Straddling tokens.** A token is masked iff its character range overlaps an assistant
  span. A token that merges template glue with the first characters of the content (e.g. a
  Llama-3-style ``\\s*[\\r\\n]+`` pre-token joining the header's ``\\n`` with content that
  starts with ``\\n``) is therefore masked: every content character is covered, and the extra
  characters are template glue, never another message's content.
- **Empty assistant turns** mask only their closing token(s): the policy emitted just that.
- System, user and tool content, role headers and injected template text are never masked.
- **Reasoning.** RL engines hand back a reasoning model's output with its reasoning inline,
  ``<think>…</think>answer`` (the text the policy wrote). Templates that read reasoning from a
  field of the message (Qwen3's ``reasoning_content``, GPT-OSS's ``thinking``) get it there,
  the answer in ``content``; templates that read neither get the content as it is and, if
  they rewrite it (DeepSeek-V3.1 keeps only what follows ``</think>``), what they keep.
  Reasoning tokens are trained wherever the template renders them (in RL most generated
  tokens are reasoning, and the drafter must draft them): the turn's span then starts where
  the generation prompt ends (``<think>``, ``<|channel|>analysis``…), as the policy wrote it
  all. Where the template drops them (earlier turns of Qwen3 and GPT-OSS histories, every
  DeepSeek-V3.1 turn) they are not in the sample; send exact ids to train them there.
  A turn without reasoning masks from its content: an empty think block the template adds
  (thinking off) is template text.

Offsets must be exact (``trim_offsets=False`` for byte-level BPE): tokens must cover the text
without gaps, else masks would silently drop whitespace tokens; this is checked.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np
from transformers import PreTrainedTokenizerFast

Message = Mapping[str, str]
Span = tuple[int, int]

# Special tokens that close a turn in common chat formats; used when present in the vocab.
KNOWN_END_OF_TURN: tuple[str, ...] = (
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|return|>",
    "<|call|>")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REASONING_FIELDS = ("reasoning_content", "thinking")  # Qwen3, GPT-OSS
_SENTINEL_BASE = 0xF0000  # Supplementary Private Use Area-A: absent from real text


class ChatMaskError(ValueError):
    """A conversation cannot be masked exactly; names the sample and the message index.

    ``kind`` is a stable reason class for counting: ``render_failed``, ``content_not_found``,
    ``content_altered``, ``out_of_order``, ``no_end_of_turn`` or ``inexact_offsets``.
    """

    def __init__(self, sample_id: str, message_index: int | None, kind: str, detail: str):
        where = f"sample {sample_id!r}" + (
            f", message {message_index}" if message_index is not None else "")
        super().__init__(f"{where}: {detail}")
        self.sample_id, self.message_index, self.kind = sample_id, message_index, kind


def end_of_turn_tokens(tokenizer: PreTrainedTokenizerFast) -> tuple[str, ...]:
    """The special tokens that may close an assistant turn: EOS plus known turn closers."""
    specials = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    found = [t for t in KNOWN_END_OF_TURN if t in specials]
    if tokenizer.eos_token and tokenizer.eos_token not in found:
        found.append(tokenizer.eos_token)
    return tuple(found)


def render(tokenizer: PreTrainedTokenizerFast, messages: Sequence[Message], *,
           sample_id: str = "?", add_generation_prompt: bool = False) -> str:
    """The conversation as the chat template renders it (a :class:`ChatMaskError` if not)."""
    try:
        text = tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False,
            add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja errors, raise_exception() in templates, no template
        raise ChatMaskError(sample_id, None, "render_failed",
                            f"chat template failed: {type(e).__name__}: {e}") from e
    if not isinstance(text, str):
        raise ChatMaskError(sample_id, None, "render_failed",
                            f"chat template returned {type(text).__name__}, not text")
    return text


def _sentinel(text: str) -> str:
    code = _SENTINEL_BASE
    while chr(code) in text:
        code += 1
    return chr(code)


def split_reasoning(content: str) -> tuple[str, str] | None:
    """``(reasoning, answer)`` of ``<think>reasoning</think>answer``, or None without a
    closing tag. As the templates do: text before the opening tag is dropped and newlines
    around the reasoning are stripped; the answer is kept as it is (templates trim it
    themselves, or not)."""
    head, sep, answer = content.partition(THINK_CLOSE)
    return (head.split(THINK_OPEN)[-1].strip("\n"), answer) if sep else None


def reasoning_field(tokenizer: PreTrainedTokenizerFast) -> str | None:
    """The message field the chat template reads reasoning from, if any."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return None
    return next((f for f in REASONING_FIELDS if f"message.{f}" in template
                 or f"'{f}' in message" in template or f'"{f}" in message' in template), None)


def _as_template_reads(messages: Sequence[Message], field: str | None, *,
                       answers_only: bool = False) -> list[dict[str, str]]:
    """Assistant reasoning moved to ``field`` (or dropped, ``answers_only``)."""
    out = []
    for m in messages:
        parts = split_reasoning(m["content"]) if m["role"] == "assistant" else None
        if parts is not None and field is not None:  # as Qwen3 splits inline reasoning
            m = {**m, "content": parts[1].lstrip("\n"), field: parts[0]}
        elif parts is not None and answers_only:
            m = {**m, "content": parts[1]}
        out.append(dict(m))
    return out


def _locate(tokenizer: PreTrainedTokenizerFast, messages: Sequence[Message], index: int,
            key: str, text: str, sample_id: str) -> Span | None:
    """Where ``messages[index][key]`` sits in ``text`` (the full rendering); None when the
    template does not render it."""
    sentinel = _sentinel(text)
    probe = [dict(m) for m in messages]
    probe[index][key] = sentinel
    marked = render(tokenizer, probe, sample_id=sample_id)
    first, last = marked.find(sentinel), marked.rfind(sentinel)
    if first < 0:
        return None
    after = len(marked) - last - 1  # characters the template emits after the content
    start, end = first, len(text) - after
    if (last != first or end < start or marked[:first] != text[:start]
            or marked[last + 1:] != text[end:]):
        raise ChatMaskError(sample_id, index, "content_not_found",
                            f"the template renders this assistant {key} more than once "
                            "or depends on it; its place in the text is ambiguous")
    value = messages[index][key]
    found = text[start:end]
    if found not in value or found.strip() != value.strip():  # only edge whitespace trimmed
        raise ChatMaskError(sample_id, index, "content_altered",
                            f"the template altered the assistant {key}: rendered "
                            f"{found[:60]!r}, message has {value[:60]!r}")
    return start, end


def _turn_start(tokenizer: PreTrainedTokenizerFast, messages: Sequence[Message], index: int,
                text: str, reasoning_start: int, sample_id: str) -> int:
    """Where a turn with rendered reasoning begins: the end of its generation prompt."""
    prompt = render(tokenizer, messages[:index], sample_id=sample_id,
                    add_generation_prompt=True)
    if not text.startswith(prompt) or len(prompt) > reasoning_start:
        raise ChatMaskError(sample_id, index, "content_not_found",
                            "the generation prompt is not where this turn's reasoning begins")
    return len(prompt)


def _closing_pattern(tokens: Sequence[str]) -> re.Pattern[str]:
    if not tokens:
        raise ValueError("no end-of-turn tokens: the tokenizer has no EOS token; "
                         "configure end_of_turn_tokens")
    alternatives = "|".join(re.escape(t) for t in sorted(set(tokens), key=len, reverse=True))
    return re.compile(rf"\s*(?:{alternatives})")


def render_with_spans(tokenizer: PreTrainedTokenizerFast, messages: Sequence[Message], *,
                      sample_id: str = "?",
                      end_of_turn: Sequence[str] | None = None) -> tuple[str, list[Span]]:
    """The rendered conversation and the character spans to mask, in order.

    Each span covers one assistant turn as the policy wrote it: its content as rendered
    (and its reasoning, where the template renders it) plus its closing token(s).
    """
    closing = _closing_pattern(end_of_turn or end_of_turn_tokens(tokenizer))
    field = reasoning_field(tokenizer)
    try:
        return _spans(tokenizer, _as_template_reads(messages, field), field, closing,
                      sample_id)
    except ChatMaskError as e:
        if field is not None or e.kind not in ("content_altered", "content_not_found"):
            raise
        # A template that reads no reasoning field but drops inline reasoning itself
        # (DeepSeek-V3.1): masked as it renders, provided the answers alone render to the
        # very same text; anything else is the original error.
        answers = _as_template_reads(messages, None, answers_only=True)
        if answers == [dict(m) for m in messages] or render(
                tokenizer, answers, sample_id=sample_id) != render(
                tokenizer, messages, sample_id=sample_id):
            raise
    return _spans(tokenizer, answers, None, closing, sample_id)


def _spans(tokenizer: PreTrainedTokenizerFast, messages: Sequence[Message],
           field: str | None, closing: re.Pattern[str], sample_id: str
           ) -> tuple[str, list[Span]]:
    text = render(tokenizer, messages, sample_id=sample_id)
    spans: list[Span] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        located = _locate(tokenizer, messages, i, "content", text, sample_id)
        if located is None:
            raise ChatMaskError(sample_id, i, "content_not_found",
                                "the chat template does not render this assistant message")
        start, end = located
        reasoning = (_locate(tokenizer, messages, i, field, text, sample_id)
                     if field is not None and field in message else None)
        if reasoning is not None:
            start = _turn_start(tokenizer, messages, i, text, reasoning[0], sample_id)
        if spans and start < spans[-1][1]:
            raise ChatMaskError(sample_id, i, "out_of_order",
                                "assistant content rendered before the previous turn's end")
        close = closing.match(text, end)
        if close is None:
            raise ChatMaskError(sample_id, i, "no_end_of_turn",
                                f"no end-of-turn token closes the assistant turn; the "
                                f"template continues with {text[end:end + 40]!r}")
        spans.append((start, close.end()))
    return text, spans


def mask_from_offsets(offsets: Sequence[tuple[int, int]] | np.ndarray,
                      spans: Sequence[Span]) -> list[int]:
    """1 for every token whose ``[start, end)`` overlaps a span, else 0.

    ``spans`` are sorted and disjoint. A zero-width token counts as covering the character
    at its start.
    """
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)  # (T, 2)
    if not len(spans):
        return [0] * len(off)
    bounds = np.asarray(spans, dtype=np.int64)  # (S, 2)
    starts, ends = off[:, 0], np.maximum(off[:, 1], off[:, 0] + 1)
    j = np.searchsorted(bounds[:, 1], starts, side="right")  # first span ending after start
    inside = j < len(bounds)
    hit = inside & (ends > bounds[np.minimum(j, len(bounds) - 1), 0])
    return hit.astype(np.int64).tolist()


def check_offsets(text: str, offsets: Sequence[tuple[int, int]] | np.ndarray,
                  sample_id: str = "?") -> None:
    """Tokens must cover ``text`` without gaps (trimmed offsets would hide whitespace)."""
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)  # (T, 2)
    if not len(off):
        off = np.zeros((1, 2), np.int64)  # an empty text needs no tokens
    covered = np.maximum.accumulate(off[:, 1])  # (T,) end of the text covered so far
    gaps = np.flatnonzero(off[1:, 0] > covered[:-1])
    if off[0, 0] > 0:
        near = 0
    elif len(gaps):
        near = int(covered[gaps[0]])
    elif covered[-1] != len(text) or (off[:, 1] < off[:, 0]).any():
        near = int(covered[-1])
    else:
        return
    raise ChatMaskError(sample_id, None, "inexact_offsets",
                        f"token offsets leave text uncovered near character {near}; "
                        "the tokenizer must report exact offsets (trim_offsets=False)")


def encode_chat(tokenizer: PreTrainedTokenizerFast, messages: Sequence[Message], *,
                sample_id: str = "?",
                end_of_turn: Sequence[str] | None = None) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of a conversation rendered with the chat template."""
    text, spans = render_with_spans(tokenizer, messages, sample_id=sample_id,
                                    end_of_turn=end_of_turn)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    check_offsets(text, offsets, sample_id)
    return list(enc["input_ids"]), mask_from_offsets(offsets, spans)


def encode_prompt(tokenizer: PreTrainedTokenizerFast, messages: Sequence[Message], *,
                  sample_id: str = "?") -> list[int]:
    """Ids of the prompt the policy is asked to continue (with the generation prompt)."""
    text = render(tokenizer, messages, sample_id=sample_id, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
