"""Math reward: the response's final ``\\boxed{}`` answer graded against the gold answer.

Grading is the project's one hang-safe grader, :func:`openrlhf_lpo.rewards.grading.grade_math`
(math-verify in a worker process with a hard kill timeout), shared with the evaluation package,
so a training reward and an evaluation score can never disagree. Reward: 1.0 if correct,
0.0 otherwise (wrong, no answer, grader timeout or error); the grader's status is returned too.
"""

from __future__ import annotations

from typing import Tuple


def math_reward(response: str, gold: str) -> Tuple[float, str]:
    """Return ``(reward, status)`` for one response; ``status`` is the grader's status string."""
    from openrlhf_lpo.rewards.grading import grade_math

    result = grade_math(response, str(gold))
    return (1.0 if result.correct else 0.0), str(result.status)
