"""Pass@k metrics.

Pass@k is the unbiased estimator of Chen et al. (2021, "Evaluating Large Language Models Trained on
Code", Eq. 1): with ``n`` samples of which ``c`` are correct,
``pass@k = 1 - C(n-c, k) / C(n, k)``, the probability that a random k-subset of the n samples holds at
least one correct sample. Pass@1 equals the mean accuracy ``c / n``. Benchmark scores average it over
problems.
"""

from __future__ import annotations

import math
from typing import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem: ``1 - C(n-c, k) / C(n, k)`` (exact integer binomials)."""
    for name, v in (("n", n), ("c", c), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} must be an int, got {v!r}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 0 <= c <= n:
        raise ValueError(f"c must be in [0, n={n}], got {c}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}] (Pass@k needs at least k samples), got {k}")
    if n - c < k:
        return 1.0
    # exact rational arithmetic; one float division at the end
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def benchmark_pass_at_k(correct: Sequence[Sequence[bool]], ks: Sequence[int] | None = None) -> dict[int, float]:
    """Mean over problems of :func:`pass_at_k`; ``correct[p][j]`` is sample j of problem p.

    Every problem must have the same number of samples n; ``ks`` defaults to ``1..n``.
    """
    if not correct:
        raise ValueError("correct is empty: no problems to score")
    n = len(correct[0])
    if any(len(row) != n for row in correct):
        raise ValueError("every problem must have the same number of samples n")
    ks = list(range(1, n + 1)) if ks is None else list(ks)
    out = {}
    for k in ks:
        out[k] = sum(pass_at_k(n, sum(bool(x) for x in row), k) for row in correct) / len(correct)
    return out


def column_accuracy_std(correct: Sequence[Sequence[bool]]) -> float:
    """Std (ddof=0) over sample columns j of the accuracy of column j: the spread of single-sample runs."""
    n = len(correct[0])
    accs = [sum(bool(row[j]) for row in correct) / len(correct) for j in range(n)]
    mean = sum(accs) / n
    return math.sqrt(sum((a - mean) ** 2 for a in accs) / n)
