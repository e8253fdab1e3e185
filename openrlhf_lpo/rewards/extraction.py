"""Answer extraction: which part of a response is graded, its boxes, and LaTeX normalisation.

Pure python, safe anywhere (no sympy, nothing that can hang).

* **Reasoning blocks.** Only the text after the last ``</think>`` is graded; a ``<think>`` that is never
  closed means the reasoning did not finish, so there is no answer. A ``<think>`` can be opened by the
  prompt (the ``r1`` template ends with ``Assistant: <think>``, R1-distill chat templates end with
  ``<think>\\n``): :func:`assistant_text` puts that opening back in front of the response before grading.
* **Boxes.** :func:`last_boxed` is the content of the last closed ``\\boxed{...}`` / ``\\fbox{...}``
  (braces balanced); Qwen2.5-Math's rule grades that box alone. A stray backslash before the closing
  brace (``\\boxed{185\\}``, a model escaping its own brace) is not part of the content.
  :func:`outer_boxes` lists the outermost boxes (a nested box belongs to the one around it).
* **Several boxes as one answer.** :func:`answer_parts` counts the parts of a gold (``(1,2),(2,1)``,
  ``k = 45, n = 2``: top-level commas, semicolons, ``\\quad``, "and"/"or"); :func:`box_list` is the run
  of boxes that ends the text when only list glue separates them (commas, spacing, math delimiters,
  "and"/"or", part labels, ``y_2 =`` prefixes): ``\\boxed{1}, \\boxed{2}`` is a list,
  ``\\boxed{12} no: \\boxed{13}`` and ``\\boxed{12}, or rather \\boxed{13}`` are corrections.
* **A closing statement.** :func:`final_statement` finds "The final answer is $X$" written after the
  last box (lm-eval's Minerva format, with intermediate results boxed on the way).
* **Scientific notation.** math-verify reads ``4.5e33`` as ``4.5 * e * 33`` (Euler's number), so golds
  and answers written that way (58 of Minerva's 272 golds) never match ``4.5 \\times 10^{33}``.
  :func:`normalize_math` rewrites e-notation numbers as ``4.5\\times10^{33}`` (and LaTeX's ``~`` space,
  which makes math-verify drop what precedes a unit, as a plain space).
* **The end of an answer** (issue 44): :func:`normalize_math` also drops what ends an answer but is not part
  of it (a stray backslash, a line break, a full stop, a squared unit abbreviation after a number, the
  scale after degrees) and reads ``°`` as ``^\\circ`` and ``\\lor`` / ``\\vee`` as ``\\text{ or }``.
"""

from __future__ import annotations

import re

__all__ = [
    "THINK_OPEN",
    "THINK_CLOSE",
    "assistant_text",
    "boxed_spans",
    "final_answer_text",
    "last_boxed",
    "answer_parts",
    "box_list",
    "final_statement",
    "outer_boxes",
    "split_answer",
    "normalize_math",
    "normalize_text",
    "prompt_opens_think",
]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def prompt_opens_think(prompt: str | None) -> bool:
    """True when ``prompt`` ends inside a ``<think>`` block (its last ``<think>`` is not closed)."""
    if not prompt:
        return False
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


def assistant_text(response: str, prompt: str | None = None) -> str:
    """The assistant's turn as graded: ``<think>`` + ``response`` when the prompt opened the block."""
    return THINK_OPEN + response if prompt_opens_think(prompt) else response


def final_answer_text(response: str) -> str | None:
    """The part of ``response`` that is graded.

    Text after the last ``</think>`` for reasoning models; ``None`` when a ``<think>`` block is opened
    and never closed (truncated reasoning has no answer); otherwise the whole response.
    """
    idx = response.rfind(THINK_CLOSE)
    if idx >= 0:
        return response[idx + len(THINK_CLOSE) :]
    if THINK_OPEN in response:
        return None
    return response


_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")


def _closing_brace(text: str, start: int) -> int | None:
    """Index of the ``}`` that closes a group whose content begins at ``start`` (None if unclosed)."""
    depth = 1
    for pos in range(start, len(text)):
        ch = text[pos]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return pos
    return None


