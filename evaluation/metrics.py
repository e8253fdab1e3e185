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


def all_correct_at_k(n: int, c: int, k: int) -> float:
    """Probability that a random k-subset of n samples (c correct) is *all* correct: ``C(c, k) / C(n, k)``.

    The worst-of-k counterpart of :func:`pass_at_k` (best-of-k); at k = n it is 1 if every sample is correct.
    """
    pass_at_k(n, c, k)  # validates n, c, k
    return math.comb(c, k) / math.comb(n, k)


def benchmark_worst_at_k(correct: Sequence[Sequence[bool]], ks: Sequence[int] | None = None) -> dict[int, float]:
    """Mean over problems of :func:`all_correct_at_k` (``worst@k``); ``ks`` defaults to ``1..n``."""
    n = len(correct[0])
    ks = list(range(1, n + 1)) if ks is None else list(ks)
    return {k: sum(all_correct_at_k(n, sum(map(bool, row)), k) for row in correct) / len(correct) for k in ks}


MAJ_EXACT_LIMIT = 4096  # enumerate every k-subset up to this many, else a seeded Monte-Carlo estimate
MAJ_SAMPLES = 4096


def majority_vote_score(votes: Sequence, correct_label) -> float:
    """Score of one majority vote: 1/t if ``correct_label`` is among the t most-voted answers, else 0.

    ``votes``: one answer label per sample, ``None`` for a sample without an answer (it abstains).
    Ties are broken uniformly at random, so a tie counts as its expected value.
    """
    counts: dict = {}
    for v in votes:
        if v is not None:
            counts[v] = counts.get(v, 0) + 1
    if not counts or correct_label is None:
        return 0.0
    top = max(counts.values())
    leaders = [v for v, c in counts.items() if c == top]
    return 1.0 / len(leaders) if correct_label in leaders else 0.0


def majority_at_k(votes: Sequence, correct_label, k: int, seed: int = 0) -> float:
    """Expected majority-vote score over the k-subsets of one problem's n samples (maj@k).

    Exact (every subset) when there are at most :data:`MAJ_EXACT_LIMIT` subsets, else the mean over
    :data:`MAJ_SAMPLES` subsets drawn with ``random.Random(seed)``. maj@n is the vote over all samples.
    """
    import itertools
    import random

    n = len(votes)
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got {k}")
    if math.comb(n, k) <= MAJ_EXACT_LIMIT:
        subsets = itertools.combinations(range(n), k)
        total = count = 0
        for s in subsets:
            total += majority_vote_score([votes[i] for i in s], correct_label)
            count += 1
        return total / count
    rng = random.Random(seed)
    return sum(majority_vote_score([votes[i] for i in rng.sample(range(n), k)], correct_label)
               for _ in range(MAJ_SAMPLES)) / MAJ_SAMPLES


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("percentile of an empty list")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def length_stats(lengths: Sequence[int], correct: Sequence[bool], truncated: Sequence[bool]) -> dict:
    """Response length in tokens: mean, p10/p50/p90/p99, max, mean of correct and of wrong samples,
    and the truncation rate (share of samples that hit the token limit)."""
    if not lengths:
        raise ValueError("no samples")
    right = [x for x, ok in zip(lengths, correct) if ok]
    wrong = [x for x, ok in zip(lengths, correct) if not ok]
    out = {"mean": sum(lengths) / len(lengths), "max": max(lengths)}
    for q in (10, 50, 90, 99):
        out[f"p{q}"] = percentile(lengths, q)
    out["mean_correct"] = sum(right) / len(right) if right else None
    out["mean_wrong"] = sum(wrong) / len(wrong) if wrong else None
    out["truncated_rate"] = sum(map(bool, truncated)) / len(truncated)
    return out
