"""Which answer is graded: several boxes that together are the answer, a correction that takes
the last box, a closing "The final answer is $X$", a stray backslash in a box, the box-required policy for
truncated output, the same rules in the RL reward, and math-verify's own regression cases."""

import json
from pathlib import Path

import pytest

from evaluation.grading import GRADERS, check_grading_options
from openrlhf_lpo.rewards.extraction import answer_parts, box_list, is_list_glue, last_boxed
from openrlhf_lpo.rewards.math_grading import grade_math_inprocess

DATA = Path(__file__).parent / "data" / "math_verify_cases.json"


def _both_paths(response, gold, **kw):
    """(correct, status) with and without the fast path (they must agree)."""
    fast = grade_math_inprocess(response, gold, fast_path=True, **kw)
    full = grade_math_inprocess(response, gold, fast_path=False, **kw)
    assert (fast.correct, fast.status) == (full.correct, full.status), (response, gold, fast, full)
    return full


@pytest.mark.parametrize(
    "response, gold, correct",
    [
        # a list of boxes is one answer when the gold has several parts
        ("solutions are:\n\\[\n\\boxed{(1, 2)}, \\boxed{(2, 1)}, \\boxed{(-1, -20)}, \\boxed{(-20, -1)}\n\\]",
         "(2,1),(1,2),(-1,-20),(-20,-1)", True),
        ("$$\\boxed{k = 45} \\quad \\text{and} \\quad \\boxed{n = 2}$$", "k = 45, n = 2", True),
        ("The roots are $x = \\boxed{2}$ or $x = \\boxed{-3}$.", "2, -3", True),
        ("\\boxed{1},\\boxed{2},\\boxed{3}", "{1,2,3}", True),
        ("\\boxed{27}, \\boxed{54}, \\boxed{108}", "27,54,108", True),  # a list of numbers, not 27,054,108
        ("$$\\boxed{(3, 3)} \\text{ for part (a) and } \\boxed{(1, 1)}$$", "(3, 3), (1, 1)", True),
        ("\\( y_1 = \\boxed{-2(x - 1)^2 + 5} \\) and \\( y_2 = \\boxed{3(x + 2)^2 - 2} \\)",
         "y_{1}=-2 x^{2}+4 x+3, y_{2}=3 x^{2}+12 x+10", True),
        ("\\boxed{2} and \\boxed{5}", "2, -3", False),  # a wrong list is still wrong
        ("\\boxed{2}, \\boxed{-3}, \\boxed{7}", "2, -3", False),  # and so is a list with an extra part
        # a correction takes the last box, also for a multi-part gold
        ("\\boxed{1, 3} no: \\boxed{1, 2}", "1, 2", True),
        ("\\boxed{1}, or rather \\boxed{2}", "1, 2", False),
        ("\\boxed{2, -3}. Wait, that is wrong: \\boxed{2, 3}", "2, -3", False),
        # a one-part gold keeps the last box, list or not
        ("\\boxed{12}, \\boxed{13}", "13", True),
        ("\\boxed{12}, \\boxed{13}", "12", False),
        ("\\boxed{(1, 2)}, \\boxed{(2, 1)}", "(1, 2)", False),  # a tuple is one part: order matters
        # a closing statement after intermediate boxes (lm-eval's Minerva format)
        ("$0.04 \\cdot 10,000 / 2 = \\boxed{200}$ ... $= \\boxed{255}$ So $10,455. Final Answer: The final answer is "
         "$10,455$. I hope it is correct.", "10455", True),
        ("\\boxed{200} and then... Final Answer: The final answer is $10,454$.", "10455", False),
        ("\\boxed{\\$48.90} ... Final Answer: The final answer is $\\$18.90$. I hope it is correct.", "\\$18.90", True),
        # a stray backslash before the closing brace
        ("So the answer is \\boxed{185\\}", "185", True),
        ("\\boxed{\\{1, 2\\}}", "\\{1,2\\}", True),
    ],
)
def test_which_boxes_are_graded(response, gold, correct):
    r = _both_paths(response, gold)
    assert (r.correct, r.status) == (correct, "ok"), r


def test_list_glue_and_gold_parts():
    assert [is_list_glue(g) for g in (", ", " and ", "\\quad\\text{and}\\quad", " or x = ", "\\) and \\( y_2 = ",
                                      " \\text{ for part (a) and } ")] == [True] * 6
    assert [is_list_glue(g) for g in (" no: ", ", or rather ", ". Wait, ", " hmm, let me recheck: ", "x" * 100)] == [False] * 5
    parts = {"(2,1),(1,2)": 2, "(1, 2)": 1, "[1, 2)": 1, "k = 45, n = 2": 2, "{1,2,3}": 3, "\\{1, 2\\}": 2,
             "1,000": 1, "10,455": 1, "10,\\!080": 1, "\\$32,\\!348": 1, "27,54,108,135": 4, "1, 234": 2,
             "(1,7,103, 105), (3, 5, 101, 107)": 2, "3 \\text{ or } 5": 2, "x_{1}=1,\\quad x_{2}=2": 2, "\\frac{1}{2}": 1}
    assert {g: answer_parts(g) for g in parts} == parts
    text = "\\boxed{a} then no: \\boxed{b}, \\boxed{c \\boxed{d}}"
    assert [c for _, _, c in box_list(text)] == ["b", "c \\boxed{d}"]  # outer boxes; the correction ends the list
    assert last_boxed(text) == "d" and last_boxed("\\boxed{x\\\\}") == "x\\\\"  # "\\\\" (a line break) is kept


