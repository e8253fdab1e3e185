"""Math grading with math-verify, in the calling process (no timeout: the pool adds one).

Rules (one grader for RL rewards and ``lpo-eval``):

* **Gold**: wrapped as ``\\boxed{gold}`` (not ``$gold$``), so every staged reference answer grades correct
  against itself, including golds with stray ``$`` or trailing newlines; e-notation normalised
  (:func:`openrlhf_lpo.rewards.extraction.normalize_math`).
* **Answer**: the text after the last ``</think>`` (none if a ``<think>`` is left open). With
  ``boxes="last"`` (the default, Qwen2.5-Math's rule) only the **last** ``\\boxed{}``/``\\fbox{}`` is
  graded, so ``\\boxed{12} ... no: \\boxed{13}`` answers 13, with two refinements:

  - **A list of boxes is one answer** when the gold has several parts
    (:func:`~openrlhf_lpo.rewards.extraction.answer_parts`): the boxes that end the text separated only
    by list glue (:func:`~openrlhf_lpo.rewards.extraction.box_list`: ``\\boxed{(1, 2)}, \\boxed{(2, 1)}``,
    ``\\boxed{k = 45} and \\boxed{n = 2}``, ``x = \\boxed{2} or x = \\boxed{3}``) are graded together
    as ``\\boxed{(1, 2), (2, 1)}``. A correction (``no:``, ``or rather``, any other words) still takes
    the last box, and so does a one-part gold.
  - **A closing "The final answer is $X$"** after the last box (lm-eval's Minerva format, intermediate
    results boxed on the way) is the answer.

  ``boxes="all"`` is math-verify's own behaviour: every box of the text is read and several boxes
  become a set ({12, 13} matches neither). Without any box the whole text goes to math-verify (it finds
  ``$...$`` and plain expressions) unless ``require_box``: then there is no answer (``no_answer``),
  the box-required policy of verl's math reward, NeMo-Skills and DeepScaleR.
* **Forms** (issue 44): gold and box content are read through
  :func:`~openrlhf_lpo.rewards.extraction.normalize_math` (e-notation, a tidied end: stray backslashes,
  line breaks, a full stop, squared unit abbreviations, degrees); a condition is compared with a set
  (math-verify's ``allow_set_relation_comp``: ``x > 2`` is ``(2,\\infty)``); solutions whose grouping the
  parse lost are regrouped and conditions joined by "or" compared as a union
  (:mod:`~openrlhf_lpo.rewards.answer_forms`). Units are dropped, never converted.
* **Numbers are compared relatively**: math-verify rounds floats to 6 decimal places before comparing,
  so any two numbers below 5e-7 are "equal" (Minerva's ``2.88e-19`` accepted ``2.88e-18``, or 0). A
  verdict of "equal" between two plain numbers must also hold to a relative tolerance of
  :data:`REL_TOL` (1e-4, Qwen2.5-Math's ``numeric_equal``); this only ever turns a match into a mismatch.
* **Fast path**: when the graded box content (one box, or a list joined with ", ") is exactly the gold string (whitespace-stripped) and
  the gold parses, the answer is correct without calling ``verify``. This is the same verdict the full
  path gives (math-verify's ``verify`` is reflexive on every staged gold; tested on all of them with
  both paths), so ``fast_path=False`` never changes a verdict, it only costs time.

Call :func:`grade_math_inprocess` directly only for trusted input: math-verify can hang forever
(Math-Verify #65). The worker pool (:mod:`openrlhf_lpo.rewards.grader_pool`) runs it with a hard kill.
"""

from __future__ import annotations

import functools

from .answer_forms import same_answer_form, solution_groups
from .extraction import (
    answer_parts,
    box_list,
    boxed_spans,
    final_answer_text,
    final_statement,
    last_boxed,
    normalize_math,
    normalize_text,
)
from .grade_result import GradeResult

__all__ = ["BOX_RULES", "REL_TOL", "grade_math_inprocess", "math_prediction_text", "warm_up"]

BOX_RULES = ("last", "all")
REL_TOL = 1e-4


def _check_rule(boxes: str) -> str:
    if boxes not in BOX_RULES:
        raise ValueError(f"boxes must be one of {BOX_RULES}, got {boxes!r}")
    return boxes


@functools.lru_cache(maxsize=2048)
def _parse(text: str):
    """math-verify's parse of ``text``; cached because groups of samples often repeat short answers."""
    from math_verify import parse

    return parse(text, parsing_timeout=None)


def _parse_box(content: str):
    """math-verify's parse of ``\\boxed{content}``, its solutions regrouped when the parse merged them
    (:func:`~openrlhf_lpo.rewards.answer_forms.solution_groups`)."""
    parsed = _parse("\\boxed{" + content + "}")
    regrouped = solution_groups(content, parsed[0]) if parsed else None
    return (_parse("\\boxed{" + regrouped + "}") or parsed) if regrouped else parsed


def _parse_gold(gold: str):
    """The gold wrapped as ``\\boxed{gold}`` (an answer box with the same content shares the cache entry)."""
    return _parse_box(normalize_math(gold))


def _normalize_all_boxes(text: str) -> str:
    """``text`` with every outermost box's content normalised and the rest treated as free text."""
    out, pos = [], 0
    for start, end, content in sorted(boxed_spans(text)):
        if start < pos:
            continue  # nested in a box already rewritten
        head = text[start : text.index("{", start) + 1]  # "\boxed{"
        out.append(normalize_text(text[pos:start]))
        out.append(head + normalize_math(content) + "}")
        pos = end
    out.append(normalize_text(text[pos:]))
    return "".join(out)


