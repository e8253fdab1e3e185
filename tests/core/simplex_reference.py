"""numpy float64 helpers shared by the core tests (imported by name: tests/core/conftest.py puts this
directory on sys.path)."""

import numpy as np


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def finite_differences(f, s, h=1e-6):
    """Central differences of ``f(s) -> [G]`` with respect to each column of ``s`` [G, K]."""
    out = np.zeros_like(s)
    for k in range(s.shape[1]):
        e = np.zeros_like(s)
        e[:, k] = h
        out[:, k] = (f(s + e) - f(s - e)) / (2 * h)
    return out
