"""Multiple-choice grading: which option a response commits to. Pure python, cheap, cannot hang.

Explicit answers are, anywhere in the graded text (after the last ``</think>``):

* a ``\\boxed{}`` / ``\\fbox{}`` holding an option: ``C``, ``(C)``, ``\\text{C}``, ``C) Planetary days...``;
* ``answer is X`` ("The correct answer is: **C**", "the answer is (c)", after a qualifier: "the answer
  is for sure D", "the answer is definitely (B)", "the answer is option C");
* ``answer: X`` ("Answer: C", "Final Answer: C", "ANSWER: C", "**Answer:** (G)"), the letter also in
  quotes (``Answer: "C"``, ``answer is 'B'``).

**The last explicit answer wins** (a model that writes "the answer is A ... Final Answer: C" answers C).
The keyword is case-insensitive, and so is the letter inside a box, parentheses, ``$...$`` or
``\\text{}``; a bare lowercase letter counts only at the end of a line ("answer is a good guess" is not
an answer). **Hedges are wrong**: an explicit answer naming two or more options (``\\boxed{(C) and (D)}``,
``\\boxed{C, D}``, "the answer is B or C") is graded as that set of options, which never equals the gold.
A hedge stays a hedge when the answers after it are conditional restatements of its options ("The
answer is (A) or (B). If the gas is ideal, the answer is (A); ..."): an answer whose sentence says
if / when / assuming / unless / otherwise / would does not resolve the hedge.
Nothing else is read: never "the last capital letter anywhere".

**MMLU-Pro's chain** (``extraction="mmlu-pro"``, :func:`extract_choice_mmlu_pro`) is the extraction of
TIGER-AI-Lab/MMLU-Pro's evaluation scripts, written here from its documented steps: the first
"answer is (X)" / "answer is X", else the first line's last "Answer: X" (``[aA]nswer:``), else the
last standalone option letter anywhere. It reads stray letters (on real outputs it scores a few points
above the explicit chain); MMLU-Pro's scripts score a response without any letter as a random guess,
here it has no answer.
"""

from __future__ import annotations

import functools
import re

from .extraction import boxed_spans, final_answer_text
from .grade_result import GradeResult, check_text

__all__ = ["CHOICE_EXTRACTIONS", "CHOICE_LETTERS", "extract_choice", "extract_choice_mmlu_pro", "grade_choice"]

CHOICE_LETTERS = "ABCDEFGHIJ"

_TEXT_WRAP_RE = re.compile(r"\\(?:text|textbf|mathrm|mathbf|textrm|mbox|mathit|textit)\s*\{([^{}]*)\}")
_QUOTES = "\"'\u201c\u201d\u2018\u2019"
_SEP = r"(?:,|;|/|&|\\&|\band\b|\bor\b|\\text\{\s*(?:and|or)\s*\})"


def _unwrap(inner: str) -> str:
    s = inner
    for _ in range(3):  # \text{\textbf{C}} nests at most a couple of times
        s2 = _TEXT_WRAP_RE.sub(r"\1", s)
        if s2 == s:
            break
        s = s2
    s = s.replace("$", "").replace("\\,", " ").replace("\\ ", " ").replace("~", " ").replace("*", "").strip()
    return s.strip(_QUOTES).strip()


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


# Words between "answer is" and the letter that still commit to it: "the answer is for sure D"
_QUALIFIER = (
    r"(?:,?\s*(?i:for\s+sure|definitely|certainly|clearly|surely|indeed|therefore|thus|hence|obviously|"
    r"undoubtedly|most\s+likely|most\s+probably|probably|likely|actually|then|simply|still|now|also|"
    r"(?:the\s+)?(?:option|choice|letter))\b,?)"
)


@functools.lru_cache(maxsize=64)
def _text_pattern(allowed: str) -> re.Pattern:
    up = "[" + re.escape(allowed) + "]"
    anycase = "[" + re.escape(allowed + allowed.lower()) + "]"
    quote_open, quote_close = "[\"'\u201c\u2018]", "[\"'\u201d\u2019]"
    # an option token: wrapped or quoted (any case) or a bare capital; a bare lowercase letter only at a line's end
    tok = (
        r"(?:\(\s*" + anycase + r"\s*\)|\$\s*" + anycase + r"\s*\$|\\text(?:bf)?\{\s*" + anycase + r"\s*\}"
        r"|\*\*\s*" + anycase + r"\s*\*\*|" + quote_open + r"\s*" + anycase + r"\s*" + quote_close
        + r"|" + up + r"(?![\w'-])|" + anycase + r"(?=[ \t]*\.?[ \t]*(?:\n|$)))"
    )
    return re.compile(
        r"(?i:answer)(?:\s+is\s*:?|\s*[*_]*\s*:)(?:" + _QUALIFIER + r"){0,3}\s*[*_]*\s*"
        r"(" + tok + r"(?:\s*(?:,|/|&|\band\b|\bor\b)\s*(?:\(\s*" + up + r"\s*\)|" + up + r"(?![\w'-])))*)"
    )


