"""Grading contract of the evaluation package, on top of the grader shared with the RL reward.

``grade_math(response, gold) -> GradeResult`` and ``grade_choice(response, gold_letter) -> GradeResult``
(fields ``correct: bool`` and ``status``: ok / timeout / no_answer / error) are implemented once in
:mod:`openrlhf_lpo.rewards.grading` (math-verify in worker processes with a hard kill timeout; a letter
extractor for multiple choice) and are safe to call from threads and Ray workers.

:data:`GRADERS` says how each benchmark kind is graded by ``lpo-eval score``:
``fn(rows, texts, pool, opts, progress) -> [GradeResult]`` where ``texts`` are the graded assistant
turns (a ``<think>`` the prompt opened put back in front), ``opts`` holds ``timeout`` (``--item-timeout``),
``fast_path`` and ``boxes``, and ``progress(n)`` advances the bar. A new kind registers its own entry
(``code`` does, in :mod:`evaluation.code_benchmarks`). This module imports nothing else of the
evaluation package, so a kind's module can register here without an import cycle.
"""

from __future__ import annotations

from typing import Callable

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
    math_kind,
    shutdown_shared_pool,
)

__all__ = [
    "GRADERS",
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


def _grade_math(rows: list[dict], texts: list[str], pool: GraderPool, opts: dict, progress) -> list[GradeResult]:
    kind = math_kind(opts["fast_path"], opts["boxes"])
    return pool.grade([(kind, t, r["gold"]) for t, r in zip(texts, rows)], timeout=opts["timeout"], progress=progress)


def _grade_choice(rows: list[dict], texts: list[str], pool: GraderPool, opts: dict, progress) -> list[GradeResult]:
    results = [grade_choice(t, r["gold"], r.get("choices")) for t, r in zip(texts, rows)]
    if progress:
        progress(len(rows))
    return results


# How a benchmark kind is graded (module docstring); a new kind registers its grader here.
GRADERS: dict[str, Callable] = {"math": _grade_math, "choice": _grade_choice}
