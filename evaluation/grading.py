"""Grading contract of the evaluation package, on top of the grader shared with the RL reward.

``grade_math(response, gold) -> GradeResult`` and ``grade_choice(response, gold_letter) -> GradeResult``
(fields ``correct: bool`` and ``status``: ok / timeout / no_answer / error) are implemented once in
:mod:`openrlhf_lpo.rewards.grading` (math-verify in worker processes with a hard kill timeout; a letter
extractor for multiple choice) and are safe to call from threads and Ray workers.

:data:`GRADERS` says how each benchmark kind is graded by ``lpo-eval score``:
``fn(rows, texts, pool, opts, progress) -> [GradeResult]`` where ``texts`` are the graded assistant
turns (a ``<think>`` the prompt opened put back in front), ``opts`` holds ``timeout`` (``--item-timeout``),
``fast_path``, ``boxes``, ``require_box`` and ``choice_extraction`` (:data:`GRADING_DEFAULTS`), and
``progress(n)`` advances the bar.

* **Box required** (``--require-box``, math): ``truncated`` (the default) grades a response that hit the
  token limit (``finish_reason == "length"``) only by its boxes, so a cut-off chain of thought whose last
  expression happens to equal the gold gets no credit (verl's default math reward, NeMo-Skills and
  DeepScaleR give none); ``all`` requires a box of every response; ``never`` lets math-verify read an
  unboxed text (the earlier behaviour). Multiple-choice answers are explicit anyway (never a stray
  letter); code is its fenced block.
* **Choice extraction** (``--choice-extraction``): ``explicit`` (the default: the last box / "answer is"
  / "Answer:", hedges wrong) or ``mmlu-pro`` (MMLU-Pro's own chain, which also reads the last standalone
  letter), for every choice benchmark or per benchmark (``mmlu_pro=mmlu-pro``). A new kind registers its own entry
(``code`` does, in :mod:`evaluation.code_benchmarks`). This module imports nothing else of the
evaluation package, so a kind's module can register here without an import cycle.
"""

from __future__ import annotations

from typing import Callable

from openrlhf_lpo.rewards.choice_grading import CHOICE_EXTRACTIONS
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
    "CHOICE_EXTRACTIONS",
    "GRADERS",
    "GRADING_DEFAULTS",
    "REQUIRE_BOX",
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


# When a math answer must be in a box (``--require-box``), by the sample's finish reason.
REQUIRE_BOX: dict[str, Callable[[str], bool]] = {
    "truncated": lambda finish_reason: finish_reason == "length",
    "all": lambda finish_reason: True,
    "never": lambda finish_reason: False,
}
# The grading options ``score`` records in metrics.json (``grader``) and passes to GRADERS.
GRADING_DEFAULTS = {"require_box": "truncated", "choice_extraction": {"*": "explicit"}}


def check_grading_options(options: dict) -> dict:
    """``options`` completed with :data:`GRADING_DEFAULTS`; ValueError naming the flag for a bad value."""
    out = {**GRADING_DEFAULTS, **options}
    if out["require_box"] not in REQUIRE_BOX:
        raise ValueError(f"--require-box must be one of {', '.join(REQUIRE_BOX)}, got {out['require_box']!r}")
    chains = dict(out["choice_extraction"])
    for bench, chain in chains.items():
        if chain not in CHOICE_EXTRACTIONS:
            raise ValueError(f"--choice-extraction {bench}={chain}: choose from {', '.join(CHOICE_EXTRACTIONS)}")
    out["choice_extraction"] = {"*": "explicit", **chains}
    return out


def choice_extraction_for(opts: dict, bench: str) -> str:
    chains = opts.get("choice_extraction") or {}
    return chains.get(bench, chains.get("*", "explicit"))


def job_grading_options(kind: str, bench: str, options: dict) -> dict:
    """The grading options that concern one job (recorded in its ``metrics.json``): a math job's
    ``require_box``, a choice job's ``choice_extraction``; so changing one kind's option rescores only
    that kind's jobs."""
    options = check_grading_options(options)
    if kind == "math":
        return {"require_box": options["require_box"]}
    if kind == "choice":
        return {"choice_extraction": choice_extraction_for(options, bench)}
    return {}


def _grade_math(rows: list[dict], texts: list[str], pool: GraderPool, opts: dict, progress) -> list[GradeResult]:
    required = REQUIRE_BOX[opts.get("require_box", "never")]
    items = [(math_kind(opts["fast_path"], opts["boxes"], required(r.get("finish_reason", "stop"))), t, r["gold"])
             for t, r in zip(texts, rows)]
    return pool.grade(items, timeout=opts["timeout"], progress=progress)


def _grade_choice(rows: list[dict], texts: list[str], pool: GraderPool, opts: dict, progress) -> list[GradeResult]:
    results = [grade_choice(t, r["gold"], r.get("choices"), choice_extraction_for(opts, r.get("benchmark", "")))
               for t, r in zip(texts, rows)]
    if progress:
        progress(len(rows))
    return results


# How a benchmark kind is graded (module docstring); a new kind registers its grader here.
GRADERS: dict[str, Callable] = {"math": _grade_math, "choice": _grade_choice}
