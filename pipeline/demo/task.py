"""The demo task: chat-format multi-digit addition answered column by column.

Responsible for sampling problems, rendering prompts and answers, and scoring responses.

An answer is a fixed skeleton (one line per column, right to left, then ``Answer: <sum>``)
with many independent *style choice points*: wording, spacing, optional carry notes,
optional restating. Each choice point has a long and a short option; the pretraining
corpus samples the long one with probability ``long_prob`` (0.6 by default), so the
pretrained policy puts real mass on both. The RL reward charges every response token, so RL
flips the brevity-favoured choices: the token distribution drifts while the arithmetic
stays the same.

Invariants: rendering is a pure function of (problem, choices); every rendered answer is
well-formed and correct under :func:`score_response`; all text is ASCII (byte offsets equal
character offsets).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

PROMPT_TEMPLATES: tuple[str, ...] = (
    "What is {a} + {b}?",
    "Compute {a} + {b}.",
    "Add {a} and {b}.",
    "Find the sum of {a} and {b}.",
)
SYSTEM_PROMPTS: tuple[str, ...] = (
    "You are a careful math tutor.",
    "Show your work column by column.",
)

# Choice points made once per answer: name -> long option (short option is "").
GLOBAL_CHOICES: tuple[str, ...] = ("open", "restate", "so", "close")
# Choice points made independently on every column line.
COLUMN_CHOICES: tuple[str, ...] = ("label", "spaces", "zero_carry", "write", "carry", "period")

_OPEN = "Let's add the numbers column by column, from right to left.\n"
_CLOSE = "\nDone."


@dataclass(frozen=True)
class Problem:
    """One addition problem and how its prompt is worded."""

    a: int
    b: int
    template: int = 0
    system: int | None = None

    @property
    def total(self) -> int:
        return self.a + self.b

    @property
    def num_columns(self) -> int:
        return max(len(str(self.a)), len(str(self.b)))


@dataclass(frozen=True)
class Choices:
    """Long (True) / short (False) option for every choice point of one answer."""

    globals_: dict[str, bool]
    columns: tuple[dict[str, bool], ...]

    @property
    def count(self) -> int:
        return len(self.globals_) + sum(len(c) for c in self.columns)


@dataclass(frozen=True)
class Score:
    """Outcome of scoring one response."""

    well_formed: bool
    correct: bool
    answer: int | None
    num_tokens: int
    reward: float


def sample_problem(rng: random.Random, min_digits: int = 2, max_digits: int = 4,
                   system_prob: float = 0.25) -> Problem:
    """Draw operands with ``min_digits..max_digits`` digits each and a prompt wording."""

    def operand() -> int:
        n = rng.randint(min_digits, max_digits)
        return rng.randint(10 ** (n - 1), 10**n - 1)

    a, b = operand(), operand()
    template = rng.randrange(len(PROMPT_TEMPLATES))
    system = rng.randrange(len(SYSTEM_PROMPTS)) if rng.random() < system_prob else None
    return Problem(a=a, b=b, template=template, system=system)


def prompt_messages(problem: Problem) -> list[dict[str, str]]:
    """The chat messages (optional system, then user) that pose ``problem``."""
    messages = []
    if problem.system is not None:
        messages.append({"role": "system", "content": SYSTEM_PROMPTS[problem.system]})
    user = PROMPT_TEMPLATES[problem.template].format(a=problem.a, b=problem.b)
    messages.append({"role": "user", "content": user})
    return messages


def sample_choices(problem: Problem, rng: random.Random, long_prob: float = 0.6) -> Choices:
    """Draw every choice point independently: long option with probability ``long_prob``."""
    globals_ = {name: rng.random() < long_prob for name in GLOBAL_CHOICES}
    columns = tuple(
        {name: rng.random() < long_prob for name in COLUMN_CHOICES}
        for _ in range(problem.num_columns)
    )
    return Choices(globals_=globals_, columns=columns)


def all_choices(problem: Problem, long: bool) -> Choices:
    """Every choice point set to the long (``True``) or the short option."""
    return Choices(
        globals_=dict.fromkeys(GLOBAL_CHOICES, long),
        columns=tuple(dict.fromkeys(COLUMN_CHOICES, long) for _ in range(problem.num_columns)),
    )


def _digit(n: int, k: int) -> int:
    """Digit ``k`` (0 = ones) of ``n``; 0 beyond its length."""
    return (n // 10**k) % 10


def _column_line(k: int, x: int, y: int, carry_in: int, c: dict[str, bool]) -> str:
    terms = [str(x), str(y)]
    if carry_in or c["zero_carry"]:
        terms.append(str(carry_in))
    s = x + y + carry_in
    plus, eq = (" + ", " = ") if c["spaces"] else ("+", "=")
    line = ("Column " if c["label"] else "") + f"{k}: " + plus.join(terms) + eq + str(s)
    if c["write"]:
        line += f", write {s % 10}"
    if c["carry"]:
        line += ", carry 1" if s >= 10 else ", no carry"
    if c["period"]:
        line += "."
    return line + "\n"


def render_answer(problem: Problem, choices: Choices) -> str:
    """The assistant's answer text for ``problem`` under ``choices`` (no end-of-turn token)."""
    g = choices.globals_
    parts = []
    if g["open"]:
        parts.append(_OPEN)
    if g["restate"]:
        parts.append(f"We need {problem.a} + {problem.b}.\n")
    carry = 0
    for k, col in enumerate(choices.columns):
        x, y = _digit(problem.a, k), _digit(problem.b, k)
        parts.append(_column_line(k + 1, x, y, carry, col))
        carry = (x + y + carry) // 10
    if g["so"]:
        parts.append(f"So the sum is {problem.total}.\n")
    parts.append(f"Answer: {problem.total}")
    if g["close"]:
        parts.append(_CLOSE)
    return "".join(parts)


def _column_pattern(k: int) -> str:
    spaced = r"\d \+ \d(?: \+ \d)? = \d{1,2}"
    compact = r"\d\+\d(?:\+\d)?=\d{1,2}"
    return (
        rf"(?:Column )?{k}: (?:{spaced}|{compact})"
        r"(?:, write \d)?(?:, carry 1|, no carry)?\.?\n"
    )


def answer_pattern(problem: Problem) -> re.Pattern[str]:
    """Regex that matches exactly the well-formed answers to ``problem`` (any digits)."""
    columns = "".join(_column_pattern(k + 1) for k in range(problem.num_columns))
    pattern = (
        rf"(?:{re.escape(_OPEN)})?(?:We need \d+ \+ \d+\.\n)?{columns}"
        rf"(?:So the sum is \d+\.\n)?Answer: (\d+)(?:{re.escape(_CLOSE)})?"
    )
    return re.compile(pattern)


def score_response(problem: Problem, text: str, num_tokens: int, stopped: bool = True,
                   length_penalty: float = 0.03) -> Score:
    """Score a response: reward = 1[well-formed and correct] - length_penalty * num_tokens.

    ``text`` is the response without the end-of-turn token; ``num_tokens`` counts the
    response tokens including it; ``stopped`` is False when generation hit the length limit
    (such a response is never well-formed).
    """
    match = answer_pattern(problem).fullmatch(text) if stopped else None
    answer = int(match.group(1)) if match else None
    correct = answer == problem.total
    reward = float(correct) - length_penalty * num_tokens
    return Score(well_formed=match is not None, correct=correct, answer=answer,
                 num_tokens=num_tokens, reward=reward)
