"""Property: on random conversations, the mask covers exactly the assistant turns.

Ground truth comes from the plain-Python oracles in ``chat_tokenizers``, not
from the code under test: the masked characters must cover every assistant content
character and its closing token, nothing of system/user/tool content, and the decoded
masked text must be the assistant contents plus closing tokens (plus, only where a token
straddles the boundary, whitespace the template put right before the content).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.tokenize.chat_masks import encode_chat, render_with_spans
from tests.tokenize.chat_tokenizers import ORACLES, TOKENIZERS

_SPECIAL_TEXT = ("<|", "|>", "<think>", "</think>", "<tool_response>", "</tool_response>")
_EXOTIC = "東京日本語한국어🙂🗼👩‍💻é\u0301\u0308ñ—✓\u200d\U000f0000 \n\t"

text = st.text(
    alphabet=st.one_of(st.characters(blacklist_categories=("Cs",)),
                       st.sampled_from(_EXOTIC)),
    max_size=24,
).filter(lambda s: not any(m in s for m in _SPECIAL_TEXT))
# Leading/trailing newlines and spaces are where headers and content can share a token.
padded = st.builds(lambda a, t, b: a + t + b, st.sampled_from(["", "", "\n", "\n\n", " "]),
                   text, st.sampled_from(["", "", "\n", " "]))
message = st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": padded})
conversation = st.lists(message, min_size=1, max_size=6).filter(
    lambda ms: any(m["role"] == "assistant" for m in ms))


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _check(name: str, messages: list[dict]) -> None:
    tokenizer = TOKENIZERS[name]()
    text_, must, never = ORACLES[name](messages)
    assert render_with_spans(tokenizer, messages) == (text_, must)
    ids, mask = encode_chat(tokenizer, messages)
    offsets = tokenizer(text_, add_special_tokens=False,
                        return_offsets_mapping=True)["offset_mapping"]
    assert ids == tokenizer(text_, add_special_tokens=False)["input_ids"]

    masked_chars = set()
    for (s, e), m in zip(offsets, mask, strict=True):
        overlaps = any(s < b and e > a for a, b in must)
        assert m == int(overlaps)  # the straddling rule: any overlap masks the token
        if m:
            masked_chars.update(range(s, e))
    for a, b in must:  # completeness: every assistant character is masked
        assert masked_chars.issuperset(range(a, b))
    for a, b in never:  # safety: no system/user/tool character is ever masked
        assert masked_chars.isdisjoint(range(a, b))

    runs = _runs(mask)
    assert len(runs) == len(must)  # one masked run per assistant turn
    decoded, expected = [], []
    for (i, j), (a, b) in zip(runs, must, strict=True):
        start, end = offsets[i][0], offsets[j - 1][1]
        assert end == b and start <= a
        assert text_[start:a].isspace() or start == a  # straddle: template whitespace only
        decoded.append(tokenizer.decode(ids[i:j], skip_special_tokens=False))
        expected.append(text_[start:b])
    assert "".join(decoded) == "".join(expected)
    if all(text_[a:a + 1] == "" or not text_[a].isspace() for a, _ in must):
        assert "".join(decoded) == "".join(text_[a:b] for a, b in must)


@settings(max_examples=80, deadline=None)
@given(conversation)
def test_chatml_masks_exactly_the_assistant_turns(messages):
    _check("chatml", messages)


@settings(max_examples=80, deadline=None)
@given(conversation)
def test_chatml_with_thinking_masks_exactly_the_assistant_turns(messages):
    _check("chatml_think", messages)


@settings(max_examples=80, deadline=None)
@given(conversation)
def test_llama3_masks_exactly_the_assistant_turns(messages):
    _check("llama3", messages)


@settings(max_examples=40, deadline=None)
@given(conversation)
def test_demo_template_masks_exactly_the_assistant_turns(messages):
    _check("demo", messages)