# A sentence that only states an answer under a condition ("If the gas is ideal, the answer is (A)")
_CONDITIONAL = re.compile(
    r"\b(?:if|when|whether|assuming|assume|suppose|supposing|provided|unless|otherwise|in\s+case|depending|"
    r"depends|would)\b", re.I)
_SENTENCE_END = re.compile(r"[.!?;\n](?=\s|$)|\n")


def _conditional(text: str, start: int) -> bool:
    """Whether the sentence holding the answer that starts at ``start`` states a condition."""
    head = text[max(0, start - 300) : start]
    ends = list(_SENTENCE_END.finditer(head))
    sentence = head[ends[-1].end() :] if ends else head
    return bool(_CONDITIONAL.search(sentence))


def _pick(found: list[tuple[int, int, str]], text: str) -> str:
    """The last explicit answer, unless it only restates (conditionally) options of a hedge before it."""
    found.sort()
    pick = found[-1][2]
    for end, start, opts in reversed(found):
        if "," in opts:  # the hedge the later answers restate
            if all(_conditional(text, s) and set(o.split(",")) <= set(opts.split(","))
                   for e, s, o in found if e > end):
                return opts
            break
        if not _conditional(text, start):
            break  # an unconditional single answer after any hedge: it wins
    return pick


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
    found: list[tuple[int, int, str]] = []  # (end, start, options)
    for start, end, content in boxed_spans(text):
        pick = _choice_from_box(content, allowed)
        if pick is not None:
            found.append((end, start, pick))
    for m in _text_pattern(allowed).finditer(text):
        opts = _options_in(m.group(1), allowed)
        if opts:
            found.append((m.end(), m.start(), ",".join(opts)))
    if not found:
        return None
    return _pick(found, text)


def extract_choice_mmlu_pro(response: str, choices: str = CHOICE_LETTERS) -> str | None:
    """MMLU-Pro's extraction chain (module docstring) on the text after the last ``</think>``."""
    text = final_answer_text(response)
    if text is None:
        return None
    cls = "[" + re.escape(choices.upper()) + "]"
    m = re.search(r"answer is \(?(" + cls + r")\)?", text)  # the first one
    if m:
        return m.group(1)
    m = re.search(r"[^\n]*[aA]nswer:\s*(" + cls + ")", text)  # the first line with one, its last (greedy)
    if m:
        return m.group(1)
    letters = list(re.finditer(r"\b" + cls + r"\b", text))
    return letters[-1].group() if letters else None


# Answer extraction for multiple choice by name (``lpo-eval score --choice-extraction``).
CHOICE_EXTRACTIONS = {"explicit": extract_choice, "mmlu-pro": extract_choice_mmlu_pro}


def grade_choice(response: str, gold: str, choices: str | None = None, extraction: str = "explicit") -> GradeResult:
    """Grade a multiple-choice response against ``gold`` (a letter A-J, or a digit 1-9).

    ``choices`` restricts the accepted options (default: A-J for letter golds, 1-9 for digit golds).
    ``extraction``: a key of :data:`CHOICE_EXTRACTIONS` (``explicit``, the default, or ``mmlu-pro``).
    A hedge (two or more options) is graded wrong with status ``ok``; no explicit answer is
    ``no_answer``. Pure python and cheap, so it runs in the caller's process.
    """
    check_text("response", response)
    if extraction not in CHOICE_EXTRACTIONS:
        raise ValueError(f"choice extraction must be one of {', '.join(CHOICE_EXTRACTIONS)}, got {extraction!r}")
    gold_s = check_text("gold", gold).strip().upper()
    if len(gold_s) != 1 or not gold_s.isalnum():
        raise ValueError(f"gold must be a single option letter or digit, got {gold!r}")
    allowed = _allowed_choices(gold_s, choices)
    if gold_s not in allowed:
        raise ValueError(f"gold {gold!r} is not one of the allowed choices {allowed!r}")
    picked = CHOICE_EXTRACTIONS[extraction](response, allowed)
    if picked is None:
        return GradeResult(False, "no_answer", None)
    return GradeResult(picked == gold_s, "ok", picked)
