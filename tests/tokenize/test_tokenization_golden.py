"""Golden loss masks per chat template: Llama-3-style, ChatML, ChatML + thinking, the demo's,
and the published templates of Qwen3, Llama-3.1, DeepSeek-V3.1 and GPT-OSS (harmony).

Two independent pins per conversation:
- ``EXPECTED_MASKED``: the masked text, written by hand here (one string per contiguous
  masked run, decoded): exactly the assistant contents and their closing tokens;
- ``golden/tokenization_<template>.json``: input_ids, tokens and loss_mask (``view`` shows
  the tokens with masked ones in brackets), reviewed by hand once and pinned. After an
  intended change regenerate them with ``python -m tests.tokenize.test_tokenization_golden``
  and review the diff. The demo's file pins the demo tokenizer too: retraining it (corpus,
  vocab) changes the ids but must not change ``masked_text``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.tokenize.chat_masks import ChatMaskError, encode_chat, render_with_spans
from tests.tokenize.chat_tokenizers import TOKENIZERS, chatml_tokenizer, llama3_tokenizer

GOLDEN = Path(__file__).parent / "golden"

CAFE = "cafe\u0301"  # 'e' + COMBINING ACUTE ACCENT
CONVERSATIONS: dict[str, list[dict[str, str]]] = {
    "single_turn": [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "2 + 3 = 5."}],
    "system_multi_turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Add 10 and 32."},
        {"role": "assistant", "content": "42"}],
    "tool_call": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": 'call get_weather("Paris")'},
        {"role": "tool", "content": '{"temp_c": 18}'},
        {"role": "assistant", "content": "It is 18 °C in Paris."}],
    "unicode": [
        {"role": "user", "content": "¿Qué es 東京? 🙂"},
        {"role": "assistant", "content": f"東京は日本の首都です 🗼 — {CAFE} ✓"}],
    "empty_assistant_turn": [
        {"role": "user", "content": "Say nothing."},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "Now say ok."},
        {"role": "assistant", "content": "ok"}],
    "leading_newlines": [
        {"role": "user", "content": "Indent it."},
        {"role": "assistant", "content": "\n\nindented\n"}],
    # reasoning inline, as RL engines return a thinking model's text
    "think_single": [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "<think>\nAdd two and three.\n</think>\n\n2 + 3 = 5."}],
    "think_multi": [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello!"},
        {"role": "user", "content": "Add 10 and 32."},
        {"role": "assistant", "content": "<think>\n10 + 32 = 42.\n</think>\n\n42"}],
}
# GPT-OSS's template refuses a tool message without a structured tool call before it (text
# records carry none): such records are quarantined as render_failed (tested below).
UNRENDERABLE = {("gpt_oss", "tool_call")}

EOT, IM_END, EOS_DS = "<|eot_id|>", "<|im_end|>", "<｜end▁of▁sentence｜>"
END, RETURN = "<|end|>", "<|return|>"  # GPT-OSS: an earlier turn ends, the last one returns
_COMMON = {
    "single_turn": ["2 + 3 = 5.{}"],
    "system_multi_turn": ["Hello! How can I help?{}", "42{}"],
    "tool_call": ['call get_weather("Paris"){}', "It is 18 °C in Paris.{}"],
    "unicode": [f"東京は日本の首都です 🗼 — {CAFE} ✓{{}}"],
    "empty_assistant_turn": ["{}", "ok{}"],  # an empty turn masks only its closing token
    # templates that read no reasoning and keep the content: reasoning trained as written
    "think_single": ["<think>\nAdd two and three.\n</think>\n\n2 + 3 = 5.{}"],
    "think_multi": ["<think>\nGreet back.\n</think>\n\nHello!{}",
                    "<think>\n10 + 32 = 42.\n</think>\n\n42{}"],
}


def _closed(eot: str, last: str | None = None) -> dict[str, list[str]]:
    """``_COMMON`` closed by ``eot``, the conversation's last turn by ``last``."""
    out = {}
    for name, runs in _COMMON.items():
        ends = [eot] * (len(runs) - 1) + [last or eot]
        out[name] = [s.format(e) for s, e in zip(runs, ends, strict=True)]
    return out


