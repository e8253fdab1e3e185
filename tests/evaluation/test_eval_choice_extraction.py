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
