"""``lpo-eval generate`` / ``run`` preflight: what generation would stop on, checked before any engine starts.

* first the option checks ``generate`` makes before touching a file (``--n`` >= ``--k``, the template's
  support for ``--system-prompt`` / ``--chat-template-kwargs``), so the first error is the same;
* every ``--ckpts`` value resolves (:func:`evaluation.checkpoints.resolve_checkpoints`: a glob that
  matches nothing, a path that does not exist, a run folder with no model folder below it);
* every benchmark of ``--benchmarks`` loads with its ``--data NAME=PATH`` (or its staged copy):
  :func:`evaluation.benchmarks.load_benchmark` names the file, the row and the missing field, a file
  that does not parse, an empty file;
* an unknown benchmark name lists the known ones (checked while the options are built).

Without it the same problems surfaced per checkpoint, after the first engines had been planned; a
failure here is ``lpo-eval``'s usual bad-input exit (2).
"""

from __future__ import annotations

from .benchmarks import get_benchmark, load_benchmark
from .checkpoints import resolve_checkpoints
from .generate import resolve_n_k
from .templates import check_context

__all__ = ["preflight"]


def preflight(ckpts: list[str], opts) -> None:
    """Raise ValueError naming the flag, file, row or field of the first bad input."""
    check_context(opts.template, opts.system_prompt, opts.chat_template_kwargs)
    for bench in opts.benchmarks:
        resolve_n_k(bench, opts)
    resolve_checkpoints(ckpts)  # a folder without weights yet is not an input error: generate reports it (exit 1)
    for bench in opts.benchmarks:
        load_benchmark(bench, opts.data.get(get_benchmark(bench).name), opts.limit)
