"""Seed statistics: mean with a 95% confidence interval, paired differences (lpo-compare, the demo, the
toy benchmark).

With n seeds the interval is ``mean +- t_{0.975, n-1} * s / sqrt(n)`` (Student's t, s the sample
standard deviation with ddof=1): the usual interval for the mean of n independent runs. A paired
difference (LPO minus its baseline on the same seed: same prompts and, at step 1, the same rollouts)
uses the same formula on the per-seed differences, which removes the seed-to-seed variation both
runs share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

# Two-sided 95% quantiles t_{0.975, df} of Student's t (df = 1..30); larger df use the normal 1.96
# (t_{0.975,30} = 2.042, so the cut-over error is below 5% of the half-width).
_T975 = (12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004, 2.262157,
         2.228139, 2.200985, 2.178813, 2.160369, 2.144787, 2.131450, 2.119905, 2.109816, 2.100922,
         2.093024, 2.085963, 2.079614, 2.073873, 2.068658, 2.063899, 2.059539, 2.055529, 2.051831,
         2.048407, 2.045230, 2.042272)


def t975(df: int) -> float:
    """``t_{0.975, df}``: the two-sided 95% quantile of Student's t with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.959964


@dataclass(frozen=True)
class Interval:
    """Mean of ``n`` values and the half-width of its 95% interval (NaN for n < 2)."""

    mean: float
    half: float
    n: int

    @property
    def low(self) -> float:
        return self.mean - self.half

    @property
    def high(self) -> float:
        return self.mean + self.half

    def fmt(self, spec: str = ".3f") -> str:
        if self.n == 0:
            return "-"
        if math.isnan(self.half):
            return format(self.mean, spec)
        return f"{format(self.mean, spec)} +- {format(self.half, spec)}"


def mean_ci(values: Sequence[Optional[float]]) -> Interval:
    """95% t-interval of the mean of the finite values (``None``/NaN are left out)."""
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    n = len(xs)
    if n == 0:
        return Interval(math.nan, math.nan, 0)
    mean = sum(xs) / n
    if n == 1:
        return Interval(mean, math.nan, 1)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    return Interval(mean, t975(n - 1) * sd / math.sqrt(n), n)


def paired_ci(a: Sequence[Optional[float]], b: Sequence[Optional[float]]) -> Interval:
    """95% interval of the mean of ``a[i] - b[i]`` over the pairs where both are finite."""
    if len(a) != len(b):
        raise ValueError(f"paired values need equal lengths, got {len(a)} and {len(b)}")
    diffs = [x - y for x, y in zip(a, b)
             if x is not None and y is not None and math.isfinite(x) and math.isfinite(y)]
    return mean_ci(diffs)
