"""Real reference answers through the real grader (math-verify in the worker pool, no fast path)."""

import json
import re

import pytest

from evaluation.benchmarks import load_benchmark
from evaluation.grading import grade_choice
from openrlhf_lpo.rewards.grading import last_boxed

MATH = ["aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench"]
NUMBER = re.compile(r"-?\d+(\.\d+)?")
DIGIT = re.compile(r"\d")


# math-verify 0.9.0 parses Minerva row 261's gold "\\hbar \\omega(v+1 / 2)-\\frac{E_{0}^{2} e^{2}}{2 m \\omega^{2}}"
# to the integer 2, so any answer that also parses to 2 (here "...(v+4 / 2)...") is graded correct.
# Row 268's gold "\\frac{1}{3} E_{1}+\\frac{2}{3} E_{2}" parses to 2/3 (the E_{i} terms vanish), and so does the
# perturbed "\\frac{4}{3} E_{1}+\\frac{2}{3} E_{2}" when its box is parsed alone (the last-box rule).
# Grader defects on real data, pinned here so a math-verify upgrade that fixes (or widens) them is noticed.
KNOWN_FALSE_POSITIVES = {"minerva": {261, 268}}


def perturb(gold: str) -> str:
    """A wrong answer of the same shape: a number + 1, else the first digit changed, else ``+1`` appended."""
    g = gold.strip()
    if NUMBER.fullmatch(g):
        return str(int(g) + 1) if "." not in g else repr(float(g) + 1.0)
    m = DIGIT.search(g)
    if m:
        d = int(m.group())
        return g[: m.start()] + str((d + 3) % 10) + g[m.end() :]
    return "(" + g + ")+1"


@pytest.mark.parametrize("bench", MATH)
def test_every_gold_grades_correct_when_boxed_and_wrong_when_perturbed(bench, pool, bench_dir):
    golds = [p.gold for p in load_benchmark(bench).problems]
    # right answers in several shapes: the gold boxed, in \fbox, padded, after a wrong box it corrects
    good_items = [("\\boxed{%s}" % g, g) for g in golds] + [("\\fbox{ %s }" % g, g) for g in golds] + [
        ("\\boxed{%s} hmm, no: \\boxed{%s}" % (perturb(g), g), g) for g in golds
    ]
    good = pool.grade([("math_full", r, g) for r, g in good_items], timeout=20)
    bad_items = [("The answer is \\boxed{%s}." % perturb(g), g) for g in golds]
    # symbolic comparisons of two different expressions can be slow: a short limit keeps the suite fast,
    # and a killed item still counts as "not correct" (the verdict this test is about)
    bad = pool.grade([("math", r, g) for r, g in bad_items], timeout=3)
    wrong_self = [(i, good_items[i], r) for i, r in enumerate(good) if not (r.correct and r.status == "ok")]
    assert not wrong_self, wrong_self[:5]
    known = KNOWN_FALSE_POSITIVES.get(bench, set())
    fooled = {i for i, r in enumerate(bad) if r.correct}
    assert fooled <= known, [(i, golds[i], bad_items[i][0]) for i in sorted(fooled - known)]
    for i in sorted(known):  # the pinned defects, graded without the short limit
        assert pool.grade([("math_full",) + bad_items[i]], timeout=60)[0].correct, (i, golds[i])
    # a perturbed answer is a real answer in (nearly) every row: the grader compared (or was still
    # comparing when the short limit hit, which depends on machine load), it did not fail to parse
    assert sum(r.status in ("no_answer", "error") for r in bad) <= 0.05 * len(bad)
    assert sum(r.status == "ok" for r in bad) >= 0.5 * len(bad)
    # the fast path never changes a verdict: same (correct, status) as math-verify on every right answer ...
    fast_good = pool.grade([("math", r, g) for r, g in good_items], timeout=20)
    assert [(r.correct, r.status) for r in fast_good] == [(r.correct, r.status) for r in good]
    # ... and on perturbed answers: its condition (the graded box is the gold string) never holds for them,
    # so they take the full path; checked both ways on the first 60 that finish in time
    assert all(last_boxed(r).strip() != g.strip() for r, g in bad_items)
    finished = [i for i, r in enumerate(bad) if r.status != "timeout"][:60]  # a timeout is the clock, not a verdict
    full_bad = pool.grade([("math_full",) + bad_items[i] for i in finished], timeout=20)
    assert [(r.correct, r.status) for r in full_bad] == [(bad[i].correct, bad[i].status) for i in finished]


def test_math500_full_reference_solutions_grade_correct(pool, bench_dir):
    rows = [json.loads(line) for line in open(bench_dir / "math500" / "test.jsonl")]
    res = pool.grade([("math_full", r["solution"], r["answer"]) for r in rows], timeout=20)
    bad = [(i, rows[i]["answer"], r) for i, r in enumerate(res) if not r.correct]
    assert not bad, bad[:5]
    # the fast path gives the same verdicts on the same inputs
    fast = pool.grade([("math", r["solution"], r["answer"]) for r in rows], timeout=20)
    assert [r.correct for r in fast] == [r.correct for r in res]


@pytest.mark.parametrize("bench", ["arc_c", "mmlu_pro"])
def test_every_choice_gold_grades_correct_and_other_letters_wrong(bench, bench_dir):
    problems = load_benchmark(bench).problems
    for p in problems:
        alphabet = "1234" if p.gold.isdigit() else "ABCD"
        other = next(x for x in alphabet if x != p.gold)
        assert grade_choice("\\boxed{%s}" % p.gold, p.gold, p.choices).correct, p
        assert grade_choice("so the answer is (%s)." % p.gold, p.gold, p.choices).correct, p
        assert grade_choice("Answer: %s" % p.gold, p.gold, p.choices).correct, p
        r = grade_choice("\\boxed{%s}" % other, p.gold, p.choices)
        assert (r.correct, r.status, r.extracted) == (False, "ok", other)
