"""Eval metrics logged to TensorBoard / Weights & Biases against the training step (``lpo-eval report
--tensorboard DIR --wandb-project P``).

Like OpenRLHF's loggers (``openrlhf/utils/logging_utils.py``): scalars under ``eval/``, one series per
training run, x axis the training step read from the checkpoint path. Keys per benchmark:
``eval/<bench>_pass1``, ``eval/<bench>_pass<k>`` (the benchmark's k), ``eval/<bench>_maj<n>``,
``eval/<bench>_response_length_mean``, ``eval/<bench>_truncated_rate``, and the averages
``eval/math_avg_pass1`` / ``eval/ood_avg_pass1``. TensorBoard writes ``DIR/<run>/``; W&B opens one
run per training run named after it (``--wandb-run-id`` resumes an existing run, e.g. the training
run, so the curves land next to its training metrics) with ``eval/global_step`` as the step metric.
Checkpoints without a step are skipped (named on stderr).
"""

from __future__ import annotations

import sys
from pathlib import Path


def step_logs(row: dict, table: dict) -> dict[str, float]:
    """The scalars of one report row (a checkpoint), keyed as in the module docstring."""
    out: dict[str, float] = {}
    for b, c in row["cells"].items():
        out[f"{b}_pass1"] = c["pass@1"]
        if c["k"] > 1:
            out[f"{b}_pass{c['k']}"] = c["pass@k"]
        if c["n"] > 1 and c.get("maj@n") is not None:
            out[f"{b}_maj{c['n']}"] = c["maj@n"]
        ln = c.get("length") or {}
        if ln.get("mean") is not None:
            out[f"{b}_response_length_mean"] = ln["mean"]
        if ln.get("truncated_rate") is not None:
            out[f"{b}_truncated_rate"] = ln["truncated_rate"]
    for g in ("math", "ood"):
        v = row.get(f"{g}_avg_pass@1")
        if v is not None:
            out[f"{g}_avg_pass1"] = v
    return out


def _series(table: dict) -> dict[str, list[tuple[int, dict]]]:
    runs: dict[str, list[tuple[int, dict]]] = {}
    skipped = []
    for r in table["rows"]:
        if r["step"] is None:
            skipped.append(r["checkpoint"])
            continue
        runs.setdefault(r.get("run") or r["checkpoint"], []).append((int(r["step"]), step_logs(r, table)))
    if skipped:
        print(f"lpo-eval report: no training step in {', '.join(skipped)}: not logged to trackers", file=sys.stderr)
    return {run: sorted(pts, key=lambda p: p[0]) for run, pts in runs.items()}


def log_tensorboard(table: dict, log_dir: str | Path) -> list[Path]:
    """One SummaryWriter per run under ``log_dir``; returns the run directories written."""
    from torch.utils.tensorboard import SummaryWriter

    dirs = []
    for run, pts in _series(table).items():
        d = Path(log_dir) / run
        writer = SummaryWriter(log_dir=str(d))
        for step, logs in pts:
            for k, v in logs.items():
                writer.add_scalar(f"eval/{k}", v, step)
        writer.close()
        dirs.append(d)
    return dirs


def log_wandb(table: dict, project: str, entity: str | None = None, group: str | None = None,
              run_id: str | None = None) -> list[str]:
    """One W&B run per training run (``run_id``: resume that run instead; one training run only)."""
    try:
        import wandb
    except ImportError:
        raise ValueError("--wandb-project needs the wandb package (pip install wandb)") from None
    series = _series(table)
    if run_id and len(series) > 1:
        raise ValueError(f"--wandb-run-id resumes one run, but the report holds {len(series)} runs ({', '.join(series)}); "
                         "filter with --select run=NAME")
    names = []
    for run, pts in series.items():
        handle = wandb.init(project=project, entity=entity, group=group, name=None if run_id else run,
                            id=run_id, resume="allow" if run_id else None, reinit="create_new",
                            config={"lpo_eval_run": run})
        handle.define_metric("eval/global_step")
        handle.define_metric("eval/*", step_metric="eval/global_step")
        for step, logs in pts:
            handle.log({**{f"eval/{k}": v for k, v in logs.items()}, "eval/global_step": step})
        names.append(handle.name)
        handle.finish()
    return names
