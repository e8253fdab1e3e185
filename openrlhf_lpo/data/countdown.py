"""Countdown problem generator, solvable by construction (3-4 numbers, as Countdown-Tasks-3to4).

A problem is built backwards: draw the numbers, then combine them in a random order with
random operations (``+ - * /``, division only when exact) until one value is left; that
value is the target if it lies in ``[min_target, max_target]``, otherwise the draw is
repeated. The expression that produced the target is kept as ``solution``, so every problem
has a witness that the Countdown grader (:mod:`openrlhf_lpo.rewards.countdown`) accepts.

Rows are ``{"nums", "target", "solution", "prompt", "label"}``: the prompt is the paper's
template (:func:`openrlhf_lpo.data.templates.countdown_prompt`) and the label is the JSON
that :mod:`openrlhf_lpo.rewards.reward_func` dispatches on.
"""

from __future__ import annotations

import json
import random
from fractions import Fraction
from typing import Dict, Iterator, List, Sequence, Tuple

from openrlhf_lpo.data.templates import countdown_prompt

_OPS = ("+", "-", "*", "/")


def countdown_label(nums: Sequence[int], target: int) -> str:
    """The reward label for a Countdown problem."""
    return json.dumps({"task": "countdown", "nums": [int(n) for n in nums], "target": int(target)})


def _combine(a: Tuple[Fraction, str], b: Tuple[Fraction, str], op: str):
    (va, ea), (vb, eb) = a, b
    if op == "+":
        return va + vb, f"({ea} + {eb})"
    if op == "-":
        return va - vb, f"({ea} - {eb})"
    if op == "*":
        return va * vb, f"({ea} * {eb})"
    if vb == 0 or (va / vb).denominator != 1:
        return None
    return va / vb, f"({ea} / {eb})"


def generate_problem(
    rng: random.Random,
    num_count: int,
    min_number: int = 1,
    max_number: int = 99,
    min_target: int = 1,
    max_target: int = 100,
    max_tries: int = 10_000,
) -> Dict:
    """One problem with ``num_count`` numbers; raises ValueError if the ranges admit none."""
    if num_count < 2:
        raise ValueError(f"num_count={num_count} must be >= 2")
    if not (1 <= min_number <= max_number):
        raise ValueError(f"need 1 <= min_number <= max_number, got {min_number}, {max_number}")
    if min_target > max_target:
        raise ValueError(f"min_target={min_target} must be <= max_target={max_target}")
    for _ in range(max_tries):
        nums = [rng.randint(min_number, max_number) for _ in range(num_count)]
        pool: List[Tuple[Fraction, str]] = [(Fraction(n), str(n)) for n in nums]
        ok = True
        while len(pool) > 1:
            i, j = rng.sample(range(len(pool)), 2)
            combined = _combine(pool[i], pool[j], rng.choice(_OPS))
            if combined is None or combined[0].denominator != 1:
                ok = False
                break
            pool = [p for k, p in enumerate(pool) if k not in (i, j)] + [combined]
        if not ok:
            continue
        value, expr = pool[0]
        if min_target <= value <= max_target:
            target = int(value)
            solution = expr[1:-1] if expr.startswith("(") and expr.endswith(")") else expr
            return {
                "nums": nums,
                "target": target,
                "solution": solution,
                "prompt": countdown_prompt(nums, target),
                "label": countdown_label(nums, target),
            }
    raise ValueError(f"no Countdown problem found in {max_tries} tries; widen the number/target ranges")


def generate_problems(
    n: int,
    seed: int = 0,
    num_counts: Sequence[int] = (3, 4),
    **ranges,
) -> List[Dict]:
    """``n`` problems, deterministic in ``seed``; the number count cycles through ``num_counts``."""
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    if not num_counts:
        raise ValueError("num_counts must name at least one count (e.g. 3,4)")
    rng = random.Random(seed)
    return [generate_problem(rng, num_counts[i % len(num_counts)], **ranges) for i in range(n)]


def iter_solutions(nums: Sequence[int]) -> Iterator[Tuple[Fraction, str]]:
    """Every (value, expression) reachable from ``nums`` using each number exactly once (brute force)."""
    items = [(Fraction(int(n)), str(int(n))) for n in nums]

    def rec(pool):
        if len(pool) == 1:
            yield pool[0]
            return
        for i in range(len(pool)):
            for j in range(len(pool)):
                if i == j:
                    continue
                rest = [p for k, p in enumerate(pool) if k not in (i, j)]
                for op in _OPS:
                    (va, ea), (vb, eb) = pool[i], pool[j]
                    if op == "/":
                        if vb == 0:
                            continue
                        combined = (va / vb, f"({ea} / {eb})")
                    else:
                        combined = _combine(pool[i], pool[j], op)
                    yield from rec(rest + [combined])

    yield from rec(items)


def brute_force_solvable(nums: Sequence[int], target: int) -> bool:
    """True iff some expression over ``nums`` (each once, + - * /, any parenthesisation) equals ``target``."""
    goal = Fraction(int(target))
    return any(value == goal for value, _ in iter_solutions(nums))
