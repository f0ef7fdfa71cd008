"""Tests of the demo tokenizer: exact offsets, single-digit tokens, the chat template."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pipeline.demo import task
from pipeline.demo.tokenizer import EOT, PAD, SPECIAL_TOKENS, filler_sentences, train_tokenizer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerBase:
    return train_tokenizer()  # the default tokenizer: a few seconds


def _conversations() -> list[list[dict[str, str]]]:
    rng = random.Random(7)
    convs = []
    for _ in range(8):
        problem = task.sample_problem(rng, 1, 5, system_prob=0.5)
        answer = task.render_answer(problem, task.sample_choices(problem, rng))
        convs.append([*task.prompt_messages(problem), {"role": "assistant", "content": answer}])
    filler = list(filler_sentences(3, seed=11))
    convs.append([
        {"role": "system", "content": "Tools: calc.  Two  spaces,\ttabs\nand 2024 numbers!"},
        {"role": "user", "content": filler[0]},
        {"role": "assistant", "content": "Calling calc(12 + 30)."},
        {"role": "tool", "content": '{"result": 42}'},
        {"role": "assistant", "content": " leading space, trailing newline\n" + filler[1]},
    ])
    return convs


def test_vocab_size_and_specials(tok: PreTrainedTokenizerBase) -> None:
    assert 1000 <= len(tok) <= 4096
    assert tok.eos_token == EOT and tok.pad_token == PAD
    assert tok.pad_token_id != tok.eos_token_id
    for special in SPECIAL_TOKENS:
        assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1


def test_offsets_tile_the_rendered_text_exactly(tok: PreTrainedTokenizerBase) -> None:
    for messages in _conversations():
        text = tok.apply_chat_template(messages, tokenize=False)
        enc = tok(text, return_offsets_mapping=True, add_special_tokens=False)
        offsets = enc["offset_mapping"]
        assert len(offsets) == len(enc["input_ids"])
        position = 0
        for token_id, (start, end) in zip(enc["input_ids"], offsets, strict=True):
            assert start == position, (start, position)
            assert text[start:end] == tok.decode([token_id])
            position = end
        assert position == len(text)


def test_assistant_content_offsets_bracket_the_message(tok: PreTrainedTokenizerBase) -> None:
    for messages in _conversations():
        text = tok.apply_chat_template(messages, tokenize=False)
        content = messages[-1]["content"]
        start = text.rindex(content)
        enc = tok(text, return_offsets_mapping=True, add_special_tokens=False)
        inside = [t for t, (s, e) in zip(enc["input_ids"], enc["offset_mapping"], strict=True)
                  if s >= start and e <= start + len(content)]
        assert tok.decode(inside) == content


def test_digits_are_single_tokens(tok: PreTrainedTokenizerBase) -> None:
    for token, _ in tok.get_vocab().items():
        text = tok.convert_tokens_to_string([token])
        if any(ch.isdigit() for ch in text):
            assert len(text) == 1, f"merged digit token {text!r}"
    ids = tok("x 12345 + 0987", add_special_tokens=False)["input_ids"]
    pieces = [tok.decode([i]) for i in ids]
    assert [p for p in pieces if p.strip().isdigit()] == list("123450987")


def test_chat_template_round_trip(tok: PreTrainedTokenizerBase) -> None:
    for messages in _conversations():
        text = tok.apply_chat_template(messages, tokenize=False)
        assert text.startswith("<|begin_of_text|><|start_header_id|>")
        assert text.endswith(f"{messages[-1]['content']}{EOT}")
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok(text)["input_ids"] == ids  # the template carries the BOS; none is added
        assert tok.decode(ids) == text
        assert list(tok.apply_chat_template(messages, tokenize=True, return_dict=True)
                    ["input_ids"]) == ids
        for message in messages:
            assert f"<|start_header_id|>{message['role']}<|end_header_id|>\n" in text


def test_generation_prompt_ids_are_a_prefix_of_the_conversation(
        tok: PreTrainedTokenizerBase) -> None:
    for messages in _conversations():
        prompt = tok.apply_chat_template(messages[:-1], tokenize=False,
                                         add_generation_prompt=True)
        assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n")
        full = tok(tok.apply_chat_template(messages, tokenize=False),
                   add_special_tokens=False)["input_ids"]
        prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        assert full[: len(prompt_ids)] == prompt_ids
        assert full[-1] == tok.eos_token_id


def test_unknown_role_is_rejected(tok: PreTrainedTokenizerBase) -> None:
    with pytest.raises(Exception, match="unsupported role"):
        tok.apply_chat_template([{"role": "robot", "content": "hi"}], tokenize=False)


def test_save_and_reload(tok: PreTrainedTokenizerBase, tmp_path) -> None:
    from pipeline.demo.tokenizer import save_tokenizer

    save_tokenizer(tok, str(tmp_path))
    config = (tmp_path / "tokenizer_config.json").read_text()
    assert "chat_template" in config
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    messages = _conversations()[-1]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert loaded.apply_chat_template(messages, tokenize=False) == text
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded.eos_token == EOT and loaded.pad_token == PAD


def test_training_is_deterministic() -> None:
    a = train_tokenizer(vocab_size=600, task_examples=200, filler=500, seed=3)
    b = train_tokenizer(vocab_size=600, task_examples=200, filler=500, seed=3)
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
