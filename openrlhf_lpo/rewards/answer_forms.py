"""Answer forms math-verify parses but does not equate with the gold's form (sympy only, no math-verify import).

Two rules, each for one form a model or a gold writes:

* **Conditions joined by "or" for a union of intervals.** math-verify compares one condition with a set
  (``x > 2`` with ``(2,\\infty)``, ``-2 \\le x \\le 7`` with ``x \\in [-2, 7]``: its ``allow_set_relation_comp``,
  which the grader turns on), but it parses ``x < 2 \\text{ or } x > 3`` as a list of two conditions. When the
  answer text says "or" (``or``, ``\\lor``, ``\\vee``) and every item is a condition on the same one variable,
  the union of their solution sets (sympy's ``as_set``) must equal the gold's set of reals exactly, open and
  closed ends included. A list without "or" (``x > 0, x < 5``) is left to math-verify: it could mean "and".
* **Solutions whose grouping the parse lost.** ``p = 5, q = 2 \\quad\\text{and}\\quad p = 7, q = 2`` (a gold,
  or an answer) parses to the flat set {p = 5, q = 2, p = 7}: math-verify reads ``\\quad`` and "and" as commas,
  so a variable given two values merges the solutions. :func:`solution_groups` rewrites such a text with its
  solutions separated by ``;`` (``p = 5, q = 2; p = 7, q = 2``), which math-verify parses as a set of
  solutions {(p = 5, q = 2), (p = 7, q = 2)}: then ``p=5,q=2;p=7,q=2`` matches and ``p=5,q=3;p=7,q=2`` does not.
"""

from __future__ import annotations

import re

__all__ = ["same_answer_form", "solution_groups"]

_OR_RE = re.compile(r"\bor\b|\\lor\b|\\vee\b", re.I)


def _is_condition(expr) -> bool:
    """An inequality, or a conjunction of inequalities (``-2 <= x <= 7`` parses to an ``And``)."""
    from sympy import And
    from sympy.core.relational import Relational

    if isinstance(expr, Relational):
        return expr.rel_op in ("<", "<=", ">", ">=")
    return isinstance(expr, And) and all(_is_condition(a) for a in expr.args)


def _is_real_set(expr) -> bool:
    """An interval, a union of intervals, or all the reals."""
    from sympy import S
    from sympy.sets.sets import Interval, Union

    if isinstance(expr, Union):
        return all(isinstance(a, Interval) for a in expr.args)
    return isinstance(expr, Interval) or expr == S.Reals


def _real_set(expr):
    """The set of reals ``expr`` is, or ``x \\in`` (parsed as ``Eq(x, set)``); None for anything else."""
    from sympy import Eq, Symbol

    if isinstance(expr, Eq) and isinstance(expr.lhs, Symbol) and _is_real_set(expr.rhs):
        return expr.rhs
    return expr if _is_real_set(expr) else None


def _union_of_conditions(expr, text: str):
    """The solution set of conditions on one variable listed with "or" in ``text`` (else None)."""
    from sympy import FiniteSet, Union

    if not (isinstance(expr, FiniteSet) and len(expr) > 1 and _OR_RE.search(text or "")):
        return None
    parts = list(expr.args)
    if not all(_is_condition(p) for p in parts) or len(set().union(*(p.free_symbols for p in parts))) != 1:
        return None
    return Union(*(p.as_set() for p in parts))


def _union_matches(gold, pred, pred_text: str) -> bool:
    gold_set = _real_set(gold)
    if gold_set is None:
        return False
    pred_set = _union_of_conditions(pred, pred_text)
    return pred_set is not None and bool(gold_set == pred_set)


def _flat_equations(expr):
    """The equations of a set of equations (``None`` if it holds anything else)."""
    from sympy import Eq, FiniteSet

    if isinstance(expr, FiniteSet) and expr.args and all(isinstance(a, Eq) for a in expr.args):
        return list(expr.args)
    return None


# between two solutions: \quad, \qquad, ";", "and" / "or" (as words or in \text{})
_GROUP_SEP_RE = re.compile(r"\\q?quad\b|;|\\text\s*\{\s*(?:and|or)\s*\}|(?<![\w\\])(?:and|or)(?!\w)")


def solution_groups(text: str, parsed) -> str | None:
    """``text`` with its solutions separated by ``;`` when its parse ``parsed`` merged them, else None.

    Merged: a set of equations in two or more variables, one of them with two values (``p = 5`` and ``p = 7``;
    the roots of one variable, ``x = 2, x = -3``, are a set already and stay as they are). ``text`` is a
    gold or a box's content; the groups are the pieces between ``\\quad``, ``;``, "and", "or".
    """
    eqs = _flat_equations(parsed)
    if eqs is None:
        return None
    names = [e.lhs for e in eqs]
    if len(set(names)) < 2 or len(names) == len(set(names)):
        return None  # the roots of one variable (x = 2, x = -3) are a set already
    groups = [g.strip(" ,") for g in _GROUP_SEP_RE.split(text)]
    groups = [g for g in groups if g]
    return "; ".join(groups) if len(groups) > 1 else None


def same_answer_form(gold, pred, pred_text: str = "") -> bool:
    """True when ``pred`` is conditions joined by "or" whose solution set is the gold's (parsed sympy objects).

    ``pred_text`` is the answer text that was parsed (it says whether a list of conditions is joined by "or").
    Never raises: anything sympy cannot decide is False.
    """
    try:
        return _union_matches(gold, pred, pred_text)
    except Exception:
        return False
