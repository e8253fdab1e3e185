"""Benchmarks by name: the one place that registers every benchmark family.

Importing this module fills the registry (:mod:`evaluation.benchmark_registry`) with each family in
:data:`FAMILIES`, in this order (which is also the order of report columns):

* :mod:`evaluation.text_benchmarks`: the six math benchmarks, MMLU-Pro, ARC-c, GPQA-diamond;
* :mod:`evaluation.code_benchmarks`: PRIME's held-out code problems, HumanEval, MBPP (the ``code`` kind);
* :mod:`evaluation.vision`: Geometry3k with its images (the ``verl-geo3k`` template, ``-vlm`` engines).

Families import the registry, never this module, so imports run one way (tested in
``tests/core/test_product_rules.py``). Code that needs the whole table (the CLI, ``generate``, ``report``)
imports the names below from here; a new family is one module and one line in :data:`FAMILIES`.
"""

from __future__ import annotations

from openrlhf_lpo.rewards.grading import last_boxed  # noqa: F401  (the extractor Minerva's golds use)

# isort: off
from . import text_benchmarks, code_benchmarks, vision  # the registration order is the report's column order
# isort: on
from .benchmark_registry import (  # noqa: F401
    BENCHMARKS,
    BenchmarkSpec,
    FieldMissing,
    LoadedBenchmark,
    Problem,
    benchmarks_dir,
    get_benchmark,
    load_benchmark,
    register_benchmark,
    register_custom_benchmarks,
)

FAMILIES = (text_benchmarks, code_benchmarks, vision)

__all__ = [
    "BENCHMARKS",
    "FAMILIES",
    "BenchmarkSpec",
    "FieldMissing",
    "LoadedBenchmark",
    "Problem",
    "benchmarks_dir",
    "get_benchmark",
    "last_boxed",
    "load_benchmark",
    "register_benchmark",
    "register_custom_benchmarks",
]
