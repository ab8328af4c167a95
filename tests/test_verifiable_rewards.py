"""Verifiable math rewards against hand-computed values: answer extraction, numeric comparison,
the format check, the tutorial's GSM8K reward and DAPO's overlong penalty."""

from __future__ import annotations

import pytest

from ppo_lightning.rewards.verifiable import (
    answer_format,
    answers_match,
    extract_answer,
    math_answer,
    math_answer_and_format,
    overlong_penalty,
    parse_number,
)


@pytest.mark.parametrize(
    "text, answer",
    [
        ("so <answer> 42 </answer>", "42"),
        ("<answer>1</answer> then <answer>2</answer>", "2"),  # the last block
        ("3 + 4 = 7\n#### 1,234", "1,234"),
        ("hence \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
        ("it is 3, then 7.5 apples", "7.5"),  # the last number, as a last resort
        ("no number here", None),
    ],
)
def test_the_answer_is_the_tag_then_hashes_then_boxed_then_the_last_number(text, answer):
    assert extract_answer(text) == answer


def test_answers_compare_as_numbers_within_1e_4():
    assert answers_match("1,234", "1234") and answers_match("$5.50", "5.5") and answers_match("7.", "7")
    # thousands separators only in groups of three: "1,2,3" is three numbers, not 123
    assert answers_match("1,234,567", "1234567") and not answers_match("1,2,3", "123")
    assert parse_number("1,2,3") is None and parse_number("12,34") is None
    assert answers_match("0.33333", "0.33332") and not answers_match("0.3334", "0.3332")
    assert not answers_match(None, "3") and not answers_match("3", None)
    assert answers_match("Paris", " paris ")  # not numbers: compared as text


def test_expressions_are_not_read_as_their_one_number():
    """``\\sqrt{4}`` holds one number, 4, but its value is 2: an expression is never a number, so
    it is compared as text or symbolically, never as 4."""
    assert not answers_match("\\sqrt{4}", "4") and not answers_match("1/2", "2") and not answers_match("3+4", "4")
    assert answers_match("12 apples", "12") and answers_match("-3.5", "-3.50")


def test_math_verify_decides_answers_that_are_not_numbers():
    pytest.importorskip("math_verify")
    assert answers_match("\\frac{1}{2}", "1/2") and answers_match("\\frac{6}{4}", "\\frac{3}{2}")
    assert answers_match("\\sqrt{4}", "2") and answers_match("x+1", "1+x") and answers_match("0.5", "1/2")
    assert not answers_match("\\frac{1}{3}", "1/2") and not answers_match("\\sqrt{2}", "2")
    assert math_answer(None, ["so \\boxed{\\frac{2}{4}}"], ["1/2"]) == [1.0]


def test_the_tutorials_gsm8k_reward_is_correct_plus_one_answer_block_clipped_at_1_2():
    completions = [
        "<answer>7</answer>",  # correct, one block: 1.0 + 0.2
        "#### 7",  # correct, no block: 1.0
        "<answer>8</answer>",  # wrong, one block: 0.2
        "<answer>8</answer> no, <answer>7</answer>",  # correct (the last block), two blocks: 1.0
        "eight",  # wrong, no block: 0
    ]
    answers = ["7"] * 5
    assert math_answer(None, completions, answers) == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert answer_format(None, completions) == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert math_answer_and_format(None, completions, answers) == pytest.approx([1.2, 1.0, 0.2, 1.0, 0.0])
    chat = [[{"role": "assistant", "content": c}] for c in completions]  # TRL's conversational form
    assert math_answer_and_format(None, chat, answers) == pytest.approx([1.2, 1.0, 0.2, 1.0, 0.0])


def test_the_overlong_penalty_falls_linearly_over_the_last_tokens():
    ids = [[0] * n for n in (3, 6, 7, 8, 10)]
    assert overlong_penalty(None, None, ids, max_length=10, buffer=4) == pytest.approx([0, 0, -0.25, -0.5, -1])
    with pytest.raises(ValueError, match="buffer=0"):
        overlong_penalty(None, None, ids, max_length=10, buffer=0)
