"""Countdown grader: exact arithmetic, the once-each rule, and no way to smuggle code through."""

from fractions import Fraction

import pytest

from openrlhf_lpo.rewards.countdown import (
    CountdownExpressionError,
    evaluate_expression,
    extract_answer,
    grade_countdown,
)


def wrap(expr: str) -> str:
    return f"<think>trying things</think> <answer>{expr}</answer>"


@pytest.mark.parametrize(
    "nums,target,expr",
    [
        ([2, 54, 17], 35, "54 - 17 - 2"),
        ([2, 54, 17], 35, "(54 - 17) - 2"),
        ([3, 5, 7, 2], 11, "(3 * 5 + 7) / 2"),
        ([1, 49, 49], 1, "(1 / 49) * 49"),  # float arithmetic gives 0.9999999999999999
        ([6, 6, 4], 9, "6 * 6 / 4"),
    ],
)
def test_correct_answers_get_full_reward(nums, target, expr):
    # independent reference: Python's own evaluation of the same (plain arithmetic) string
    assert abs(eval(expr) - target) < 1e-9  # noqa: S307 - test-side reference on a literal
    result = grade_countdown(wrap(expr), nums, target)
    assert result.status == "correct" and result.reward == 1.0
    assert result.value == Fraction(target)


def test_exact_fraction_where_float_fails():
    assert (1 / 49) * 49 != 1  # the float pitfall this grader avoids
    assert evaluate_expression("(1 / 49) * 49", [1, 49, 49]) == 1


def test_equation_suffix_must_name_the_target():
    assert grade_countdown(wrap("54 - 17 - 2 = 35"), [2, 54, 17], 35).status == "correct"
    assert grade_countdown(wrap("54 - 17 - 2 = 36"), [2, 54, 17], 35).status == "invalid"


def test_wrong_value_and_format_score():
    r = grade_countdown(wrap("54 + 17 - 2"), [2, 54, 17], 35)
    assert (r.status, r.reward, r.value) == ("wrong_value", 0.0, Fraction(69))
    r = grade_countdown(wrap("54 + 17 - 2"), [2, 54, 17], 35, format_score=0.1)
    assert r.reward == pytest.approx(0.1)
    assert grade_countdown("no tags at all 35", [2, 54, 17], 35, format_score=0.1).reward == 0.0


def test_last_answer_tag_is_graded():
    text = "<answer>54 + 17 - 2</answer> wait <answer>54 - 17 - 2</answer>"
    assert extract_answer(text) == "54 - 17 - 2"
    assert grade_countdown(text, [2, 54, 17], 35).status == "correct"
    assert grade_countdown("<answer>54 - 17 - 2</answer> no, <answer>1</answer>", [2, 54, 17], 35).reward == 0.0


@pytest.mark.parametrize(
    "expr,why",
    [
        ("54 - 17 - 2 - 2", "reuse"),  # 2 used twice
        ("54 - 17", "missing"),  # 2 unused
        ("54 - 17 - 2 + 0", "foreign"),
        ("54 - 19", "foreign"),
        ("54 - 17 - 2.0", "float"),
        ("5.4e1 - 17 - 2", "float"),
        ("-2 + 54 - 17", "unary"),
        ("54 - 17 - (-2) - 4", "unary"),
        ("54 // 17 + 2", "floordiv"),
        ("54 % 17 + 2", "mod"),
        ("2 ** 5 + 54 - 17", "pow"),
        ("__import__('os').system('true')", "call"),
        ("(lambda: 35)()", "lambda"),
        ("abs(54 - 17 - 2)", "call"),
        ("[54, 17, 2]", "list"),
        ("54 - 17 - 2; 1", "statement"),
        ("54 - 17 - 2 if 1 else 0", "ifexp"),
        ("54 - 17 - 2 and 35", "boolop"),
        ("True + 54 - 17 - 2 - 1", "bool"),
        ("54 - 17 - 2 ", "ok"),
        ("٥٤ - 17 - 2", "unicode digits"),
        ("(54 - 17) - 2 / 0", "zero"),
        ("(" * 200 + "54 - 17 - 2" + ")" * 200, "too long"),
        ("054 - 17 - 2", "leading zero"),
        ("54 - 17 - 2)", "syntax"),
    ],
)
def test_rejected_expressions(expr, why):
    if why == "ok":
        assert evaluate_expression(expr, [2, 54, 17]) == 35
        return
    with pytest.raises(CountdownExpressionError):
        evaluate_expression(expr, [2, 54, 17])
    assert grade_countdown(wrap(expr), [2, 54, 17], 35).status == "invalid"


def test_duplicate_numbers_may_each_be_used_once():
    assert evaluate_expression("6 * 6 / 4", [6, 6, 4]) == 9
    with pytest.raises(CountdownExpressionError):
        evaluate_expression("6 * 6 * 6 / 4", [6, 6, 4])


def test_no_answer():
    r = grade_countdown("<think>I give up</think>", [1, 2, 3], 6)
    assert (r.status, r.reward, r.expression) == ("no_answer", 0.0, None)
