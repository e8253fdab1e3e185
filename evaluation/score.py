"""Stage 2 (``lpo-eval score``): grade saved generations on CPU and write per-benchmark metrics.

For every finished job directory: ``samples.jsonl`` (each generation row plus ``extracted``,
``correct``, ``grader_status``) and ``metrics.json``. Math goes through the hang-safe worker pool
(:mod:`openrlhf_lpo.rewards.grading`), choices through the letter extractor. Scoring is idempotent and
needs no GPU: a job whose ``metrics.json`` records the same generations hash and grader settings is
skipped unless ``force``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from openrlhf_lpo.rewards.grading import GradeResult, GraderPool, grade_choice

from .benchmarks import KIND_SCORERS
from .generate import CONFIG_FILE, GEN_FILE
from .io import atomic_write_json, atomic_write_jsonl, read_json, read_jsonl, sha256_file
from .metrics import benchmark_pass_at_k, column_accuracy_std

SAMPLES_FILE = "samples.jsonl"
METRICS_FILE = "metrics.json"
GRADER_VERSION = 1  # bump when grading semantics change: forces a rescore


def find_jobs(runs: str | Path) -> list[Path]:
    """Job directories under ``runs`` that hold a finished generations file."""
    root = Path(runs)
    if not root.is_dir():
        raise ValueError(f"--runs {str(root)!r} is not a directory")
    return sorted(p.parent for p in root.glob(f"*/*/{GEN_FILE}"))


def compute_metrics(cfg: dict, rows: list[dict], gen_sha: str, grader: dict) -> dict:
    n = cfg["n"]
    by_problem: dict[str, list[dict]] = {}
    for r in rows:
        by_problem.setdefault(r["problem_id"], []).append(r)
    for pid, rs in by_problem.items():
        if len(rs) != n:
            raise ValueError(f"{cfg['benchmark']}: problem {pid} has {len(rs)} samples, expected n={n}")
    correct = [[bool(r["correct"]) for r in sorted(rs, key=lambda r: r["sample_idx"])] for rs in by_problem.values()]
    passk = benchmark_pass_at_k(correct)
    total = len(rows)

    def rate(pred) -> float:
        return sum(1 for r in rows if pred(r)) / total

    return {
        "checkpoint": cfg["checkpoint"],
        "checkpoint_path": cfg.get("checkpoint_path"),
        "step": cfg.get("step"),
        "benchmark": cfg["benchmark"],
        "group": cfg["group"],
        "config_sha": cfg["config_sha"],
        "n_problems": len(correct),
        "n": n,
        "k": cfg["k"],
        "pass@1": passk[1],
        "pass@k": {str(k): v for k, v in passk.items()},
        "pass@1_column_std": column_accuracy_std(correct),
        "truncated_rate": rate(lambda r: r["finish_reason"] == "length"),
        "timeout_rate": rate(lambda r: r["grader_status"] == "timeout"),
        "no_answer_rate": rate(lambda r: r["grader_status"] == "no_answer"),
        "error_rate": rate(lambda r: r["grader_status"] == "error"),
        "mean_tokens": sum(r["n_tokens"] for r in rows) / total,
        "generations_sha": gen_sha,
        "grader": grader,
    }


def _grade_rows(rows: list[dict], kind: str, pool: GraderPool, timeout: float, fast_path: bool, progress) -> list[GradeResult]:
    if kind in KIND_SCORERS:  # e.g. "code": programs run in the sandbox (evaluation.code_benchmarks)
        return KIND_SCORERS[kind](rows, timeout, progress)
    if kind == "math":
        items = [("math" if fast_path else "math_full", r["response"], str(r["gold"])) for r in rows]
        return pool.grade(items, timeout=timeout, progress=progress)
    results = [grade_choice(r["response"], str(r["gold"]), r.get("choices")) for r in rows]
    if progress:
        progress(len(rows))
    return results


def score_job(d: Path, pool: GraderPool, timeout: float, fast_path: bool = True, force: bool = False, show_progress: bool = True) -> dict:
    """Grade one job directory; return its metrics (also written to ``metrics.json``)."""
    cfg = read_json(d / CONFIG_FILE)
    gen = d / GEN_FILE
    gen_sha = sha256_file(gen)
    grader = {"version": GRADER_VERSION, "timeout": timeout, "fast_path": fast_path}
    mpath = d / METRICS_FILE
    if not force and mpath.exists() and (d / SAMPLES_FILE).exists():
        old = read_json(mpath)
        if old.get("generations_sha") == gen_sha and old.get("grader") == grader:
            return old
    rows = read_jsonl(gen)
    if not rows:
        raise ValueError(f"{gen} is empty")
    bar = None
    if show_progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(rows), desc=f"score {cfg['checkpoint']}/{cfg['benchmark']}", unit="sample")
    results = _grade_rows(rows, cfg["kind"], pool, timeout, fast_path, bar.update if bar else None)
    if bar is not None:
        bar.close()
    out_rows: list[dict[str, Any]] = []
    for r, g in zip(rows, results):
        row = {key: r[key] for key in ("checkpoint", "benchmark", "problem_id", "sample_idx", "prompt_sha",
                                        "response", "finish_reason", "n_tokens", "gold")}
        row.update(extracted=g.extracted, correct=g.correct, grader_status=g.status)
        out_rows.append(row)
    metrics = compute_metrics(cfg, out_rows, gen_sha, grader)
    atomic_write_jsonl(d / SAMPLES_FILE, out_rows)
    atomic_write_json(mpath, metrics)
    return metrics


def score(runs: str | Path, workers: int | None = None, timeout: float = 10.0, fast_path: bool = True,
          force: bool = False, show_progress: bool = True) -> list[dict]:
    """Score every finished job under ``runs`` with one worker pool."""
    jobs = find_jobs(runs)
    if not jobs:
        raise ValueError(f"--runs {str(runs)!r} holds no finished generations (run `lpo-eval generate` first)")
    with GraderPool(workers=workers, timeout=timeout) as pool:
        return [score_job(d, pool, timeout, fast_path, force, show_progress) for d in jobs]