EXPECTED_MASKED: dict[str, dict[str, list[str]]] = {
    # The Llama-3 template trims content: the masked text is the trimmed content.
    "llama3": _closed(EOT) | {"leading_newlines": [f"indented{EOT}"]},
    # ChatML's header ends in "\n"; the Llama-3 regex joins it with the content's first "\n"
    # into one token ("ĊĊ"), which straddles the boundary and is masked (one glue "\n").
    "chatml": _closed(IM_END) | {"leading_newlines": [f"\n\n\nindented\n{IM_END}"]},
    # Injected "<think>\n\n</think>\n\n" is template text, never masked; here the split
    # falls on the boundary ("ĊĊ" glue, then "ĊĊ" content).
    "chatml_think": _closed(IM_END) | {"leading_newlines": [f"\n\nindented\n{IM_END}"]},
    # The demo's GPT-2-style regex keeps each "\n" apart: no straddle.
    "demo": _closed(EOT) | {"leading_newlines": [f"\n\nindented\n{EOT}"]},
    # Published templates. Qwen3 reads reasoning_content: the last turn's reasoning is
    # rendered and trained from <think> on (the policy wrote it after the generation
    # prompt); an earlier turn's is dropped from the history; content is lstrip('\n')-ed.
    "qwen3": _closed(IM_END) | {
        "leading_newlines": [f"indented\n{IM_END}"],
        "think_single": [f"<think>\nAdd two and three.\n</think>\n\n2 + 3 = 5.{IM_END}"],
        "think_multi": [f"Hello!{IM_END}", f"<think>\n10 + 32 = 42.\n</think>\n\n42{IM_END}"]},
    # Llama-3.1 trims contents and reads no reasoning: inline reasoning is kept and trained.
    "llama3_1": _closed(EOT) | {"leading_newlines": [f"indented{EOT}"]},
    # DeepSeek-V3.1 keeps only what follows </think>, in every turn: reasoning not trained.
    "deepseek_v3_1": _closed(EOS_DS) | {
        "leading_newlines": [f"\n\nindented\n{EOS_DS}"],
        "think_single": [f"\n\n2 + 3 = 5.{EOS_DS}"],
        "think_multi": [f"\n\nHello!{EOS_DS}", f"\n\n42{EOS_DS}"]},
    # GPT-OSS reads `thinking`: the last turn's analysis channel is trained with its final
    # answer, from the channel header the policy wrote after "<|start|>assistant".
    "gpt_oss": _closed(END, RETURN) | {
        "leading_newlines": [f"\n\nindented\n{RETURN}"],
        "think_single": ["<|channel|>analysis<|message|>Add two and three.<|end|><|start|>"
                         f"assistant<|channel|>final<|message|>2 + 3 = 5.{RETURN}"],
        "think_multi": [f"Hello!{END}", "<|channel|>analysis<|message|>10 + 32 = 42.<|end|>"
                        f"<|start|>assistant<|channel|>final<|message|>42{RETURN}"]},
}


def masked_runs(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    """The decoded text of each maximal run of masked tokens."""
    runs, current = [], []
    for tok, m in zip(ids, mask, strict=True):
        if m:
            current.append(tok)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(r, skip_special_tokens=False) for r in runs]


def golden_entry(tokenizer, messages) -> dict:
    ids, mask = encode_chat(tokenizer, messages)
    text, _ = render_with_spans(tokenizer, messages)
    tokens = tokenizer.convert_ids_to_tokens(ids)
    view = " ".join(f"[{t}]" if m else t for t, m in zip(tokens, mask, strict=True))
    return {"messages": messages, "rendered": text, "view": view, "input_ids": ids,
            "tokens": tokens, "loss_mask": mask,
            "masked_text": masked_runs(tokenizer, ids, mask)}


def dump_golden(entries: dict[str, dict]) -> str:
    """JSON with one line per field, so that a review reads one conversation per screen."""
    blocks = []
    for name, entry in sorted(entries.items()):
        fields = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}"
                            for k, v in entry.items())
        blocks.append(f" {json.dumps(name)}: {{\n{fields}\n }}")
    return "{\n" + ",\n".join(blocks) + "\n}\n"


def golden_path(template: str) -> Path:
    return GOLDEN / f"tokenization_{template}.json"


CASES = [(t, c) for t in sorted(TOKENIZERS) for c in sorted(CONVERSATIONS)
         if (t, c) not in UNRENDERABLE]


@pytest.mark.parametrize(("template", "conversation"), CASES)
def test_masked_text_is_exactly_the_assistant_turns(template, conversation):
    tokenizer = TOKENIZERS[template]()
    ids, mask = encode_chat(tokenizer, CONVERSATIONS[conversation])
    assert masked_runs(tokenizer, ids, mask) == EXPECTED_MASKED[template][conversation]


