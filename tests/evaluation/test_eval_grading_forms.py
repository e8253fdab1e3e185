"""Answer forms of issue 44: trailing backslashes, units, equations given as answers, intervals.

Each rule both ways (what becomes correct, and the near miss that stays wrong), then the two measures: the
peers' cases (tests/evaluation/data/peer_grading_cases.json, from the peers' own test files) and the
held-out cases written before the rules (grading_heldout_cases.json), each against its expected verdicts.
"""

import json
from pathlib import Path

import pytest

from openrlhf_lpo.rewards.answer_forms import solution_groups
from openrlhf_lpo.rewards.choice_grading import grade_choice
from openrlhf_lpo.rewards.extraction import normalize_math
from openrlhf_lpo.rewards.math_grading import _parse, grade_math_inprocess

DATA = Path(__file__).parent / "data"
UNION = "(-\\infty, 2) \\cup (3, \\infty)"
PQ = "p = 5, q = 2 \\quad \\text{and} \\quad p = 7, q = 2"


def _grade(response, gold):
    """(correct, status) with and without the fast path (they must agree)."""
    fast = grade_math_inprocess(response, gold, fast_path=True)
    full = grade_math_inprocess(response, gold, fast_path=False)
    assert (fast.correct, fast.status) == (full.correct, full.status), (response, gold, fast, full)
    return full.correct


def test_the_end_of_an_answer_is_tidied():
    """A stray backslash, a line break, a full stop, a squared unit abbreviation, a degree scale, a logical or."""
    cases = {
        "185\\": "185", "7 \\": "7", "x\\\\\\": "x", "12 \\\\": "12", "(2,\\infty).": "(2,\\infty)", "0.5.": "0.5",
        "15 cm^2": "15", "864 in^{2}": "864", "30^\\circ C": "30^\\circ", "30^{\\circ}\\mathrm{F}": "30^\\circ",
        "30\u00b0": "30^\\circ", "30 \u00b0C": "30^\\circ", "x < 2 \\lor x > 3": "x < 2 \\text{ or } x > 3",
        # left alone: an ellipsis, an escaped brace, one-letter units (a variable), a power of a number, a 2C
        "1, 2, \\ldots": "1, 2, \\ldots", "1, 2, ..": "1, 2, ..", "\\{1, 2\\}": "\\{1, 2\\}", "2m^2": "2m^2",
        "5^2": "5^2", "x^\\circ + 2C": "x^\\circ + 2C",
    }
    assert {k: normalize_math(k) for k in cases} == cases


@pytest.mark.parametrize(
    "response, gold, correct",
    [
        # trailing backslashes: on the gold too, and a LaTeX line break ending the box
        ("\\boxed{185}", "185\\", True),
        ("\\boxed{186}", "185\\", False),
        ("\\boxed{185\\}", "185\\", True),
        ("\\boxed{42 \\\\}", "42", True),
        ("\\boxed{43 \\\\}", "42", False),
        ("\\boxed{(2,\\infty).}", "(2,\\infty)", True),
        ("\\boxed{[2,\\infty).}", "(2,\\infty)", False),
        # units: dropped with their power, never converted, never compared with each other
        ("\\boxed{15 cm^2}", "15\\mbox{ cm}^2", True),
        ("\\boxed{225}", "15\\mbox{ cm}^2", False),
        ("\\boxed{5 cm^2}", "25", False),  # cm^2 is not c*m^2, and the 2 is not the number's
        ("\\boxed{2m^2}", "2", False),  # a one-letter "unit" may be a variable: 2m^2 stays an expression
        ("\\boxed{864 in^{2}}", "864", True),
        ("\\boxed{5 cm}", "5", True),
        ("\\boxed{50 \\text{ mm}}", "5\\text{ cm}", False),  # no conversion: 50 is not 5
        ("\\boxed{5 \\text{ m}}", "5\\text{ cm}", True),  # units are not compared (as Hendrycks, Qwen2.5-Math)
        ("\\boxed{30\u00b0}", "30", True),
        ("\\boxed{40\u00b0}", "30", False),
        ("\\boxed{30^\\circ C}", "30", True),
        ("\\boxed{30\u00b0C}", "30^\\circ", True),
        # equations as answers: a value for one unknown; solutions regrouped when the parse merged them
        ("\\boxed{x = 3}", "3", True),
        ("\\boxed{x = 3, y = 4}", "3", False),
        ("\\boxed{p=5,q=2;p=7,q=2}", PQ, True),
        ("\\boxed{p=5, q=2 \\quad\\text{and}\\quad p=7, q=2}", PQ, True),
        ("\\boxed{(p, q) = (5, 2), (7, 2)}", PQ, True),
        ("\\boxed{p=5,q=3;p=7,q=2}", PQ, False),
        ("\\boxed{p=5,q=2}", PQ, False),
        # pairs matched up wrongly: the flat sets were equal before the regrouping
        ("\\boxed{p = 5, q = 3 \\quad\\text{and}\\quad p = 7, q = 2}", "p = 5, q = 2 \\quad\\text{and}\\quad p = 7, q = 3",
         False),
        ("The roots are $x = \\boxed{2}$ or $x = \\boxed{-3}$.", "2, -3", True),  # roots of one variable: not regrouped
        # intervals: a condition for a set (math-verify's allow_set_relation_comp), conditions joined by "or"
        ("\\boxed{x > 2}", "(2,\\infty)", True),
        ("\\boxed{x \\geq 2}", "(2,\\infty)", False),
        ("\\boxed{-2 \\le x \\le 7}", "x \\in [-2,7]", True),
        ("\\boxed{-2 < x \\le 7}", "x \\in [-2,7]", False),
        ("\\boxed{x < 2 \\text{ or } x > 3}", UNION, True),
        ("\\boxed{x < 2 \\lor x > 3}", UNION, True),
        ("\\boxed{x < 2 \\lor x > 3}", "3", False),  # math-verify alone parses this \\lor answer as 3
        ("\\boxed{x < 2 \\text{ or } x \\geq 3}", UNION, False),
        ("\\boxed{x < 2 \\text{ or } y > 3}", UNION, False),  # two variables
        ("\\boxed{x < 2, x > 3}", UNION, False),  # no "or": a list of conditions could mean "and"
        ("\\boxed{x > 0, x < 5}", "(0, 5)", False),
        ("\\boxed{[1, 2)}", "[1, 2)", True),
        ("\\boxed{[1, 2)}", "[1, 2]", False),
    ],
)
def test_answer_forms(response, gold, correct):
    assert _grade(response, gold) == correct


