"""The demo task: chat-format multi-digit addition answered column by column.

Responsible for sampling problems, rendering prompts and answers, and scoring responses.

An answer has a fixed skeleton: the operands restated zero-padded to the problem's
``width`` (so column k of both numbers sits at the same place), one line per column from
right to left, each ending with the result digits so far (the last one with its carry, so
it is the sum up to leading zeros), then ``Answer: <sum>``. The padding and the running
result keep every step a local lookup or a copy, which a tiny causal model learns quickly
(a digit cannot see how far it is from the end of its number, but in a fixed-width field
its place from the left says the same).

Around the skeleton sit many independent *style choice points* (wording, spacing, optional
carry notes, closing lines), each with a long and a short option. The pretraining corpus
takes the long one with probability ``long_prob`` (0.55 in the demo config), so the
pretrained policy prefers it but puts real mass on both. The RL reward charges every
response token, so RL flips the brevity-favoured choices: the token distribution drifts
while the arithmetic stays right.

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
    "Please work out {a} + {b}.",
)
SYSTEM_PROMPTS: tuple[str, ...] = (
    "You are a careful math tutor.",
    "Show your work column by column.",
)

# Choice points made once per answer (True = long option).
GLOBAL_CHOICES: tuple[str, ...] = ("open", "restate", "close")
# Choice points made independently on every column line.
COLUMN_CHOICES: tuple[str, ...] = (
    "label", "spaces", "zero_carry", "write", "carry", "so_far", "period",
)

_OPEN = "Let's add column by column.\n"
_CLOSE = "\nDone."


@dataclass(frozen=True)
class Problem:
    """One addition problem, the width its columns are padded to, and its prompt wording."""

    a: int
    b: int
    width: int = 4
    template: int = 0
    system: int | None = None

    def __post_init__(self) -> None:
        if not (0 <= self.a < 10**self.width and 0 <= self.b < 10**self.width):
            raise ValueError(f"operands must have at most {self.width} digits")

    @property
    def total(self) -> int:
        return self.a + self.b


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
    return Problem(a=a, b=b, width=max_digits, template=template, system=system)


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
    columns = tuple({name: rng.random() < long_prob for name in COLUMN_CHOICES}
                    for _ in range(problem.width))
    return Choices(globals_=globals_, columns=columns)


def all_choices(problem: Problem, long: bool) -> Choices:
    """Every choice point set to the long (``True``) or the short option."""
    return Choices(
        globals_=dict.fromkeys(GLOBAL_CHOICES, long),
        columns=tuple(dict.fromkeys(COLUMN_CHOICES, long) for _ in range(problem.width)),
    )


def _digit(n: int, k: int) -> int:
    """Digit ``k`` (0 = ones) of ``n``; 0 beyond its length."""
    return (n // 10**k) % 10


def _column_line(k: int, x: int, y: int, carry_in: int, partial: str,
                 c: dict[str, bool]) -> str:
    """Line of column ``k``; ``partial`` is the result digits so far (this column's first)."""
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
    line += f", so far {partial}" if c["so_far"] else f" ({partial})"
    if c["period"]:
        line += "."
    return line + "\n"


def render_answer(problem: Problem, choices: Choices) -> str:
    """The assistant's answer text for ``problem`` under ``choices`` (no end-of-turn token)."""
    g = choices.globals_
    a, b = f"{problem.a:0{problem.width}d}", f"{problem.b:0{problem.width}d}"
    parts = [_OPEN if g["open"] else "",
             f"We need {a} + {b}.\n" if g["restate"] else f"{a} + {b}\n"]
    carry, partial = 0, ""
    for k, col in enumerate(choices.columns):
        x, y = _digit(problem.a, k), _digit(problem.b, k)
        s = x + y + carry
        last = k == len(choices.columns) - 1  # the last column writes its carry too
        partial = (str(s) if last else str(s % 10)) + partial
        parts.append(_column_line(k + 1, x, y, carry, partial, col))
        carry = s // 10
    parts.append(f"Answer: {problem.total}")
    if g["close"]:
        parts.append(_CLOSE)
    return "".join(parts)


def _column_pattern(k: int, last: bool) -> str:
    result = rf"\d{{{k},{k + 1}}}" if last else rf"\d{{{k}}}"
    spaced = r"\d \+ \d(?: \+ \d)? = \d{1,2}"
    compact = r"\d\+\d(?:\+\d)?=\d{1,2}"
    return (
        rf"(?:Column )?{k}: (?:{spaced}|{compact})(?:, write \d)?(?:, carry 1|, no carry)?"
        rf"(?:, so far {result}| \({result}\))\.?\n"
    )


def answer_pattern(problem: Problem) -> re.Pattern[str]:
    """Regex that matches exactly the well-formed answers to ``problem`` (any digits)."""
    w = problem.width
    restate = rf"(?:We need \d{{{w}}} \+ \d{{{w}}}\.\n|\d{{{w}}} \+ \d{{{w}}}\n)"
    columns = "".join(_column_pattern(k + 1, k == w - 1) for k in range(w))
    return re.compile(
        rf"(?:{re.escape(_OPEN)})?{restate}{columns}Answer: (\d+)(?:{re.escape(_CLOSE)})?"
    )


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
