"""The demo tokenizer: a byte-level BPE trained in seconds, wrapped as an HF fast tokenizer.

Responsible for the training corpus (task text plus seeded filler prose, so the vocab is a
realistic 1-4k tokens rather than the ~400 the narrow task needs), the BPE itself and the
Llama-3-style chat format.

Invariants the rest of Aerie relies on:
- every digit is its own token (digits are split out before BPE, so they never merge);
- offsets are exact: for every token, ``text[start:end]`` is the token's text, and the
  slices tile the text (ASCII corpus, ``trim_offsets=False``);
- the chat template puts a single ``\\n`` after each header, so the ids of a prompt rendered
  with ``add_generation_prompt=True`` are a prefix of the ids of the full conversation
  (a ``\\n\\n`` would tokenize differently at the end of the text than before content);
- ``<|eot_id|>`` ends every turn and is the EOS token; ``<|pad|>`` pads.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from pipeline.demo import task

BOS = "<|begin_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
PAD = "<|pad|>"
SPECIAL_TOKENS: tuple[str, ...] = (BOS, START_HEADER, END_HEADER, EOT, PAD)
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")

CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('unsupported role: ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n'"
    " + message['content'] + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n' }}"
    "{%- endif %}"
)

_ONSETS = ("b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
           "br", "ch", "cl", "dr", "fl", "gr", "pl", "sh", "st", "th", "tr", "")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou", "y")
_CODAS = ("", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ck", "ng")


def filler_sentences(n: int, seed: int) -> Iterator[str]:
    """Seeded pseudo-English sentences (Zipf-like word frequencies) to widen the vocab."""
    rng = random.Random(seed)
    lexicon = []
    for _ in range(4000):
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                       for _ in range(rng.choice((1, 1, 2, 2, 3))))
        lexicon.append(word)
    weights = [1.0 / (rank + 1) for rank in range(len(lexicon))]
    for _ in range(n):
        words = rng.choices(lexicon, weights=weights, k=rng.randint(4, 14))
        sentence = " ".join(words).capitalize() + rng.choice((".", ".", "?", "!", ";"))
        if rng.random() < 0.3:
            sentence += f" ({rng.randint(0, 9999)})"
        yield sentence


def task_texts(n: int, seed: int, long_prob: float) -> Iterator[str]:
    """Prompts and answers of the task, as plain text (no chat markup)."""
    rng = random.Random(seed)
    for _ in range(n):
        problem = task.sample_problem(rng)
        for message in task.prompt_messages(problem):
            yield message["content"]
        yield task.render_answer(problem, task.sample_choices(problem, rng, long_prob))


def build_bpe(texts: Iterator[str], vocab_size: int) -> Tokenizer:
    """Train the byte-level BPE (digits split individually, exact offsets)."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    return bpe


def wrap(bpe: Tokenizer, model_max_length: int = 1024) -> PreTrainedTokenizerFast:
    """Wrap a trained BPE as an HF fast tokenizer with the chat template and specials."""
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS,
        eos_token=EOT,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
        padding_side="left",
    )


def train_tokenizer(vocab_size: int = 1536, task_examples: int = 4000,
                    filler: int = 20000, seed: int = 0,
                    long_prob: float = 0.6) -> PreTrainedTokenizerFast:
    """Train the demo tokenizer from scratch (deterministic for fixed arguments)."""

    def corpus() -> Iterator[str]:
        yield from task_texts(task_examples, seed, long_prob)
        yield from filler_sentences(filler, seed + 1)
        for _ in range(task_examples):  # role names appear in every chat header
            yield from ROLES

    return wrap(build_bpe(corpus(), vocab_size))


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, directory: str) -> None:
    """Write tokenizer.json and tokenizer_config.json (chat template inside the config)."""
    tokenizer.save_pretrained(directory, save_jinja_files=False)
