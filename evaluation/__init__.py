"""LPO evaluation: ``lpo-eval generate -> score -> report`` over checkpoints and benchmarks.

Modules: ``benchmarks`` (data by name), ``templates`` (prompts), ``engines`` (vllm / hf), ``generate``,
``score``, ``report``, ``metrics`` (Pass@k), ``grading`` (the contract API over the shared grader).
Importing this package is cheap: nothing heavy is imported here.
"""
