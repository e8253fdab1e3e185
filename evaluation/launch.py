"""Where generation runs: in this process, one subprocess per checkpoint (vLLM), or ``--dp N`` engine
processes (:mod:`evaluation.dp`); and the internal ``_generate-one`` command those subprocesses run.

Kept apart from :mod:`evaluation.generate` (the jobs themselves) so that the engine-process module can
build on the jobs without the jobs importing it back.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .benchmarks import register_custom_benchmarks
from .checkpoints import Checkpoint
from .dp import generate_dp, worker_banner
from .generate import GenOptions, GenReport, JobsFailed, check_options, generate_checkpoint, generate_report, options_from_dict


def generate(ckpts: list[str], opts: GenOptions) -> GenReport:
    """Generate for every checkpoint; vLLM (or ``isolate="always"``) gets one process per checkpoint, and
    ``opts.dp > 1`` one engine process per device set (:mod:`evaluation.dp`).

    Returns what happened; raises :class:`JobsFailed` after the other jobs finished if any failed.
    """
    check_options(opts)
    if opts.dp > 1:
        report = generate_dp(ckpts, opts)
    else:
        report = generate_report(ckpts, opts)
    if report.failed:
        raise JobsFailed(f"{len(report.failed)} failed (the other jobs finished; rerun to resume):\n  "
                         + "\n  ".join(report.failed))
    return report


def generate_one_from_spec(spec_path: str) -> None:
    """The internal ``_generate-one`` command: one checkpoint (``ckpt``) or, for a ``--dp`` engine
    process, every checkpoint (``ckpts``) with its shard; writes the :class:`GenReport` to ``result``."""
    with open(spec_path) as f:
        spec = json.load(f)
    opts = options_from_dict(spec["opts"])
    register_custom_benchmarks(opts.data)
    if "ckpts" in spec:
        worker_banner(opts)
        try:
            report = generate_report(spec["ckpts"], opts)
        except ValueError as e:
            report = GenReport(failed=[f"{', '.join(spec['ckpts'])}: {e}"])
    else:
        report = generate_checkpoint(Checkpoint(**spec["ckpt"]), opts)
    Path(spec["result"]).write_text(json.dumps(dataclasses.asdict(report)))
