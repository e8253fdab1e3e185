"""Paired multi-seed studies (``lpo-compare``): every method once per seed with the same ``--train.seed``, each run
a normal ``lpo-train`` run, resumable, reported as the paper's Figure-5 quantities with 95% intervals over seeds
and paired differences against the baseline (docs/compare.md).

Modules, one job each: ``plan`` (the run matrix), ``runner`` (runs it: done markers, resume), ``recipe`` (a run
as a recipe's Ray job on a cluster), ``presets`` (studies without a recipe; the demo registers the CPU ones),
``metrics`` (the one table from logged keys to columns), ``summary`` and ``stats`` (per-run values, means and
intervals over seeds, paired differences), ``report`` (table and figures), ``files`` (atomic run-directory
files), ``cli`` (the command).
"""