def _content(text: str, start: int, end: int) -> str:
    """A box's content ``text[start:end]`` without a stray trailing backslash (``185\\`` of ``\\boxed{185\\}``)."""
    content = text[start:end]
    tail = len(content) - len(content.rstrip("\\"))
    return content[:-1] if tail % 2 else content  # an even run is LaTeX's ``\\\\`` (a line break): kept


def boxed_spans(text: str) -> list[tuple[int, int, str]]:
    """Every closed ``\\boxed{...}`` / ``\\fbox{...}``: ``(start, end, content)``, in order of their end.

    Nested boxes are reported too (the inner one first).
    """
    out = []
    for m in _BOX_RE.finditer(text):
        end = _closing_brace(text, m.end())
        if end is not None:
            out.append((m.start(), end + 1, _content(text, m.end(), end)))
    return sorted(out, key=lambda s: (s[1], s[0]))


def outer_boxes(text: str) -> list[tuple[int, int, str]]:
    """The closed boxes not nested in another box, in order: ``(start, end, content)``."""
    out: list[tuple[int, int, str]] = []
    for span in sorted(boxed_spans(text)):
        if out and span[0] < out[-1][1]:
            continue  # inside the previous outer box
        out.append(span)
    return out


def last_boxed(text: str) -> str | None:
    """Content of the last closed ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``; braces balanced.

    "Last" is by opening position: for ``\\boxed{a \\boxed{b}}`` it is ``b``.
    """
    for m in reversed(list(_BOX_RE.finditer(text))):
        end = _closing_brace(text, m.end())
        if end is not None:
            return _content(text, m.end(), end)
    return None


# A decimal number in e-notation: 4.5e33, 3e8, 1.04e-3, 2.E+5, .5e3. Not part of a longer token
# (x2e3, 1e5x, 1.2.3e4) and with digits right after the e, so 2e, e^{2}, 2e\pi are left alone.
_SCI_RE = re.compile(r"(?<![\w.])(\d+(?:\.\d*)?|\.\d+)[eE]([-+]?\d+)(?!\w|\.\d)")
# Math-mode delimiters for normalize_text: $, $$, \( \), \[ \]
_MATH_DELIM_RE = re.compile(r"(?<!\\)\$\$?|\\\(|\\\)|\\\[|\\\]")


def _sci_latex(m: re.Match) -> str:
    mantissa, exp = m.group(1), m.group(2)
    if mantissa.startswith("."):
        mantissa = "0" + mantissa
    mantissa = mantissa.rstrip(".")
    sign = "-" if exp.startswith("-") else ""
    digits = exp.lstrip("+-").lstrip("0") or "0"
    return f"{mantissa}\\times10^{{{sign}{digits}}}"


# a unit abbreviation squared or cubed at the end of an answer, after a number: "15 cm^2", "864 in^{2}"
# (math-verify drops "cm" but reads "cm^2" as c*m^2); one-letter units (m, g, s) could be variables: left alone
_UNIT_POWER_RE = re.compile(r"(?<=[\d}])\s*(?:mm|cm|km|in|ft|yd|mi|units?)\s*\^\s*(?:\{\s*[23]\s*\}|[23])$")


# degrees Celsius / Fahrenheit at the end: "30^\circ C", "30^{\circ}\mathrm{F}" (math-verify reads C as a variable)
_DEGREES_END_RE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?\s*(?:\\(?:mathrm|text)\s*\{\s*[CF]\s*\}|[CF])$")
# a logical or between two conditions
_LOGICAL_OR_RE = re.compile(r"\s*\\(?:lor|vee)(?![A-Za-z])\s*")
# the degree sign, with the scale it may carry: "30°", "30 °C"
_DEGREE_SIGN_RE = re.compile(r"\s*\u00b0\s*(?:[CF](?![A-Za-z]))?")