def test_olympiadbench_gold_with_a_full_stop(bench_dir):
    """An OlympiadBench gold ends in a full stop: math-verify parsed it as 0, so \\boxed{0} was correct and the
    union wrong; the tidied gold is the union."""
    from evaluation.benchmarks import load_benchmark

    gold = "(-\\infty, 0) \\cup\\{1\\}."
    assert gold in {p.gold for p in load_benchmark("olympiadbench").problems}
    assert [_grade(r, gold) for r in ("\\boxed{(-\\infty, 0) \\cup \\{1\\}}", "\\boxed{0}", "\\boxed{(-\\infty, 0)}")] == \
        [True, False, False]


def test_solution_groups_only_when_the_parse_merged_solutions():
    merged = _parse("\\boxed{" + PQ + "}")[0]
    assert solution_groups(PQ, merged) == "p = 5, q = 2; p = 7, q = 2"
    assert solution_groups("x = 2, x = -3", _parse("\\boxed{x = 2, x = -3}")[0]) is None  # one variable's roots
    assert solution_groups("k = 45, n = 2", _parse("\\boxed{k = 45, n = 2}")[0]) is None  # nothing repeated
    assert solution_groups("p = 5, p = 7", _parse("\\boxed{p = 5, p = 7}")[0]) is None


# disagreements with the expected verdicts, pinned (scripts/grading_agreement.py lists them with the texts):
# the peers' case left is lighteval's "therefore I think it's B", which the explicit choice chain does not read
PEER_DISAGREEMENTS = {116}


@pytest.mark.parametrize("name, pinned", [("peer_grading_cases.json", PEER_DISAGREEMENTS),
                                          ("grading_heldout_cases.json", set())])
def test_peer_and_held_out_cases(pool, name, pinned):
    data = json.loads((DATA / name).read_text())
    cases = data["cases"]
    counted = [i for i, c in enumerate(cases) if not c.get("disputed")]
    math = [i for i in counted if cases[i].get("kind", "math") == "math"]
    results = dict(zip(math, pool.grade([("math", cases[i]["response"], cases[i]["gold"]) for i in math], timeout=20)))
    verdicts = {i: results[i].correct if i in results else grade_choice(cases[i]["response"], cases[i]["gold"]).correct
                for i in counted}
    disagree = {i for i in counted if verdicts[i] != cases[i]["expected"]}
    assert disagree == pinned, [(i, cases[i]["gold"], cases[i]["response"][-80:]) for i in sorted(disagree ^ pinned)]
    sizes = {"peer_grading_cases.json": (156, 107), "grading_heldout_cases.json": (102, 102)}[name]
    assert (len(cases), len(counted)) == sizes
