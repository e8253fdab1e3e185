"""Grading contract of the evaluation package, on top of the grader shared with the RL reward.

``grade_math(response, gold) -> GradeResult`` and ``grade_choice(response, gold_letter) -> GradeResult``
(fields ``correct: bool`` and ``status``: ok / timeout / no_answer / error) are implemented once in
:mod:`openrlhf_lpo.rewards.grading` (math-verify in worker processes with a hard kill timeout; a letter
extractor for multiple choice) and are safe to call from threads and Ray workers.
"""

from openrlhf_lpo.rewards.grading import (  # noqa: F401
    STATUSES,
    GradeResult,
    GraderPool,
    assistant_text,
    extract_choice,
    final_answer_text,
    grade_choice,
    grade_math,
    grade_math_batch,
    shutdown_shared_pool,
)

__all__ = [
    "STATUSES",
    "GradeResult",
    "GraderPool",
    "assistant_text",
    "extract_choice",
    "final_answer_text",
    "grade_choice",
    "grade_math",
    "grade_math_batch",
    "shutdown_shared_pool",
]
