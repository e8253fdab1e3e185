"""Multiple-choice grading: which option a response commits to. Pure python, cheap, cannot hang.

Explicit answers are, anywhere in the graded text (after the last ``</think>``):

* a ``\\boxed{}`` / ``\\fbox{}`` holding an option: ``C``, ``(C)``, ``\\text{C}``, ``C) Planetary days...``;
* ``answer is X`` ("The correct answer is: **C**", "the answer is (c)");
* ``answer: X`` ("Answer: C", "Final Answer: C", "ANSWER: C", "**Answer:** (G)").

**The last explicit answer wins** (a model that writes "the answer is A ... Final Answer: C" answers C).
The keyword is case-insensitive, and so is the letter inside a box, parentheses, ``$...$`` or
``\\text{}``; a bare lowercase letter counts only at the end of a line ("answer is a good guess" is not
an answer). **Hedges are wrong**: an explicit answer naming two or more options (``\\boxed{(C) and (D)}``,
``\\boxed{C, D}``, "the answer is B or C") is graded as that set of options, which never equals the gold.
Nothing else is read: never "the last capital letter anywhere".
"""

from __future__ import annotations

import functools
import re

from .extraction import boxed_spans, final_answer_text
from .grade_result import GradeResult, check_text

__all__ = ["CHOICE_LETTERS", "extract_choice", "grade_choice"]

CHOICE_LETTERS = "ABCDEFGHIJ"

_TEXT_WRAP_RE = re.compile(r"\\(?:text|textbf|mathrm|mathbf|textrm|mbox|mathit|textit)\s*\{([^{}]*)\}")
_SEP = r"(?:,|;|/|&|\\&|\band\b|\bor\b|\\text\{\s*(?:and|or)\s*\})"


def _unwrap(inner: str) -> str:
    s = inner
    for _ in range(3):  # \text{\textbf{C}} nests at most a couple of times
        s2 = _TEXT_WRAP_RE.sub(r"\1", s)
        if s2 == s:
            break
        s = s2
    return s.replace("$", "").replace("\\,", " ").replace("\\ ", " ").replace("~", " ").replace("*", "").strip()


@functools.lru_cache(maxsize=64)
def _box_patterns(allowed: str) -> tuple[re.Pattern, re.Pattern, re.Pattern]:
    cls = "[" + re.escape(allowed + allowed.lower()) + "]"
    opt = r"\(?\s*(" + cls + r")\s*\)?"
    return (
        # only options and separators (whitespace counts as one): "(C) and (D)", "C, D", "A C"
        re.compile(r"^" + opt + r"(?:\s*(?:" + _SEP + r"|\s)\s*" + opt + r")+\s*\.?$", re.I),
        # options joined by explicit separators, then anything: "C and D are both correct"
        re.compile(r"^" + opt + r"(?:\s*" + _SEP + r"\s*" + opt + r")+(?![\w])", re.I),
        # one option, then the end or ")", ".", ":" (e.g. "C", "(C)", "C) Planetary days ...")
        re.compile(r"^\(?\s*(" + cls + r")\s*(?:\)|\.|:|$)"),
    )


def _options_in(span: str, allowed: str) -> list[str]:
    found = []
    for tok in re.findall(r"[A-Za-z0-9]+", re.sub(_SEP, " ", span)):
        t = tok.upper()
        if len(t) == 1 and t in allowed and t not in found:
            found.append(t)
    return found


def _choice_from_box(inner: str, allowed: str) -> str | None:
    s = _unwrap(inner)
    only, prefixed, single = _box_patterns(allowed)
    m = only.match(s) or prefixed.match(s)
    if m:
        opts = _options_in(m.group(0), allowed)
        return ",".join(opts) if opts else None
    m = single.match(s)
    if m:
        tok = m.group(1).upper()
        return tok if tok in allowed else None
    if re.fullmatch(r"[A-Z]{2,}", s) and all(ch in allowed for ch in s):  # "\boxed{AC}"
        return ",".join(dict.fromkeys(s))
    return None


@functools.lru_cache(maxsize=64)
def _text_pattern(allowed: str) -> re.Pattern:
    up = "[" + re.escape(allowed) + "]"
    anycase = "[" + re.escape(allowed + allowed.lower()) + "]"
    # an option token: wrapped (any case) or a bare capital; a bare lowercase letter only at a line's end
    tok = (
        r"(?:\(\s*" + anycase + r"\s*\)|\$\s*" + anycase + r"\s*\$|\\text(?:bf)?\{\s*" + anycase + r"\s*\}"
        r"|\*\*\s*" + anycase + r"\s*\*\*|" + up + r"(?![\w'-])|" + anycase + r"(?=[ \t]*\.?[ \t]*(?:\n|$)))"
    )
    return re.compile(
        r"(?i:answer)(?:\s+is\s*:?|\s*[*_]*\s*:)\s*[*_]*\s*"
        r"(" + tok + r"(?:\s*(?:,|/|&|\band\b|\bor\b)\s*(?:\(\s*" + up + r"\s*\)|" + up + r"(?![\w'-])))*)"
    )


def _allowed_choices(gold: str, choices: str | None) -> str:
    if choices is not None:
        return choices.upper()
    if gold.isdigit():
        return "123456789"
    letters = CHOICE_LETTERS
    if gold.isalpha() and gold not in letters:  # options beyond J
        letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    return letters


def extract_choice(response: str, choices: str = CHOICE_LETTERS) -> str | None:
    """The option a response commits to (``"C"``), a hedge (``"C,D"``), or ``None``.

    The last explicit answer (a box holding options, ``answer is X``, ``answer: X``) wins; see the
    module docstring. Only the text after the last ``</think>`` is read.
    """
    text = final_answer_text(response)
    if text is None:
        return None
    allowed = choices.upper()
    found: list[tuple[int, str]] = []
    for _start, end, content in boxed_spans(text):
        pick = _choice_from_box(content, allowed)
        if pick is not None:
            found.append((end, pick))
    for m in _text_pattern(allowed).finditer(text):
        opts = _options_in(m.group(1), allowed)
        if opts:
            found.append((m.end(), ",".join(opts)))
    if not found:
        return None
    return max(found, key=lambda f: f[0])[1]


def grade_choice(response: str, gold: str, choices: str | None = None) -> GradeResult:
    """Grade a multiple-choice response against ``gold`` (a letter A-J, or a digit 1-9).

    ``choices`` restricts the accepted options (default: A-J for letter golds, 1-9 for digit golds).
    A hedge (two or more options) is graded wrong with status ``ok``; no explicit answer is
    ``no_answer``. Pure python and cheap, so it runs in the caller's process.
    """
    check_text("response", response)
    gold_s = check_text("gold", gold).strip().upper()
    if len(gold_s) != 1 or not gold_s.isalnum():
        raise ValueError(f"gold must be a single option letter or digit, got {gold!r}")
    allowed = _allowed_choices(gold_s, choices)
    if gold_s not in allowed:
        raise ValueError(f"gold {gold!r} is not one of the allowed choices {allowed!r}")
    picked = extract_choice(response, allowed)
    if picked is None:
        return GradeResult(False, "no_answer", None)
    return GradeResult(picked == gold_s, "ok", picked)