def math_prediction_text(text: str, gold: str = "", boxes: str = "last",
                         require_box: bool = False) -> tuple[str | None, str | None, bool]:
    """What math-verify reads for a final-answer text: ``(text or None, extracted or None, from_box)``.

    ``None`` text: no answer (``require_box`` and no box). ``extracted`` is the graded box content (a list
    of boxes joined with ", "), or a closing statement's answer; ``from_box`` says it is box content
    (the fast path compares only box content with the gold).
    """
    if _check_rule(boxes) == "all":
        if require_box and not boxed_spans(text):
            return None, None, False
        single = text.count("\\boxed") == 1 and "\\fbox" not in text  # math-verify reads \boxed only
        return _normalize_all_boxes(text), (last_boxed(text) or "").strip() if single else None, single
    run = box_list(text)
    if not run:
        return (None, None, False) if require_box else (normalize_text(text), None, False)
    if not require_box:
        statement = final_statement(text, run[-1][1])
        if statement is not None:
            return normalize_text(statement), statement.strip("$").strip(), False
    if len(run) > 1 and answer_parts(gold) > 1:
        contents = [c.strip() for _, _, c in run]
        return "\\boxed{" + ", ".join(normalize_math(c) for c in contents) + "}", ", ".join(contents), True
    box = last_boxed(text)  # the last box by opening position (the inner one of nested boxes)
    return "\\boxed{" + normalize_math(box) + "}", box.strip(), True


def _repr(parsed) -> str | None:
    return str(parsed[-1]) if parsed else None


def grade_math_inprocess(response: str, gold: str, fast_path: bool = True, boxes: str = "last",
                         require_box: bool = False) -> GradeResult:
    """Grade ``response`` against ``gold`` here, with math-verify and **no timeout at all**.

    See the module docstring for the rules. Statuses: ``no_answer`` (open ``<think>``, nothing
    parsable, no box when ``require_box``), ``error`` (the gold does not parse, or math-verify raised),
    ``ok``.
    """
    _check_rule(boxes)
    text = final_answer_text(response)
    if text is None:
        return GradeResult(False, "no_answer", None)
    pred_text, extracted, from_box = math_prediction_text(text, gold, boxes, require_box)
    if pred_text is None:
        return GradeResult(False, "no_answer", None)
    try:
        if fast_path and from_box and extracted == gold.strip():
            return GradeResult(True, "ok", extracted) if _parse_gold(gold) else GradeResult(False, "error", None)
        gold_parsed = _parse_gold(gold)
    except Exception:
        return GradeResult(False, "error", None)
    if not gold_parsed:
        return GradeResult(False, "error", None)
    box = extracted if boxes == "last" else None
    try:
        pred = _parse_box(pred_text[len("\\boxed{") : -1]) if from_box and pred_text.startswith("\\boxed{") \
            else _parse(pred_text)
    except Exception:
        return GradeResult(False, "error", box)
    if not pred:
        return GradeResult(False, "no_answer", box)
    extracted = box if box is not None else _repr(pred)
    from math_verify import verify

    try:
        ok = verify(gold_parsed, pred, timeout_seconds=None, allow_set_relation_comp=True) and _numbers_agree(
            gold_parsed[0], pred[0])
    except Exception:
        return GradeResult(False, "error", extracted)
    if not ok:  # conditions joined by "or" for a union of intervals (answer_forms)
        ok = same_answer_form(gold_parsed[0], pred[0], box if box is not None else pred_text)
    return GradeResult(bool(ok), "ok", extracted)


def _as_float(expr) -> float | None:
    """``expr`` as a float when it is a plain real number (no symbols, sets, relations), else None."""
    try:
        if not getattr(expr, "is_number", False) or getattr(expr, "is_Relational", False):
            return None
        value = complex(expr.evalf(30))
    except Exception:
        return None
    if value.imag != 0 or value.real != value.real or value.real in (float("inf"), float("-inf")):
        return None
    return value.real


def _numbers_agree(gold, pred) -> bool:
    """False only when both are plain numbers that differ by more than :data:`REL_TOL` (relative)."""
    a, b = _as_float(gold), _as_float(pred)
    if a is None or b is None:
        return True
    return abs(a - b) <= REL_TOL * max(abs(a), abs(b))


# Inputs that load sympy's lazily imported parts (simplify, sets, trig, relations) before a worker reports
# ready, so a fresh worker's first real item is not charged for imports against its timeout.
_WARMUP = (
    ("\\boxed{1}", "1"),
    ("so \\boxed{(x+1)^2}", "x^2+2x+1"),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\sin(\\pi/4)"),
    ("\\boxed{[1, 2)}", "[1,2)"),
    ("\\boxed{x=3}", "3"),
    ("\\boxed{1,2}", "\\{2, 1\\}"),
    ("\\boxed{10\\%}", "0.1"),
    ("\\boxed{4.5 \\times 10^{33}}", "4.5e33"),
    ("\\boxed{x < 2 \\text{ or } x > 3}", "(-\\infty, 2) \\cup (3, \\infty)"),  # as_set: sympy's inequality solver
    ("\\boxed{p=5,q=2;p=7,q=2}", "p = 5, q = 2 \\quad \\text{and} \\quad p = 7, q = 2"),
)


def warm_up() -> None:
    """Import and exercise math-verify once (worker start-up), then drop the parse cache."""
    import logging

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    for response, gold in _WARMUP:
        grade_math_inprocess(response, gold, fast_path=False)
    _parse.cache_clear()
