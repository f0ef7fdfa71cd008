"""Chat templates and small tokenizers for the tokenization tests, plus plain-Python oracles.

Each template is written here as Jinja; each oracle renders the same conversation by string
concatenation and returns the character spans that must be masked (assistant content as
rendered + the closing token) and those that must never be (system/user/tool content).
``test_tokenization_templates.py`` checks that templates and oracles agree, so the other
tests can trust the oracles as independent ground truth.
"""

from __future__ import annotations

import functools
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AddedToken, PreTrainedTokenizerFast

# The pre-tokenizer regex of Llama-3 (Qwen2 uses the same shape): `\s*[\r\n]+` can join a
# header's newline with newlines that start the content, which the straddling rule handles.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

DEFAULT_SYSTEM = "You are a helpful assistant."
CHATML_TEMPLATE = (  # Qwen2.5-style: a default system prompt is injected when none is given
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

THINK = "<think>\n\n</think>\n\n"
CHATML_THINK_TEMPLATE = (  # Qwen3-style: empty thinking injected after the last user turn
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_user %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content']"
    " + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n" + "<think>\\n\\n</think>\\n\\n"
    "' }}{%- endif %}"
)

CORPUS = [
    "What is 2 + 3?\n\nThe answer is 5.",
    "Hello! How can I help you today?\n\nI can add numbers and check the weather.",
    "system user assistant tool",
    "The weather in Paris is mild; it is 18 degrees.\n\nIndented text follows.\n\n",
    "Be brief. Say nothing. Now say ok.",
] * 8


def _bpe(specials: list[str], vocab_size: int = 420) -> Tokenizer:
    """A byte-level BPE with the Llama-3 split regex and exact offsets."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator(CORPUS, trainer=trainer)
    return bpe


@functools.cache
def llama3_tokenizer() -> PreTrainedTokenizerFast:
    """EOS is ``<|end_of_text|>`` as in the base model: turns close with ``<|eot_id|>``."""
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>"]
    return PreTrainedTokenizerFast(
        tokenizer_object=_bpe(specials), bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>", pad_token="<|end_of_text|>",
        chat_template=LLAMA3_TEMPLATE, clean_up_tokenization_spaces=False)


def _chatml(template: str) -> PreTrainedTokenizerFast:
    tok = PreTrainedTokenizerFast(
        tokenizer_object=_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]),
        eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=template,
        clean_up_tokenization_spaces=False)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (
        "<think>", "</think>", "<tool_response>", "</tool_response>")])
    return tok


@functools.cache
def chatml_tokenizer() -> PreTrainedTokenizerFast:
    return _chatml(CHATML_TEMPLATE)


@functools.cache
def chatml_think_tokenizer() -> PreTrainedTokenizerFast:
    return _chatml(CHATML_THINK_TEMPLATE)


@functools.cache
def demo_tokenizer() -> PreTrainedTokenizerFast:
    """The demo world's tokenizer and chat template (small training run, same code)."""
    from pipeline.demo import tokenizer as demo

    return demo.train_tokenizer(vocab_size=512, task_examples=200, filler=500)


PUBLISHED = Path(__file__).parent / "templates"
PINNED_DATE = '"2025-08-05"'  # GPT-OSS's strftime_now("%Y-%m-%d"), see templates/README.md


def published_template(name: str) -> str:
    text = (PUBLISHED / f"{name}.jinja").read_text(encoding="utf-8")
    return text.replace('strftime_now("%Y-%m-%d")', PINNED_DATE)


def _published(name: str, specials: list[str], *, eos: str, bos: str | None = None,
               inline: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """A small BPE with the family's special tokens and its published chat template;
    ``inline``: tokens the family adds as plain (non-special) tokens."""
    tok = PreTrainedTokenizerFast(
        tokenizer_object=_bpe(specials), eos_token=eos, bos_token=bos,
        chat_template=published_template(name), clean_up_tokenization_spaces=False)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in inline])
    return tok


@functools.cache
def qwen3_tokenizer() -> PreTrainedTokenizerFast:
    return _published("qwen3", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                      eos="<|im_end|>", inline=("<think>", "</think>", "<tool_response>",
                                                "</tool_response>"))


