"""The multiple-choice extractor: the last explicit answer (box, 'answer is (X)', 'Answer: X'), never a stray letter."""

import pytest

from evaluation.grading import extract_choice, grade_choice


@pytest.mark.parametrize(
    "response, expected",
    [
        ("so \\boxed{C}", "C"),
        ("\\boxed{(B)}", "B"),
        ("\\boxed{\\text{D}}", "D"),
        ("\\boxed{C) Planetary days will become shorter.}", "C"),
        ("\\boxed{A} first, then I changed my mind: \\boxed{B}", "B"),
        ("Therefore, the answer is (E).", "E"),
        ("The correct answer is: **J**", "J"),
        ("**Answer:** (G)", "G"),
        ("Answer: $H$", "H"),
        ("The answer is (A). Wait, Answer: B", "B"),
        ("\\boxed{B} ... on reflection the answer is (A)", "A"),
        ("<think>the answer is A</think> Answer: C", "C"),
        ("<think>the answer is A", None),
        ("A is plausible but I cannot decide between B and C.", None),
        ("I think it is a trick question", None),
        ("\\boxed{A person would say 4}", None),
        ("\\boxed{K}", None),
    ],
)
def test_extract_choice(response, expected):
    assert extract_choice(response) == expected


def test_grade_choice_digits_and_validation():
    assert grade_choice("\\boxed{2}", "2").correct
    assert grade_choice("The answer is 3", "2").extracted == "3"
    assert grade_choice("\\boxed{B}", "b").correct
    assert grade_choice("\\boxed{E}", "A", choices="ABCD").status == "no_answer"
    with pytest.raises(ValueError, match="gold"):
        grade_choice("\\boxed{A}", "AB")
    with pytest.raises(ValueError, match="choices"):
        grade_choice("\\boxed{A}", "F", choices="ABCD")


@pytest.mark.parametrize(
    "response, expected",
    [
        # an answer after a qualifier
        ("So the answer is for sure D.", "D"),
        ("The answer is definitely (B).", "B"),
        ("the correct answer is therefore C", "C"),
        ("The answer is, for sure, D", "D"),
        ("The answer is option C", "C"),
        ("The answer is most likely (A) or (B)", "A,B"),
        ("The answer is not A", None),  # "not" is no qualifier
        # quoted letters
        ('Answer: "C"', "C"),
        ("the answer is 'B'.", "B"),
        ("Answer: \u201cE\u201d", "E"),
        ('\\boxed{"G"}', "G"),
        # a stray backslash before the box's closing brace
        ("\\boxed{C\\}", "C"),
        # a hedge followed by conditional restatements stays a hedge ...
        ("The answer is (A) or (B). If the gas is ideal, the answer is (A); otherwise the answer is (B).", "A,B"),
        ("The answer is (A) or (B). Assuming no friction, the answer is (A).", "A,B"),
        # ... but an unconditional answer after it resolves it, and a conditional one outside the hedge is an answer
        ("The answer is (A) or (B). Checking again, the answer is (B).", "B"),
        ("The answer is (A) or (B). If we assume friction, the answer is (C).", "C"),
        ("Answer: A. If we include friction, the answer is B.", "B"),  # no hedge before: the last answer wins
    ],
)
def test_extract_choice_gaps(response, expected):
    assert extract_choice(response) == expected


def _mmlu_pro_reference(text):
    """MMLU-Pro's documented chain, regex for regex (TIGER-AI-Lab/MMLU-Pro evaluate_from_local.py), as the
    independent reference for our implementation."""
    import re

    m = re.search(r"answer is \(?([A-J])\)?", text)
    if m:
        return m.group(1)
    m = re.search(r".*[aA]nswer:\s*([A-J])", text)
    if m:
        return m.group(1)
    m = re.search(r"\b[A-J]\b(?!.*\b[A-J]\b)", text, re.DOTALL)
    return m.group(0) if m else None


def test_mmlu_pro_chain_matches_its_definition():
    import random

    from openrlhf_lpo.rewards.choice_grading import extract_choice_mmlu_pro

    rng = random.Random(0)
    pieces = ["the answer is (C)", "The answer is B", "Answer: D", "answer: E", "ANSWER: F", "so A) it is",
              "I think G", "between H and I", "\n", "Answer:\n J", "answer is j", "The Answer is (C)", "x",
              "the answer is for sure D", "\\boxed{E}", "a lower-case b here", "Answer: (F)"]
    texts = ["".join(rng.choice(pieces) + " " for _ in range(rng.randint(0, 8))) for _ in range(3000)]
    texts += ["Answer: C and Answer: D\nAnswer: E", "no letters at all", "The answer is (B). Answer: C", "I pick A or B"]
    mismatches = [(t, extract_choice_mmlu_pro(t), _mmlu_pro_reference(t)) for t in texts
                  if extract_choice_mmlu_pro(t) != _mmlu_pro_reference(t)]
    assert not mismatches, mismatches[:5]
    # where the two chains differ: MMLU-Pro reads stray letters and takes the first "answer is"
    assert grade_choice("I pick A over B, so C", "C", extraction="mmlu-pro").correct
    assert grade_choice("I pick A over B, so C", "C").status == "no_answer"
    assert grade_choice("The answer is (B). Final Answer: C", "C").correct
    assert not grade_choice("The answer is (B). Final Answer: C", "C", extraction="mmlu-pro").correct
    assert grade_choice("<think>the answer is (A)", "A", extraction="mmlu-pro").status == "no_answer"
    with pytest.raises(ValueError, match="choice extraction must be one of explicit, mmlu-pro"):
        grade_choice("\\boxed{A}", "A", extraction="lm-eval")