def _tidy_end(latex: str) -> str:
    """An answer without what ends it but is not part of it.

    A stray backslash (``185\\`` of a model escaping its closing brace, or a gold stored that way), a LaTeX
    line break ``\\\\`` or ``\\ `` space, a sentence's full stop (``(2,\\infty).``, ``5.``; not an ellipsis), a
    squared or cubed unit abbreviation after a number, the scale after degrees (``30^\\circ C``).
    """
    s = latex.rstrip()
    while s.endswith("\\"):
        run = len(s) - len(s.rstrip("\\"))
        s = s[: len(s) - (1 if run % 2 else run)].rstrip()  # a stray one first, then whole line breaks
    if len(s) > 1 and s.endswith(".") and s[-2] != ".":  # not an ellipsis
        s = s[:-1].rstrip()
    return _DEGREES_END_RE.sub(r"^\\circ", _UNIT_POWER_RE.sub("", s))


def normalize_math(latex: str) -> str:
    """A LaTeX answer (a box's content, a gold) as math-verify should read it.

    E-notation as ``\\times10^{n}``, ``~`` as a space, ``°`` as ``^\\circ``, a logical or (``\\lor``, ``\\vee``,
    which math-verify misreads: ``x < 2 \\lor x > 3`` parsed as 3) as ``\\text{ or }``, and the end tidied
    (:func:`_tidy_end`: stray backslashes, line breaks, a full stop, a squared unit, a degree scale).
    """
    latex = _LOGICAL_OR_RE.sub(r" \\text{ or } ", _SCI_RE.sub(_sci_latex, latex).replace("~", " "))
    return _tidy_end(_DEGREE_SIGN_RE.sub(r"^\\circ", latex))


def normalize_text(text: str) -> str:
    """Free text with e-notation numbers rewritten: ``$a\\times10^{n}$`` outside math mode, bare inside it.

    Outside math mode math-verify reads ``4.5e33`` as 4.5 and ``4.5\\times10^{33}`` as 4.5 too; wrapped in
    ``$...$`` it reads the number.
    """
    if not _SCI_RE.search(text):
        return text
    out, pos, in_math = [], 0, False
    for m in _MATH_DELIM_RE.finditer(text):
        seg = text[pos : m.start()]
        out.append(_SCI_RE.sub(_sci_latex, seg) if in_math else _SCI_RE.sub(lambda x: "$" + _sci_latex(x) + "$", seg))
        out.append(m.group())
        tok = m.group()
        in_math = (not in_math) if tok.startswith("$") else tok in ("\\(", "\\[")
        pos = m.end()
    seg = text[pos:]
    out.append(_SCI_RE.sub(_sci_latex, seg) if in_math else _SCI_RE.sub(lambda x: "$" + _sci_latex(x) + "$", seg))
    return "".join(out)


# -- several boxes that are one answer -----------------------------------------------------------

_WRAP_RE = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
# "y_2 =", "x_{1}=", "n =" (a name and "=" written between two boxes of a list)
_ASSIGN_RE = re.compile(r"(?<![A-Za-z\\])[A-Za-z](?:_\{?\w+\}?)?(?:\^\{?\w+\}?)?\s*=")
_LABEL_RE = re.compile(r"\(\s*(?:[a-z]|[ivx]+|\d)\s*\)")  # part labels: (a), (ii), (1)
_GLUE_MARKS_RE = re.compile(r"\\(?:quad|qquad|[,;:! ]|\\)|\\[()\[\]]|\\(?:left|right)\.?|\$|~|&|\*\*|[,;.:]")
_GLUE_WORDS = frozenset(
    "and or also as well for part parts the solution solutions root roots answer answers are is case cases "
    "respectively both values value pair pairs".split()
)
MAX_GLUE = 80  # characters between two boxes of a list


def _unwrap_text(s: str) -> str:
    for _ in range(3):
        s2 = _WRAP_RE.sub(r" \1 ", s)
        if s2 == s:
            break
        s = s2
    return s


