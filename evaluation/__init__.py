"""LPO evaluation: ``lpo-eval generate -> score -> report`` over checkpoints and benchmarks.

Modules: ``benchmarks`` (the benchmark table: registers every family), ``benchmark_registry`` (specs,
readers, custom ``--data`` sets), ``text_benchmarks`` (math, MMLU-Pro, ARC-c, GPQA with its option
orderings), ``code_benchmarks`` (PRIME/HumanEval/MBPP: the ``code`` kind, graded in the sandbox),
``vision`` (Geometry3k with its images, the ``verl-geo3k`` template, the ``hf-vlm`` / ``vllm-vlm``
engines), ``protocol`` (presets, the settings header of reports), ``templates`` (prompts, default stop strings),
``checkpoints`` (``--ckpts`` resolution, run name and step), ``engines`` (vllm / hf), ``generate``,
``locks`` (per-job locks for a shared ``--out``), ``score``, ``majority`` (maj@k answer clusters),
``metrics`` (pass@k, worst@k, maj@k, lengths), ``report``, ``views`` (``show`` / ``compare``),
``trackers`` (TensorBoard / W&B), ``training_eval`` (OpenRLHF's ``--eval.*`` path) and ``grading``
(the contract API over the shared grader, the graders by kind). Importing this package is cheap:
nothing heavy is imported here.
"""
