"""Grading faults found on real benchmark golds, each pinned on real benchmark golds or hand-made cases.

Scientific notation (Minerva), the last-box rule (and the all-boxes option), the fast path never
changing a verdict, a ``<think>`` opened by the prompt, multiple choice (last explicit answer, hedges,
``ANSWER: C``, case).
"""

import re

import pytest

from evaluation.benchmarks import load_benchmark
from openrlhf_lpo.rewards.grading import (
    assistant_text,
    extract_choice,
    grade_choice,
    grade_math_batch,
    math_kind,
    prompt_opens_think,
)

SCI = re.compile(r"^(-?\d+(?:\.\d+)?)e(-?\d+)$")
UNITS = ["", " \\mathrm{~erg} \\mathrm{~s}^{-1}", "~\\text{m/s}", "\\ \\text{cm}", " \\text{ K}"]


def _sci_golds():
    golds = [p.gold for p in load_benchmark("minerva").problems]
    return golds, [(i, g, *SCI.match(g).groups()) for i, g in enumerate(golds) if SCI.match(g)]


def test_minerva_e_notation_golds_match_times_and_cdot_renderings_with_and_without_units(pool, bench_dir):
    golds, sci = _sci_golds()
    assert len(golds) == 272 and len(sci) == 58  # the count: 58 golds like 4.5e33
    items, expect = [], []
    for _, g, mant, exp in sci:
        for op in ("\\times", "\\cdot"):
            for unit in UNITS:
                items.append((f"so the answer is \\boxed{{{mant} {op} 10^{{{exp}}}{unit}}}", g))
                expect.append(True)
        items.append((f"\\boxed{{{g}}}", g))  # the gold's own e-notation, as a model might write it
        expect.append(True)
        items.append((f"\\boxed{{{mant} \\times 10^{{{int(exp) + 1}}}}}", g))  # off by a factor of ten
        expect.append(False)
        items.append((f"\\boxed{{{float(mant) * 2:g} \\times 10^{{{exp}}}}}", g))  # wrong mantissa
        expect.append(False)
    for kind in (math_kind(fast_path=False), math_kind(fast_path=True)):
        res = pool.grade([(kind, r, g) for r, g in items], timeout=20)
        bad = [(items[i], r) for i, r in enumerate(res) if r.correct != expect[i] or r.status != "ok"]
        assert not bad, (kind, len(bad), bad[:4])


def test_e_notation_in_answers_and_free_text(pool):
    items = [
        ("\\boxed{4.5e33}", "4.5 \\times 10^{33}", True),
        ("\\boxed{1.04E-3}", "0.00104", True),
        ("\\boxed{3e+08}", "3 \\times 10^8", True),
        ("The answer is 4.5e33.", "4.5e33", True),  # unboxed: read as a number, not 4.5
        ("The answer is $4.5e33$ erg.", "4.5 \\times 10^{33}", True),
        ("The answer is 4.5e33.", "4.5", False),
        ("\\boxed{2e}", "2e", True),  # Euler's number is left alone
        ("\\boxed{2e}", "5.43656", False),
        ("\\boxed{e^{2}}", "e^2", True),
    ]
    res = pool.grade([("math_full", r, g) for r, g, _ in items], timeout=20)
    assert [r.correct for r in res] == [e for _, _, e in items], list(zip(items, res))


def test_last_box_is_graded_and_all_boxes_is_the_old_rule(pool):
    resp = "First \\boxed{12} ... no: \\boxed{13}"
    items = [(math_kind(fp, boxes), resp, gold) for fp in (True, False) for boxes in ("last", "all") for gold in ("12", "13")]
    got = [(r.correct, r.status) for r in pool.grade(items, timeout=20)]
    # last box: 13 right, 12 wrong; all boxes (math-verify's set {12, 13}): both wrong
    assert got == [(False, "ok"), (True, "ok"), (False, "ok"), (False, "ok")] * 2
    assert grade_math_batch([resp], ["13"], boxes="last")[0].extracted == "13"
    with pytest.raises(ValueError, match="boxes"):
        grade_math_batch([resp], ["13"], boxes="first")


def test_last_box_on_every_math500_gold(pool, bench_dir):
    """A corrected answer (wrong box, then the gold's box) is right; the reverse is wrong."""
    golds = [p.gold for p in load_benchmark("math500").problems]
    fixed = [("math", f"\\boxed{{{g}+1}} Wait, that is wrong. \\boxed{{{g}}}", g) for g in golds]
    res = pool.grade(fixed, timeout=20)
    assert sum(r.correct for r in res) == len(golds), [(golds[i], r) for i, r in enumerate(res) if not r.correct][:5]
    old = pool.grade([("math_allboxes", r, g) for _, r, g in fixed], timeout=3)
    # the old rule reads a set {g+1, g}: most golds fail (tuples/intervals may parse differently)
    assert sum(r.correct for r in old) < 0.2 * len(golds)
    recanted = pool.grade([("math", f"\\boxed{{{g}}}, or rather \\boxed{{{g}+1}}", g) for g in golds], timeout=3)
    assert not any(r.correct for r in recanted), [(golds[i], r) for i, r in enumerate(recanted) if r.correct][:5]