def is_list_glue(between: str) -> bool:
    """True when ``between`` (the text between two boxes) only separates items of a list."""
    if len(between) > MAX_GLUE:
        return False
    s = _LABEL_RE.sub(" ", _ASSIGN_RE.sub(" ", _unwrap_text(between)))
    words = _GLUE_MARKS_RE.sub(" ", s).split()
    return all(w.lower() in _GLUE_WORDS for w in words)


def box_list(text: str) -> list[tuple[int, int, str]]:
    """The outermost boxes that end ``text`` as one list (at least the last box; [] without boxes)."""
    boxes = outer_boxes(text)
    if not boxes:
        return []
    run = [boxes[-1]]
    for prev in reversed(boxes[:-1]):
        if not is_list_glue(text[prev[1] : run[0][0]]):
            break
        run.insert(0, prev)
    return run


_OPEN, _CLOSE = "([{", ")]}"
_MATH_DOLLAR_RE = re.compile(r"(?<!\\)\$")  # a math delimiter, not an escaped dollar sign
# one number written with thousands separators, the whole answer: 10,455; 10,\!080; \$32,\!348; 1,000.5
_THOUSANDS_RE = re.compile(r"^[-+]?(?:\\\$)?\d{1,3}(?:,(?:\\!\s*)?\d{3})+(?:\.\d+)?$")
_PART_SEP_RE = re.compile(r",|;|\\q?quad|\s(?:and|or)\s")


def _strip_outer_set(s: str) -> str:
    """``{1,2,3}`` / ``\\{1,2,3\\}`` / ``\\left\\{ ... \\right\\}`` -> ``1,2,3`` (one group around everything)."""
    s = s.replace("\\left", "").replace("\\right", "").strip()
    for op, cl in (("\\{", "\\}"), ("{", "}")):
        if s.startswith(op) and s.endswith(cl):
            inner = s[len(op) : len(s) - len(cl)]
            depth = 0
            for ch in inner:
                depth += (ch in _OPEN) - (ch in _CLOSE)
                if depth < 0:
                    break
            else:
                if depth == 0:
                    return inner.strip()
    return s


def split_answer(answer: str) -> list[str]:
    """The parts an answer lists at the top level: ``(1,2),(2,1)`` -> ``["(1,2)", "(2,1)"]``, ``(1, 2)`` -> one.

    Separators outside brackets: ``,``, ``;``, ``\\quad``, " and ", " or "; an answer that is one number with
    thousands separators (``10,455``, ``10,\\!080``) is one part.
    """
    s = _strip_outer_set(_unwrap_text(_MATH_DOLLAR_RE.sub("", answer)))
    if _THOUSANDS_RE.match(s.strip()):
        return [s.strip()]
    parts, depth, cur = [], 0, []
    pos = 0
    while pos < len(s):
        ch = s[pos]
        if ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth = max(0, depth - 1)
        elif depth == 0:
            m = _PART_SEP_RE.match(s, pos)
            if m:
                parts.append("".join(cur))
                cur = []
                pos = m.end()
                continue
        cur.append(ch)
        pos += 1
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def answer_parts(answer: str) -> int:
    """How many parts an answer lists (:func:`split_answer`): ``(1,2),(2,1)``: 2; ``(1, 2)``: 1; ``k=45, n=2``: 2."""
    return len(split_answer(answer))


# "The final answer is $10,455$." / "Final Answer: $x^2$" (a math-delimited answer or a plain number)
_STATEMENT_RE = re.compile(
    r"final answer(?:\s+is|\s*:)(?:\s*the final answer is)?\s*:?\s*"
    r"(\$\$?(?:\\.|[^$\\])+\$\$?|\\\((?:(?!\\\)).)+\\\)|-?\d[\d,]*(?:\.\d+)?(?![\w.]))",
    re.I | re.S,
)


def final_statement(text: str, after: int = 0) -> str | None:
    """The answer of the last "final answer is $X$" statement in ``text[after:]`` (``$X$`` kept), or None."""
    found = None
    for m in _STATEMENT_RE.finditer(text, after):
        found = m.group(1)
    return found