def test_box_required_policy():
    unboxed = "Let me compute step by step ... so far we have 42"
    boxed = "... \\boxed{41}. Final Answer: The final answer is $42$."
    assert _both_paths(unboxed, "42").correct  # math-verify reads the unboxed text
    r = _both_paths(unboxed, "42", require_box=True)
    assert (r.correct, r.status) == (False, "no_answer")
    assert _both_paths(boxed, "42").correct  # the closing statement ...
    assert not _both_paths(boxed, "42", require_box=True).correct  # ... is not a box
    assert _both_paths(boxed, "41", require_box=True).correct
    r = _both_paths(unboxed, "42", boxes="all", require_box=True)
    assert (r.correct, r.status) == (False, "no_answer")


def test_box_required_by_finish_reason_in_score(pool):
    """GRADERS["math"]: `truncated` (the default) requires a box of responses that hit the token limit only."""
    rows = [{"gold": "42", "finish_reason": fr, "benchmark": "x"} for fr in ("stop", "length", "length")]
    texts = ["so we get 42", "so we get 42", "so we get \\boxed{42}"]

    def grade(policy):
        opts = {"timeout": 20, "fast_path": True, "boxes": "last", **check_grading_options({"require_box": policy})}
        return [(r.correct, r.status) for r in GRADERS["math"](rows, texts, pool, opts, None)]

    assert grade("truncated") == [(True, "ok"), (False, "no_answer"), (True, "ok")]
    assert grade("all") == [(False, "no_answer"), (False, "no_answer"), (True, "ok")]
    assert grade("never") == [(True, "ok"), (True, "ok"), (True, "ok")]
    assert check_grading_options({})["require_box"] == "truncated"
    with pytest.raises(ValueError, match="--require-box must be one of truncated, all, never"):
        check_grading_options({"require_box": "sometimes"})


def test_rl_reward_grades_a_list_of_boxes_like_evaluation():
    """The RL math reward is the same grader (shared pool): a list of boxes for a multi-part gold earns 1."""
    from openrlhf_lpo.rewards.math_reward import math_reward

    assert math_reward("The solutions are \\boxed{(1, 2)}, \\boxed{(2, 1)}.", "(2,1),(1,2)") == (1.0, "ok")
    assert math_reward("\\boxed{(1, 2)} no wait: \\boxed{(2, 1)}", "(2,1),(1,2)") == (0.0, "ok")
    assert math_reward("\\boxed{185\\}", "185") == (1.0, "ok")


# math-verify's own verdict differs from ours on these (its tests pass extraction configs and precisions of their
# own, e.g. a decimal comma "1,22" = 1.22, or a set of intervals vs a rounded decimal); pinned so a change is seen.
# 186 and 187 are one pair (gold x \in [-2,7], answer -2 \le x \le 7) expected True with math-verify's
# allow_set_relation_comp and False without it: we grade with it (issue 44), so 187 is the one left.
KNOWN_DISAGREEMENTS = {6, 31, 32, 133, 139, 187, 261}
# the 13 cases "the last box" had broken (12 lists of boxes that are one answer, 1 closing "The final answer is")
LIST_CASES = {172, 183, 202, 232, 233, 234, 236, 238, 239, 243, 244, 245, 246}


def test_math_verify_regression_cases(pool):
    """math-verify's regression cases (test data of huggingface/Math-Verify, see the data file's header) through
    our grader: 259 of 266 agree with math-verify's expected verdict (246 before the list rule; 259 at 8149ae6,
    before the last-box rule; 259 with the issue-44 rules, 186 for 187)."""
    data = json.loads(DATA.read_text())
    cases = data["cases"]
    assert len(cases) == 266 and "Math-Verify" in data["source"]
    results = pool.grade([("math", c["pred"], c["gold"]) for c in cases], timeout=20)
    disagree = {i for i, (c, r) in enumerate(zip(cases, results)) if r.correct != c["expected"]}
    assert disagree == KNOWN_DISAGREEMENTS, [(i, cases[i]["gold"][:60], cases[i]["pred"][-80:]) for i in
                                             sorted(disagree ^ KNOWN_DISAGREEMENTS)]
    assert all(results[i].correct for i in LIST_CASES)
    # the fast path (box content equal to the gold) agrees with the full path on every case with a box
    boxed = [i for i, c in enumerate(cases) if "boxed" in c["pred"]]
    full = pool.grade([("math_full", cases[i]["pred"], cases[i]["gold"]) for i in boxed], timeout=20)
    assert len(boxed) == 95 and [(r.correct, r.status) for r in full] == [(results[i].correct, results[i].status)
                                                                            for i in boxed]
