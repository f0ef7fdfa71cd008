"""The tokenization tests' templates against their plain-Python oracles
(tests/tokenize/chat_tokenizers.py), so the other tests can trust the oracles."""

from __future__ import annotations

import pytest

from pipeline.tokenize.chat_masks import end_of_turn_tokens, render_with_spans
from tests.tokenize.chat_tokenizers import (
    ORACLES,
    SAMPLE,
    TOKENIZERS,
    chatml_think_tokenizer,
    chatml_tokenizer,
    llama3_tokenizer,
)


@pytest.mark.parametrize("name", sorted(ORACLES))
def test_templates_render_as_their_oracles_say(name):
    tokenizer = TOKENIZERS[name]()
    for messages in (SAMPLE, SAMPLE[1:3], SAMPLE[1:]):
        text, masked, _ = ORACLES[name](messages)
        assert render_with_spans(tokenizer, messages) == (text, masked)


def test_end_of_turn_tokens_are_detected_from_the_vocab():
    assert end_of_turn_tokens(llama3_tokenizer()) == ("<|eot_id|>", "<|end_of_text|>")
    assert end_of_turn_tokens(chatml_tokenizer()) == ("<|im_end|>",)
    assert "</think>" not in end_of_turn_tokens(chatml_think_tokenizer())  # not special
