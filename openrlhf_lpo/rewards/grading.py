"""Hang-safe answer grading, shared by the RL reward and the ``lpo-eval`` package (a facade).

One grader for training and evaluation, split by concern; each module reads alone:

* :mod:`~openrlhf_lpo.rewards.extraction`: which text is graded (after ``</think>``, a ``<think>`` the
  prompt opened, the last ``\\boxed{}``) and LaTeX normalisation (e-notation such as Minerva's ``4.5e33``).
* :mod:`~openrlhf_lpo.rewards.math_grading`: math-verify with the gold as ``\\boxed{gold}``, the last-box
  rule (``boxes="all"`` for math-verify's set-of-all-boxes behaviour) and a fast path that never
  changes a verdict.
* :mod:`~openrlhf_lpo.rewards.choice_grading`: multiple choice (the last explicit answer wins, hedges
  are wrong).
* :mod:`~openrlhf_lpo.rewards.grader_pool`: worker processes with a hard per-item kill
  (:class:`GraderPool`, :func:`grade_math`, :func:`grade_math_batch`).

Statuses (:data:`STATUSES`): ``ok``, ``no_answer``, ``timeout``, ``error``. This module re-exports the
names other modules use, so ``from openrlhf_lpo.rewards.grading import ...`` keeps working.
"""

from __future__ import annotations

from .choice_grading import CHOICE_LETTERS, extract_choice, grade_choice
from .extraction import (
    THINK_CLOSE,
    THINK_OPEN,
    assistant_text,
    final_answer_text,
    last_boxed,
    normalize_math,
    prompt_opens_think,
)
from .grade_result import STATUSES, GradeResult
from .grader_pool import (
    ITEM_KINDS,
    GraderPool,
    _worker_main,
    _zygote_main,
    default_timeout,
    default_workers,
    grade_math,
    grade_math_batch,
    math_kind,
    shared_pool,
    shutdown_shared_pool,
)
from .math_grading import BOX_RULES, grade_math_inprocess

__all__ = [
    "BOX_RULES",
    "CHOICE_LETTERS",
    "ITEM_KINDS",
    "STATUSES",
    "THINK_CLOSE",
    "THINK_OPEN",
    "GradeResult",
    "GraderPool",
    "assistant_text",
    "default_timeout",
    "default_workers",
    "extract_choice",
    "final_answer_text",
    "grade_choice",
    "grade_math",
    "grade_math_batch",
    "grade_math_inprocess",
    "last_boxed",
    "math_kind",
    "normalize_math",
    "prompt_opens_think",
    "shared_pool",
    "shutdown_shared_pool",
]

_ = (_worker_main, _zygote_main)  # re-exported for ``grading_worker`` (``python -m ...grading_worker``)