@functools.cache
def llama3_1_tokenizer() -> PreTrainedTokenizerFast:
    return _published("llama3_1", [
        "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
        "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
        eos="<|end_of_text|>", bos="<|begin_of_text|>")


@functools.cache
def deepseek_v3_1_tokenizer() -> PreTrainedTokenizerFast:
    return _published("deepseek_v3_1", [
        "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
        "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
        "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>",
        "<｜tool▁output▁end｜>"],
        eos="<｜end▁of▁sentence｜>", bos="<｜begin▁of▁sentence｜>",
        inline=("<think>", "</think>"))


@functools.cache
def gpt_oss_tokenizer() -> PreTrainedTokenizerFast:
    return _published("gpt_oss", [
        "<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>",
        "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>"], eos="<|return|>")


TOKENIZERS = {
    "llama3": llama3_tokenizer,
    "chatml": chatml_tokenizer,
    "chatml_think": chatml_think_tokenizer,
    "demo": demo_tokenizer,
    "qwen3": qwen3_tokenizer,
    "llama3_1": llama3_1_tokenizer,
    "deepseek_v3_1": deepseek_v3_1_tokenizer,
    "gpt_oss": gpt_oss_tokenizer,
}
PUBLISHED_TEMPLATES = ("qwen3", "llama3_1", "deepseek_v3_1", "gpt_oss")


# -- oracles: (text, must-mask spans, never-mask spans) ----------------------------------
Oracle = tuple[str, list[tuple[int, int]], list[tuple[int, int]]]


class _Builder:
    def __init__(self) -> None:
        self.text, self.masked, self.forbidden = "", [], []

    def glue(self, s: str) -> None:
        self.text += s

    def content(self, s: str, assistant: bool, closing: str) -> None:
        start = len(self.text)
        self.text += s
        if assistant:
            self.masked.append((start, len(self.text) + len(closing)))
        elif s:
            self.forbidden.append((start, len(self.text)))
        self.text += closing

    def result(self) -> Oracle:
        return self.text, self.masked, self.forbidden


def oracle_llama3(messages: list[dict]) -> Oracle:
    b = _Builder()
    b.glue("<|begin_of_text|>")
    for m in messages:
        b.glue(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n")
        b.content(m["content"].strip(), m["role"] == "assistant", "<|eot_id|>")
    return b.result()


def oracle_chatml(messages: list[dict]) -> Oracle:
    b = _Builder()
    if messages[0]["role"] != "system":
        b.glue(f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n")
    for m in messages:
        b.glue(f"<|im_start|>{m['role']}\n")
        b.content(m["content"], m["role"] == "assistant", "<|im_end|>")
        b.glue("\n")
    return b.result()


def oracle_chatml_think(messages: list[dict]) -> Oracle:
    b = _Builder()
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            b.glue("<|im_start|>assistant\n" + (THINK if i > last_user else ""))
            b.content(m["content"], True, "<|im_end|>")
            b.glue("\n")
        elif m["role"] == "tool":
            b.glue("<|im_start|>user\n<tool_response>\n")
            b.content(m["content"], False, "")
            b.glue("\n</tool_response><|im_end|>\n")
        else:
            b.glue(f"<|im_start|>{m['role']}\n")
            b.content(m["content"], False, "<|im_end|>")
            b.glue("\n")
    return b.result()


def oracle_demo(messages: list[dict]) -> Oracle:
    b = _Builder()
    b.glue("<|begin_of_text|>")
    for m in messages:
        b.glue(f"<|start_header_id|>{m['role']}<|end_header_id|>\n")
        b.content(m["content"], m["role"] == "assistant", "<|eot_id|>")
    return b.result()


ORACLES = {"llama3": oracle_llama3, "chatml": oracle_chatml,
           "chatml_think": oracle_chatml_think, "demo": oracle_demo}

SAMPLE = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": " Hello "},
    {"role": "tool", "content": "{}"},
    {"role": "assistant", "content": ""},
]
