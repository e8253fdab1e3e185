"""pass@k against brute-force enumeration of every k-subset, and input validation."""

import itertools
import math

import pytest

from evaluation.metrics import benchmark_pass_at_k, column_accuracy_std, pass_at_k


def brute_force(n: int, c: int, k: int) -> float:
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_equals_enumeration_over_all_subsets():
    cases = 0
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_force(n, c, k), abs=1e-12), (n, c, k)
                cases += 1
    assert cases == 728


def test_pass_at_1_is_accuracy_and_product_form_agrees():
    for n in (1, 4, 32, 64):
        for c in range(n + 1):
            assert pass_at_k(n, c, 1) == pytest.approx(c / n, abs=1e-15)
            for k in sorted({1, min(2, n), n // 2 or 1, n}):
                if n - c < k:
                    ref = 1.0
                else:  # numerically stable product form, float64
                    ref = 1.0 - math.prod(1.0 - k / j for j in range(n - c + 1, n + 1))
                assert pass_at_k(n, c, k) == pytest.approx(ref, abs=1e-12)


@pytest.mark.parametrize("args", [(0, 0, 1), (4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5), (4.0, 2, 1), (4, True, 1)])
def test_pass_at_k_rejects_bad_input(args):
    with pytest.raises(ValueError):
        pass_at_k(*args)


def test_benchmark_average_and_column_std():
    correct = [[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]]
    got = benchmark_pass_at_k(correct)
    assert set(got) == {1, 2, 3, 4}
    assert got[1] == pytest.approx((2 / 4 + 0 + 1) / 3)
    assert got[2] == pytest.approx((brute_force(4, 2, 2) + 0 + 1) / 3)
    cols = [2 / 3, 1 / 3, 1 / 3, 2 / 3]
    mean = sum(cols) / 4
    assert column_accuracy_std(correct) == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in cols) / 4))
    with pytest.raises(ValueError):
        benchmark_pass_at_k([[1, 0], [1]])


def test_worst_at_k_equals_enumeration():
    from evaluation.metrics import all_correct_at_k, benchmark_worst_at_k

    for n in range(1, 10):
        for c in range(n + 1):
            samples = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))
                ref = sum(all(samples[i] for i in s) for s in subsets) / len(subsets)
                assert all_correct_at_k(n, c, k) == pytest.approx(ref, abs=1e-12)
    w = benchmark_worst_at_k([[1, 1, 1], [1, 0, 1], [0, 0, 0]])
    assert w[3] == pytest.approx(1 / 3) and w[1] == pytest.approx((1 + 2 / 3 + 0) / 3)


def _hypergeometric_majority(c: int, w: int, a: int, k: int) -> float:
    """Independent reference for two answers (c correct votes, w votes for one wrong answer, a abstentions):
    P(X_c > X_w) + P(X_c == X_w > 0) / 2 for a k-subset drawn without replacement."""
    n = c + w + a
    total = 0.0
    for xc in range(0, min(c, k) + 1):
        for xw in range(0, min(w, k - xc) + 1):
            xa = k - xc - xw
            if xa > a:
                continue
            p = math.comb(c, xc) * math.comb(w, xw) * math.comb(a, xa) / math.comb(n, k)
            if xc > xw:
                total += p
            elif xc == xw and xc > 0:
                total += p / 2
    return total


def test_majority_at_k_matches_the_hypergeometric_reference():
    from evaluation.metrics import majority_at_k, majority_vote_score

    for c, w, a in [(3, 2, 1), (1, 4, 0), (2, 2, 2), (5, 0, 3), (0, 3, 3), (4, 4, 0)]:
        votes = [0] * c + [7] * w + [None] * a
        for k in range(1, c + w + a + 1):
            assert majority_at_k(votes, 0, k) == pytest.approx(_hypergeometric_majority(c, w, a, k), abs=1e-12), (c, w, a, k)
    # three answers, maj@n by hand: correct 2 votes, wrong answers 2 and 1 votes -> a two-way tie -> 1/2
    assert majority_vote_score([0, 0, 5, 5, 6], 0) == 0.5
    assert majority_vote_score([None, None], 0) == 0.0
    # Monte-Carlo branch (C(40, 20) subsets): close to the exact two-answer value
    votes = [0] * 22 + [1] * 18
    assert majority_at_k(votes, 0, 20, seed=3) == pytest.approx(_hypergeometric_majority(22, 18, 0, 20), abs=0.03)


def test_percentiles_and_length_stats_against_numpy():
    import numpy as np

    from evaluation.metrics import length_stats, percentile

    rng = np.random.default_rng(0)
    for size in (1, 2, 7, 100):
        xs = rng.integers(1, 5000, size).tolist()
        for q in (0, 10, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    s = length_stats([10, 20, 30, 40], [True, False, True, False], [False, False, True, True])
    assert s == {"mean": 25, "max": 40, "p10": pytest.approx(13), "p50": 25, "p90": pytest.approx(37), "p99": pytest.approx(39.7),
                 "mean_correct": 20, "mean_wrong": 30, "truncated_rate": 0.5}
