"""Geometry answers (Geometry3k, the synthetic diagrams) graded by the shared math grader.

A geometry label is ``{"task": "geometry", "answer": VALUE, "choices": [VALUES] | null}`` where
``answer`` is the value of the correct option (Geometry3k's HF layout gives the value, its original
JSON gives a letter that :func:`geometry_label` resolves against the choices).

:func:`grade_geometry` reads the response's final answer (after ``</think>``):

* with choices, a ``\\boxed{}`` that holds a single option letter (``C``, ``(C)``, ``\\text{C}``) is
  correct iff it names the option whose value is the answer;
* otherwise the response is graded against the answer value by
  :func:`openrlhf_lpo.rewards.grading.grade_math` (math-verify in the hang-safe worker pool), so
  ``\\boxed{2\\sqrt{3}}``, ``\\boxed{3.46}``-style equivalences follow the math grader exactly.

The same function grades the RL reward (``reward_func.py``, task ``geometry``) and ``lpo-eval``'s
Geometry3k benchmark, so a training reward and an evaluation score cannot disagree.
"""

from __future__ import annotations

import json
import string
from typing import List, Optional, Sequence, Tuple

from openrlhf_lpo.rewards.grading import GradeResult, extract_choice, final_answer_text, grade_math, last_boxed

__all__ = ["geometry_label", "parse_geometry_label", "gold_letter", "grade_geometry", "geometry_reward"]

LETTERS = string.ascii_uppercase


def _clean_choices(choices) -> Optional[List[str]]:
    if choices is None:
        return None
    if isinstance(choices, str) or not isinstance(choices, Sequence):
        raise ValueError(f"choices must be a list of option values, got {choices!r:.80}")
    out = [str(c).strip() for c in choices]
    if not out or len(out) > len(LETTERS) or any(not c for c in out):
        raise ValueError(f"choices must be 1-{len(LETTERS)} non-empty option values, got {choices!r:.80}")
    return out


def geometry_label(answer, choices=None) -> str:
    """The reward label (a JSON string) for one problem.

    ``answer`` is the correct value, or an option letter when ``choices`` are given (then it is
    replaced by that option's value). Raises ValueError for a letter outside the choices.
    """
    choices = _clean_choices(choices)
    value = str(answer).strip()
    if not value:
        raise ValueError("geometry answer is empty")
    if choices is not None and len(value) == 1 and value.upper() in LETTERS and value not in choices:
        idx = LETTERS.index(value.upper())
        if idx >= len(choices):
            raise ValueError(f"answer letter {value!r} is beyond the {len(choices)} choices {choices}")
        value = choices[idx]
    return json.dumps({"task": "geometry", "answer": value, "choices": choices})


def parse_geometry_label(label) -> Tuple[str, Optional[List[str]]]:
    """(answer value, choices or None) of a label string or dict."""
    data = json.loads(label) if isinstance(label, str) else dict(label)
    if "answer" not in data:
        raise ValueError(f"geometry label has no 'answer': {label!r:.120}")
    return str(data["answer"]).strip(), _clean_choices(data.get("choices"))


def gold_letter(answer: str, choices: Optional[List[str]]) -> Optional[str]:
    """The letter of the option equal to ``answer`` (string match after stripping), else None."""
    if not choices:
        return None
    norm = [c.replace(" ", "") for c in choices]
    target = answer.replace(" ", "")
    return LETTERS[norm.index(target)] if target in norm else None


def grade_geometry(response: str, answer: str, choices: Optional[List[str]] = None,
                   timeout: Optional[float] = None) -> GradeResult:
    """Grade one response (see module docstring); ``GradeResult(correct, status, extracted)``."""
    if not isinstance(response, str):
        raise ValueError(f"response must be a str, got {type(response).__name__}")
    choices = _clean_choices(choices)
    text = final_answer_text(response)
    if text is None:
        return GradeResult(False, "no_answer", None)
    letter = gold_letter(answer, choices)
    if letter is not None:
        box = last_boxed(text)  # only the box is read for a letter (no "answer is X" fallback)
        picked = extract_choice("\\boxed{" + box + "}", LETTERS[: len(choices)]) if box is not None else None
        if picked is not None:
            return GradeResult(picked == letter, "ok", picked)
    return grade_math(response, answer, timeout=timeout)


def geometry_reward(response: str, label) -> Tuple[float, str]:
    """``(reward, status)``: 1.0 for a correct answer, else 0.0 (the reward-registry signature)."""
    answer, choices = parse_geometry_label(label)
    result = grade_geometry(response, answer, choices)
    return (1.0 if result.correct else 0.0), str(result.status)
