"""Answer extraction: which part of a response is graded, its boxes, and LaTeX normalisation.

Pure python, safe anywhere (no sympy, nothing that can hang).

* **Reasoning blocks.** Only the text after the last ``</think>`` is graded; a ``<think>`` that is never
  closed means the reasoning did not finish, so there is no answer. A ``<think>`` can be opened by the
  prompt (the ``r1`` template ends with ``Assistant: <think>``, R1-distill chat templates end with
  ``<think>\\n``): :func:`assistant_text` puts that opening back in front of the response before grading.
* **Boxes.** :func:`last_boxed` is the content of the last closed ``\\boxed{...}`` / ``\\fbox{...}``
  (braces balanced); Qwen2.5-Math's rule grades that box alone.
* **Scientific notation.** math-verify reads ``4.5e33`` as ``4.5 * e * 33`` (Euler's number), so golds
  and answers written that way (58 of Minerva's 272 golds) never match ``4.5 \\times 10^{33}``.
  :func:`normalize_math` rewrites e-notation numbers as ``4.5\\times10^{33}`` (and LaTeX's ``~`` space,
  which makes math-verify drop what precedes a unit, as a plain space).
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


def boxed_spans(text: str) -> list[tuple[int, int, str]]:
    """Every closed ``\\boxed{...}`` / ``\\fbox{...}``: ``(start, end, content)``, in order of their end.

    Nested boxes are reported too (the inner one first).
    """
    out = []
    for m in _BOX_RE.finditer(text):
        end = _closing_brace(text, m.end())
        if end is not None:
            out.append((m.start(), end + 1, text[m.end() : end]))
    return sorted(out, key=lambda s: (s[1], s[0]))


def last_boxed(text: str) -> str | None:
    """Content of the last closed ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``; braces balanced.

    "Last" is by opening position: for ``\\boxed{a \\boxed{b}}`` it is ``b``.
    """
    for m in reversed(list(_BOX_RE.finditer(text))):
        end = _closing_brace(text, m.end())
        if end is not None:
            return text[m.end() : end]
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


def normalize_math(latex: str) -> str:
    """A LaTeX answer (a box's content, a gold) with e-notation as ``\\times10^{n}`` and ``~`` as a space."""
    return _SCI_RE.sub(_sci_latex, latex).replace("~", " ")


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
