"""Uncertainty of benchmark scores: standard errors, and the paired bootstrap over problems.

A benchmark score is the mean over its P problems of a per-problem value x_i (the problem's Pass@k
estimate from its n samples; Pass@1 = c_i / n). With the problems taken as a sample from a population
of problems, its standard error is ``SE = s / sqrt(P)``, s the sample standard deviation (ddof 1) of
the x_i; it holds the sampling noise of the n samples too, since each x_i carries it (the clustered
standard error of Miller 2024, "Adding Error Bars to Evals", with a problem as the cluster). An
average over independent benchmarks has ``SE = sqrt(sum SE_b^2) / B``.

Two checkpoints on the same problems (``compare``): the paired differences ``d_i = y_i - x_i``,
``delta = mean(d)`` with ``SE = sd(d) / sqrt(P)``, and the paired bootstrap: R resamples of the P
problems with replacement (numpy's PCG64 from a fixed seed), the percentile interval of the resampled
mean of d, and the two-sided p-value of "no difference", the share of resampled means at least as far
from delta as delta is from 0 (the bootstrap distribution moved to the null; Efron & Tibshirani 1993,
ch. 16), counted as ``(1 + hits) / (1 + R)``.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

_CHUNK = 1 << 22  # indices drawn at once (32 MiB of int64)


def mean_stderr(values: Sequence[float]) -> float | None:
    """``sd(values, ddof=1) / sqrt(P)``; None for fewer than two values."""
    x = np.asarray(values, dtype=np.float64)
    if x.size < 2:
        return None
    return float(x.std(ddof=1) / math.sqrt(x.size))


def combined_stderr(stderrs: Sequence[float | None]) -> float | None:
    """SE of the mean of independent estimates with these SEs (None if any is None)."""
    if not stderrs or any(s is None for s in stderrs):
        return None
    return math.sqrt(sum(s * s for s in stderrs)) / len(stderrs)


def bootstrap_means(values: Sequence[float], resamples: int, seed: int) -> np.ndarray:
    """Means of ``resamples`` resamples of ``values`` with replacement (``numpy.random.default_rng(seed)``)."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise ValueError("bootstrap of no values")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    rng = np.random.default_rng(seed)
    rows = max(1, _CHUNK // x.size)
    out = np.empty(resamples, dtype=np.float64)
    for start in range(0, resamples, rows):
        m = min(rows, resamples - start)
        out[start : start + m] = x[rng.integers(0, x.size, size=(m, x.size))].mean(axis=1)
    return out


def paired_bootstrap(a: Sequence[float], b: Sequence[float], resamples: int = 10000, seed: int = 0,
                     level: float = 0.95) -> dict:
    """Paired comparison of per-problem values ``a`` and ``b`` (same problems, same order).

    Returns ``delta`` (mean of b - a), its ``stderr``, the bootstrap ``ci`` ``[lo, hi]`` at ``level``,
    ``p`` (two-sided, see module doc), ``problems`` and ``resamples``.
    """
    if len(a) != len(b):
        raise ValueError(f"paired values need the same problems ({len(a)} vs {len(b)})")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    d = np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)
    delta = float(d.mean())
    means = bootstrap_means(d, resamples, seed)
    lo, hi = np.quantile(means, [(1 - level) / 2, 1 - (1 - level) / 2])
    hits = int(np.count_nonzero(np.abs(means - delta) >= abs(delta) - 1e-12))
    return {"delta": delta, "stderr": mean_stderr(d), "ci": [float(lo), float(hi)], "level": level,
            "p": (1 + hits) / (1 + resamples), "problems": int(d.size), "resamples": resamples, "seed": seed}