@pytest.mark.parametrize(("template", "conversation"), CASES)
def test_ids_and_masks_match_the_golden_file(template, conversation):
    tokenizer = TOKENIZERS[template]()
    golden = json.loads(golden_path(template).read_text(encoding="utf-8"))
    assert golden_entry(tokenizer, CONVERSATIONS[conversation]) == golden[conversation]


def test_golden_files_hold_every_conversation_and_the_hand_checked_masks():
    for template in TOKENIZERS:
        golden = json.loads(golden_path(template).read_text(encoding="utf-8"))
        assert sorted(golden) == sorted(c for c in CONVERSATIONS
                                        if (template, c) not in UNRENDERABLE)
        for name, entry in golden.items():
            assert entry["masked_text"] == EXPECTED_MASKED[template][name]
            assert len(entry["input_ids"]) == len(entry["loss_mask"]) == len(entry["tokens"])


# -- templates the masker must refuse, naming the sample and the message ------------------
def _with_template(base, template: str):
    tok = base().__class__(tokenizer_object=base().backend_tokenizer,
                           eos_token=base().eos_token, chat_template=template)
    return tok


@pytest.mark.parametrize(("template", "kind", "index"), [
    ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
     "{{ m['content'] | upper }}<|im_end|>\n{% endfor %}", "content_altered", 2),
    ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
     "{% if m['role'] == 'assistant' %} (said: {{ m['content'] }}){% endif %}"
     "<|im_end|>\n{% endfor %}", "content_not_found", 2),
    ("{% for m in messages %}{% if m['role'] != 'assistant' %}<|im_start|>{{ m['role'] }}\n"
     "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}", "content_not_found", 2),
    ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}\n"
     "{% endfor %}", "no_end_of_turn", 2),
    ("{{ raise_exception('no') }}", "render_failed", None),
])
def test_unlocatable_assistant_content_is_an_error_naming_sample_and_message(
        template, kind, index):
    tokenizer = _with_template(chatml_tokenizer, template)
    with pytest.raises(ChatMaskError) as err:
        encode_chat(tokenizer, CONVERSATIONS["system_multi_turn"], sample_id="r-7")
    assert err.value.kind == kind and err.value.message_index == index
    assert "sample 'r-7'" in str(err.value)
    if index is not None:
        assert f"message {index}" in str(err.value)


@pytest.mark.parametrize(("template", "conversation"), sorted(UNRENDERABLE))
def test_a_conversation_the_template_refuses_is_an_error_naming_the_sample(
        template, conversation):
    with pytest.raises(ChatMaskError) as err:
        encode_chat(TOKENIZERS[template](), CONVERSATIONS[conversation], sample_id="r-9")
    assert err.value.kind == "render_failed" and "sample 'r-9'" in str(err.value)


def test_trimmed_offsets_are_refused():
    base = llama3_tokenizer()
    backend = base.backend_tokenizer.__class__.from_str(base.backend_tokenizer.to_str())
    from tokenizers import processors

    backend.post_processor = processors.ByteLevel(trim_offsets=True)
    tokenizer = base.__class__(tokenizer_object=backend, eos_token="<|end_of_text|>",
                               bos_token="<|begin_of_text|>", chat_template=base.chat_template)
    with pytest.raises(ChatMaskError, match="exact offsets") as err:
        encode_chat(tokenizer, CONVERSATIONS["system_multi_turn"], sample_id="r-1")
    assert err.value.kind == "inexact_offsets"


def regenerate() -> None:
    GOLDEN.mkdir(exist_ok=True)
    for template, build in sorted(TOKENIZERS.items()):
        tokenizer = build()
        entries = {name: golden_entry(tokenizer, messages)
                   for name, messages in CONVERSATIONS.items()
                   if (template, name) not in UNRENDERABLE}
        golden_path(template).write_text(dump_golden(entries), encoding="utf-8")


if __name__ == "__main__":
    regenerate()


def test_reasoning_is_never_dropped_where_the_template_renders_it():
    """A template without a reasoning field that drops inline reasoning from earlier turns
    only: masking the answers alone would lose the last turn's reasoning, so the sample is
    refused (quarantined with its reason), not silently cut."""
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                "{% set c = m['content'] %}{% if not loop.last and '</think>' in c %}"
                "{% set c = c.split('</think>')[1] %}{% endif %}{{ c }}<|im_end|>\n"
                "{% endfor %}")
    tokenizer = _with_template(chatml_tokenizer, template)
    with pytest.raises(ChatMaskError) as err:
        encode_chat(tokenizer, CONVERSATIONS["think_multi"], sample_id="r-3")
    assert err.value.kind == "content_altered" and err.value.message_index == 1