def test_fast_path_and_fbox_agree_with_math_verify():
    cases = [("\\fbox{42}", "42"), ("\\boxed{42}", "42"), ("\\boxed{ 42 }", "42"), ("\\boxed{41} \\fbox{42}", "42"),
             ("\\fbox{41} \\boxed{42}", "42"), ("\\boxed{\\text{}}", "\\text{}"), ("\\boxed{}", "")]
    for boxes in ("last", "all"):
        fast = grade_math_batch([c[0] for c in cases], [c[1] for c in cases], fast_path=True, boxes=boxes)
        full = grade_math_batch([c[0] for c in cases], [c[1] for c in cases], fast_path=False, boxes=boxes)
        assert [(r.correct, r.status) for r in fast] == [(r.correct, r.status) for r in full], (boxes, fast, full)
    assert fast[0].correct is False and full[0].correct is False  # math-verify does not read \fbox (old rule)
    last = grade_math_batch(["\\fbox{42}"], ["42"], fast_path=False)
    assert last[0].correct  # the last-box rule reads \fbox like \boxed, on both paths


def test_think_opened_by_the_prompt():
    from evaluation.templates import render_prompt

    r1 = render_prompt("r1", "What is 2+3?", "math")
    distill = "<｜User｜>What is 2+3?<｜Assistant｜><think>\n"
    qwen3_no_think = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert prompt_opens_think(r1) and prompt_opens_think(distill) and not prompt_opens_think(qwen3_no_think)
    assert not prompt_opens_think("A chat. <think> reasoning </think> answer. User: hi")
    unfinished = "Let me add: 2+3 = \\boxed{5}, maybe"
    finished = "2+3 is five.</think> The answer is \\boxed{5}"
    res = grade_math_batch(
        [assistant_text(unfinished, p) for p in (r1, distill, qwen3_no_think, None)] + [assistant_text(finished, r1)],
        ["5"] * 5,
    )
    assert [(r.correct, r.status) for r in res] == [(False, "no_answer")] * 2 + [(True, "ok")] * 3
    assert extract_choice(assistant_text("the answer is (B)", r1)) is None
    assert extract_choice(assistant_text("hmm</think> the answer is (B)", r1)) == "B"


def test_reward_func_takes_the_prompt_think_into_account():
    from openrlhf_lpo.rewards.reward_func import score_one

    prompt = "User: 2+3?\nAssistant: <think>"
    assert score_one(prompt + "so \\boxed{5}", prompt, "5") == (0.0, "no_answer")
    assert score_one(prompt + "ok</think> \\boxed{5}", prompt, "5") == (1.0, "ok")
    assert score_one("Q? \\boxed{5}", "Q?", "5") == (1.0, "ok")


@pytest.mark.parametrize(
    "response, expected",
    [
        ("The answer is (A) because ... Final Answer: C", "C"),  # the last explicit answer wins
        ("\\boxed{A} is tempting, but the answer is B.", "B"),
        ("The answer is B. Let me double-check... \\boxed{D}", "D"),
        ("ANSWER: C", "C"),
        ("answer: c", "C"),
        ("Final answer: (d)", "D"),
        ("\\boxed{c}", "C"),
        ("the answer is a good guess, maybe", None),  # a bare lowercase word is not an option
        ("\\boxed{(C) and (D)}", "C,D"),  # hedges are read as the set, which is wrong
        ("\\boxed{C, D}", "C,D"),
        ("\\boxed{C \\text{ or } D}", "C,D"),
        ("\\boxed{C and D are both correct}", "C,D"),
        ("The answer is B or C.", "B,C"),
        ("\\boxed{C) Planetary days will become shorter.}", "C"),
        ("\\boxed{(C) and (C)}", "C"),
    ],
)
def test_choice_rules(response, expected):
    assert extract_choice(response) == expected


def test_choice_hedges_are_wrong_on_real_golds(bench_dir):
    problems = load_benchmark("mmlu_pro").problems
    for p in problems:
        other = next(x for x in "ABCD" if x != p.gold)
        for hedge in (f"\\boxed{{({p.gold}) and ({other})}}", f"The answer is {p.gold} or {other}."):
            r = grade_choice(hedge, p.gold, p.choices)
            assert (r.correct, r.status) == (False, "ok"), (hedge, r)
        late = grade_choice(f"The answer is ({other}). Wait, no. ANSWER: {p.gold}", p.gold, p.choices)
        assert late.correct, late
