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
