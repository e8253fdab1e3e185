"""Countdown reward: an arithmetic expression that reaches a target using each given number once.

The task follows Pan et al. (2025, TinyZero), used by the LPO paper (arXiv 2605.06139, Appendix F):
the model writes its reasoning in ``<think>...</think>`` and its final expression in
``<answer>...</answer>``. The expression is graded without ``eval``: it is parsed with
:mod:`ast` and only integer literals, ``+ - * /`` and parentheses are accepted; arithmetic
is exact (:class:`fractions.Fraction`), so ``(1 + 2) / 3`` equals 1 exactly and no float
rounding can turn a wrong answer into a right one.

Rules (the Countdown-Tasks-3to4 convention): every given number is used exactly once
(as a multiset: duplicates in ``nums`` may each be used once), no other number appears,
no unary minus, no exponent, no function call, no names. An optional ``= target`` suffix
inside the answer tag is accepted when its number equals the target.

Reward (binary by default): 1.0 if the last answer is valid and reaches the target,
``format_score`` (default 0.0; TinyZero used 0.1) if an answer tag is present but wrong or
invalid, 0.0 if there is no answer tag.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional, Sequence

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
MAX_EXPRESSION_CHARS = 256
_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


class CountdownExpressionError(ValueError):
    """The answer is not an allowed Countdown expression (the message says why)."""


@dataclass(frozen=True)
class CountdownResult:
    """Outcome of grading one response."""

    reward: float
    status: str  # "correct" | "wrong_value" | "invalid" | "no_answer"
    expression: Optional[str] = None
    value: Optional[Fraction] = None


def extract_answer(response: str) -> Optional[str]:
    """Text inside the last ``<answer>...</answer>`` of ``response`` (stripped), or None."""
    matches = ANSWER_RE.findall(response)
    if not matches:
        return None
    return matches[-1].strip()


def _walk(node, used: list) -> Fraction:
    if isinstance(node, ast.Expression):
        return _walk(node.body, used)
    if isinstance(node, ast.BinOp):
        op = _OPS.get(type(node.op))
        if op is None:
            raise CountdownExpressionError(f"operator {type(node.op).__name__} is not allowed (only + - * /)")
        left = _walk(node.left, used)
        right = _walk(node.right, used)
        if isinstance(node.op, ast.Div) and right == 0:
            raise CountdownExpressionError("division by zero")
        return op(left, right)
    if isinstance(node, ast.Constant):
        # bool is a subclass of int: reject it explicitly.
        if type(node.value) is not int:
            raise CountdownExpressionError(f"literal {node.value!r} is not a non-negative integer")
        used.append(node.value)
        return Fraction(node.value)
    raise CountdownExpressionError(f"{type(node).__name__} is not allowed in a Countdown expression")


def evaluate_expression(expression: str, nums: Sequence[int]) -> Fraction:
    """Exact value of ``expression`` if it uses each number of ``nums`` exactly once.

    Raises :class:`CountdownExpressionError` for anything else (names, calls, powers,
    unary minus, floats, reused/missing/foreign numbers, division by zero, overlong text).
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CountdownExpressionError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    if not re.fullmatch(r"[0-9 \t\n+\-*/()]+", expression):
        raise CountdownExpressionError("only digits, + - * /, parentheses and spaces are allowed")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CountdownExpressionError(f"not a valid expression: {exc.msg}") from None
    used: list = []
    value = _walk(tree, used)
    if Counter(used) != Counter(int(n) for n in nums):
        raise CountdownExpressionError(f"numbers used {sorted(used)} differ from the given {sorted(nums)}")
    return value


def _split_equation(answer: str, target: int) -> str:
    """Drop an ``= target`` suffix; raise if the stated right-hand side is not the target."""
    if "=" not in answer:
        return answer
    left, _, right = answer.partition("=")
    right = right.strip()
    if not re.fullmatch(r"[0-9]+", right) or int(right) != int(target):
        raise CountdownExpressionError(f"right-hand side {right!r} is not the target {target}")
    return left


def grade_countdown(response: str, nums: Sequence[int], target: int, format_score: float = 0.0) -> CountdownResult:
    """Grade one Countdown response (see the module docstring for the rules and the reward)."""
    answer = extract_answer(response)
    if answer is None:
        return CountdownResult(0.0, "no_answer")
    try:
        expression = _split_equation(answer, target)
        value = evaluate_expression(expression, nums)
    except CountdownExpressionError:
        return CountdownResult(float(format_score), "invalid", answer)
    if value == Fraction(int(target)):
        return CountdownResult(1.0, "correct", answer, value)
    return CountdownResult(float(format_score), "wrong_value", answer, value)
