"""Countdown generator: solvable by construction, checked by an independent brute force."""

import itertools
import json
from fractions import Fraction

import pytest

from openrlhf_lpo.data.countdown import brute_force_solvable, generate_problem, generate_problems
from openrlhf_lpo.data.templates import countdown_prompt
from openrlhf_lpo.rewards.countdown import grade_countdown


def reachable(nums):
    """All values of + - * / expressions using each number once (independent of the product code)."""
    values = set()

    def rec(vals):
        if len(vals) == 1:
            values.add(vals[0])
            return
        for i, j in itertools.permutations(range(len(vals)), 2):
            a, b = vals[i], vals[j]
            rest = [v for k, v in enumerate(vals) if k not in (i, j)]
            outs = [a + b, a - b, a * b] + ([a / b] if b != 0 else [])
            for v in outs:
                rec(rest + [v])

    rec([Fraction(n) for n in nums])
    return values


def test_generated_problems_are_solvable_and_witnessed():
    problems = generate_problems(60, seed=123)
    assert [len(p["nums"]) for p in problems[:4]] == [3, 4, 3, 4]
    for p in problems:
        assert 1 <= p["target"] <= 100 and all(1 <= n <= 99 for n in p["nums"])
        assert Fraction(p["target"]) in reachable(p["nums"])  # brute force agrees
        assert brute_force_solvable(p["nums"], p["target"])
        witness = f"<answer>{p['solution']}</answer>"
        assert grade_countdown(witness, p["nums"], p["target"]).status == "correct"
        assert p["prompt"] == countdown_prompt(p["nums"], p["target"])
        assert json.loads(p["label"]) == {"task": "countdown", "nums": p["nums"], "target": p["target"]}


def test_generator_is_deterministic_in_seed():
    assert generate_problems(10, seed=7) == generate_problems(10, seed=7)
    assert generate_problems(10, seed=7) != generate_problems(10, seed=8)


def test_brute_force_detects_unsolvable():
    # 1,1,1 reach at most 3; 97 is impossible, 3 and 0 are possible
    assert not brute_force_solvable([1, 1, 1], 97)
    assert brute_force_solvable([1, 1, 1], 3) and brute_force_solvable([1, 1, 1], 0)
    assert Fraction(97) not in reachable([1, 1, 1])


def test_bad_ranges_are_value_errors():
    import random

    with pytest.raises(ValueError, match="num_count"):
        generate_problem(random.Random(0), 1)
    with pytest.raises(ValueError, match="min_target"):
        generate_problem(random.Random(0), 3, min_target=5, max_target=1)
    with pytest.raises(ValueError, match="widen"):
        generate_problem(random.Random(0), 3, min_number=1, max_number=1, min_target=50, max_target=60, max_tries=50)
    with pytest.raises(ValueError, match="num_counts"):
        generate_problems(3, num_counts=())
