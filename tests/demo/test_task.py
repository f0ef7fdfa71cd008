"""Unit tests of the demo task: rendering, parsing and the reward."""

from __future__ import annotations

import random

import pytest

from pipeline.demo import task


def _problems(n: int = 200, seed: int = 3) -> list[task.Problem]:
    rng = random.Random(seed)
    return [task.sample_problem(rng, 1, d) for d in (1, 3, 5) for _ in range(n)]


def test_every_rendered_answer_is_well_formed_and_correct() -> None:
    rng = random.Random(0)
    for problem in _problems():
        for choices in (task.sample_choices(problem, rng), task.all_choices(problem, True),
                        task.all_choices(problem, False)):
            text = task.render_answer(problem, choices)
            score = task.score_response(problem, text, num_tokens=50)
            assert score.well_formed and score.correct, text
            assert score.answer == problem.a + problem.b
            assert text.isascii()


PROBLEM = task.Problem(a=478, b=95, width=3)
SHORT = "478 + 095\n1: 8+5=13 (3)\n2: 7+9+1=17 (73)\n3: 4+0+1=5 (573)\nAnswer: 573"


def test_reward_is_correctness_minus_length_penalty() -> None:
    text = task.render_answer(PROBLEM, task.all_choices(PROBLEM, False))
    assert text == SHORT
    score = task.score_response(PROBLEM, text, num_tokens=40, length_penalty=0.03)
    assert score.reward == pytest.approx(1.0 - 1.2)
    assert task.score_response(PROBLEM, text, 40, length_penalty=0.0).reward == 1.0


def test_long_rendering_pads_to_the_width() -> None:
    problem = task.Problem(a=478, b=95, width=4)
    text = task.render_answer(problem, task.all_choices(problem, True))
    assert text.splitlines()[1:3] == [
        "We need 0478 + 0095.",
        "Column 1: 8 + 5 + 0 = 13, write 3, carry 1, so far 3.",
    ]
    assert text.endswith("Column 4: 0 + 0 + 0 = 0, write 0, no carry, so far 0573.\n"
                         "Answer: 573\nDone.")
    carried = task.Problem(a=999, b=1, width=3)
    text = task.render_answer(carried, task.all_choices(carried, False))
    assert text.endswith("3: 9+0+1=10 (1000)\nAnswer: 1000")


def test_wrong_answer_is_well_formed_but_not_correct() -> None:
    text = SHORT[:-1] + "2"
    score = task.score_response(PROBLEM, text, num_tokens=30)
    assert score.well_formed and not score.correct
    assert score.answer == 572
    assert score.reward == pytest.approx(-0.9)


@pytest.mark.parametrize("text", [
    "Answer: 573",  # columns skipped
    SHORT.replace("3: 4+0+1=5 (573)\n", ""),  # a column missing
    SHORT.replace("1: ", "x: "),  # wrong label
    SHORT.replace("478 + 095", "478 + 95"),  # restate not padded
    SHORT.replace("(73)", "(573)"),  # running result of the wrong width
    SHORT + " and more",  # trailing junk
    SHORT.replace("8+5", "8 +5"),  # mixed spacing
    SHORT.replace(" (3)", ""),  # no running result
    "",
])
def test_malformed_responses_earn_no_correctness(text: str) -> None:
    score = task.score_response(PROBLEM, text, num_tokens=10)
    assert not score.well_formed and not score.correct
    assert score.reward == pytest.approx(-0.3)


def test_truncated_response_is_never_correct() -> None:
    problem = task.Problem(a=12, b=34, width=2)
    text = task.render_answer(problem, task.all_choices(problem, True))
    score = task.score_response(problem, text, num_tokens=64, stopped=False)
    assert not score.correct and not score.well_formed


def test_choice_points_change_length_and_long_prob_is_respected() -> None:
    problem = task.Problem(a=4321, b=8765, width=4)
    long = task.render_answer(problem, task.all_choices(problem, True))
    short = task.render_answer(problem, task.all_choices(problem, False))
    assert len(long) > 2 * len(short)
    assert task.all_choices(problem, True).count >= 16
    rng = random.Random(1)
    picks = [v for _ in range(400)
             for v in task.sample_choices(problem, rng, long_prob=0.6).globals_.values()]
    assert 0.55 < sum(picks) / len(picks) < 0.65


def test_operands_must_fit_the_width() -> None:
    with pytest.raises(ValueError):
        task.Problem(a=12345, b=1, width=4)


def test_prompt_messages_roles() -> None:
    with_system = task.prompt_messages(task.Problem(a=1, b=2, width=1, template=1, system=0))
    assert [m["role"] for m in with_system] == ["system", "user"]
    assert with_system[1]["content"] == "Compute 1 + 2."
    assert [m["role"] for m in task.prompt_messages(task.Problem(a=1, b=2))] == ["user"]
