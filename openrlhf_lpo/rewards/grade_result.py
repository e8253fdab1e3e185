"""The grader's result type and statuses, shared by the math grader, the choice grader and the pool.

Statuses: ``ok`` (graded; ``correct`` says how), ``no_answer`` (nothing to grade), ``timeout`` (the
worker was killed after its time limit), ``error`` (the gold could not be parsed, or the worker crashed).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["STATUSES", "GradeResult", "check_text"]

STATUSES = ("ok", "timeout", "no_answer", "error")


@dataclass(frozen=True)
class GradeResult:
    """Outcome of grading one response: ``correct`` and ``status`` (one of :data:`STATUSES`).

    ``extracted`` is the answer the grader read from the response (``None`` if there was none).
    """

    correct: bool
    status: str
    extracted: str | None = None


def check_text(name: str, value) -> str:
    """``value`` if it is a ``str``; otherwise a ValueError naming ``name``."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a str, got {type(value).__name__}: {value!r:.80}")
    return value
