"""Stage 2 (``lpo-eval score``): grade saved generations on CPU and write per-benchmark metrics.

For every finished job directory: ``samples.jsonl`` (each generation row plus ``extracted``,
``correct``, ``grader_status``) and ``metrics.json``. Each benchmark kind has its grader in
:data:`evaluation.grading.GRADERS`: math goes through the hang-safe worker pool
(:mod:`openrlhf_lpo.rewards.grading`), choices through the letter extractor, code through the sandbox
(:mod:`evaluation.code_benchmarks`). The graded text is the
assistant's turn: when the job's prompt opened a ``<think>`` block (``problems.jsonl``), it is put back
in front of the response, so unfinished reasoning has no answer.

Metrics: Pass@k (unbiased, every k <= n), maj@k (majority vote over grader-equivalent answers,
:mod:`evaluation.majority`; only for kinds whose samples have an answer, not code), worst@k (all k samples correct; worst@n with best@n = pass@n), response
length (mean, percentiles, correct vs wrong, truncation rate) and grader statuses.

Scoring is idempotent and needs no GPU: a job whose ``metrics.json`` records the same generations hash
and grader settings is skipped unless ``force``. Each job is locked while it is scored, so several
scorers can share one runs directory; a job that fails is reported and the others are still scored.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from openrlhf_lpo.rewards.grading import GradeResult, GraderPool, assistant_text

from .generate import CONFIG_FILE, GEN_FILE, PROBLEMS_FILE, JobsFailed
from .grading import GRADERS, check_grading_options, job_grading_options  # how each kind is graded (the registry)
from .io import atomic_write_json, atomic_write_jsonl, read_json, read_jsonl, sha256_file
from .locks import JobLock
from .majority import VOTING_KINDS, vote_labels
from .metrics import (
    benchmark_pass_at_k,
    benchmark_worst_at_k,
    column_accuracy_std,
    default_ks,
    length_stats,
    majority_at_k,
)
from .protocol import job_protocol

SAMPLES_FILE = "samples.jsonl"
METRICS_FILE = "metrics.json"
GRADER_VERSION = 3  # bump when grading semantics change: forces a rescore (2: issue-17 rules; 3: issue-24 rules)
REQUIRED = {"problem_id": str, "sample_idx": int, "response": str, "finish_reason": str, "n_tokens": int, "gold": str}
SAMPLE_KEYS = ("checkpoint", "benchmark", "problem_id", "sample_idx", "prompt_sha", "response", "finish_reason",
               "n_tokens", "gold")


def find_jobs(runs: str | Path) -> list[Path]:
    """Job directories under ``runs`` that hold a finished generations file."""
    root = Path(runs)
    if not root.is_dir():
        raise ValueError(f"--runs {str(root)!r} is not a directory")
    return sorted(p.parent for p in root.glob(f"*/*/{GEN_FILE}"))


def check_rows(rows: list[dict], path: Path) -> None:
    """ValueError naming the file, line and field of the first malformed generation row."""
    for i, r in enumerate(rows, 1):
        for name, typ in REQUIRED.items():
            if name not in r:
                raise ValueError(f"{path}:{i}: row has no {name!r} field")
            if not isinstance(r[name], typ) or isinstance(r[name], bool):
                raise ValueError(f"{path}:{i}: field {name!r} must be {typ.__name__}, got {type(r[name]).__name__}")


def _by_problem(rows: list[dict], n: int, bench: str) -> list[list[dict]]:
    by_problem: dict[str, list[dict]] = {}
    for r in rows:
        by_problem.setdefault(r["problem_id"], []).append(r)
    for pid, rs in by_problem.items():
        if len(rs) != n:
            raise ValueError(f"{bench}: problem {pid} has {len(rs)} samples, expected n={n}")
    return [sorted(rs, key=lambda r: r["sample_idx"]) for rs in by_problem.values()]


def compute_metrics(cfg: dict, rows: list[dict], gen_sha: str, grader: dict,
                    votes: list[list[int | None]] | None = None) -> dict:
    """``metrics.json`` of one job from its graded rows (``votes``: majority labels per problem, or None)."""
    n = cfg["n"]
    problems = _by_problem(rows, n, cfg["benchmark"])
    correct = [[bool(r["correct"]) for r in rs] for rs in problems]
    passk = benchmark_pass_at_k(correct)
    worst = benchmark_worst_at_k(correct)
    total = len(rows)

    def rate(pred) -> float:
        return sum(1 for r in rows if pred(r)) / total

    out = {
        "checkpoint": cfg["checkpoint"],
        "checkpoint_path": cfg.get("checkpoint_path"),
        "run": cfg.get("run"),
        "step": cfg.get("step"),
        "benchmark": cfg["benchmark"],
        "group": cfg["group"],
        "config_sha": cfg["config_sha"],
        "n_problems": len(correct),
        "n": n,
        "k": cfg["k"],
        "pass@1": passk[1],
        "pass@k": {str(k): v for k, v in passk.items()},
        "worst@k": {str(k): v for k, v in worst.items()},
        "best_of_n": passk[n],
        "worst_of_n": worst[n],
        "pass@1_column_std": column_accuracy_std(correct),
        "truncated_rate": rate(lambda r: r["finish_reason"] == "length"),
        "timeout_rate": rate(lambda r: r["grader_status"] == "timeout"),
        "no_answer_rate": rate(lambda r: r["grader_status"] == "no_answer"),
        "error_rate": rate(lambda r: r["grader_status"] == "error"),
        "mean_tokens": sum(r["n_tokens"] for r in rows) / total,
        "length": length_stats([r["n_tokens"] for r in rows], [bool(r["correct"]) for r in rows],
                               [r["finish_reason"] == "length" for r in rows]),
        "generations_sha": gen_sha,
        "grader": grader,
        "protocol": job_protocol(cfg),
    }
    if votes is not None:
        from .majority import CORRECT

        out["maj@k"] = {str(k): sum(majority_at_k(v, CORRECT, k, seed=i) for i, v in enumerate(votes)) / len(votes)
                        for k in default_ks(n)}
    return out


def _think_flags(d: Path, cfg: dict) -> dict[str, str | None]:
    """problem_id -> the prompt (to see whether it opened ``<think>``); older runs: from the template."""
    pfile = d / PROBLEMS_FILE
    if pfile.exists():
        return {str(p["problem_id"]): p.get("prompt") for p in read_jsonl(pfile)}
    return {"*": "<think>" if cfg.get("template") == "r1" else None}


def _grade_rows(rows: list[dict], cfg: dict, prompts: dict, pool: GraderPool, timeout: float, fast_path: bool,
                boxes: str, progress, options: dict | None = None) -> list[GradeResult]:
    if cfg["kind"] not in GRADERS:
        raise ValueError(f"{cfg['benchmark']}: no grader for kind {cfg['kind']!r} (known: {', '.join(GRADERS)})")
    texts = [assistant_text(r["response"], prompts.get(r["problem_id"], prompts.get("*"))) for r in rows]
    opts = {"timeout": timeout, "fast_path": fast_path, "boxes": boxes, **check_grading_options(options or {})}
    return GRADERS[cfg["kind"]](rows, texts, pool, opts, progress)


def score_job(d: Path, pool: GraderPool, timeout: float, fast_path: bool = True, force: bool = False,
              show_progress: bool = True, boxes: str = "last", majority: bool = True,
              options: dict | None = None) -> dict:
    """Grade one job directory; return its metrics (also written to ``metrics.json``)."""
    with JobLock(d, wait=True):
        cfg = read_json(d / CONFIG_FILE)
        gen = d / GEN_FILE
        gen_sha = sha256_file(gen)
        majority = majority and cfg["kind"] in VOTING_KINDS
        grader = {"version": GRADER_VERSION, "timeout": timeout, "fast_path": fast_path, "boxes": boxes,
                  "majority": majority, **job_grading_options(cfg["kind"], cfg["benchmark"], options or {})}
        mpath = d / METRICS_FILE
        if not force and mpath.exists() and (d / SAMPLES_FILE).exists():
            old = read_json(mpath)
            if old.get("generations_sha") == gen_sha and old.get("grader") == grader:
                return old
        rows = read_jsonl(gen)
        if not rows:
            raise ValueError(f"{gen} is empty")
        check_rows(rows, gen)
        bar = None
        if show_progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(rows), desc=f"score {cfg['checkpoint']}/{cfg['benchmark']}", unit="sample")
        results = _grade_rows(rows, cfg, _think_flags(d, cfg), pool, timeout, fast_path, boxes,
                              bar.update if bar else None, options)
        if bar is not None:
            bar.close()
        out_rows: list[dict[str, Any]] = []
        for r, g in zip(rows, results):
            row = {key: r.get(key) for key in SAMPLE_KEYS}
            row.update(extracted=g.extracted, correct=g.correct, grader_status=g.status)
            out_rows.append(row)
        votes = None
        if majority:
            problems = _by_problem(out_rows, cfg["n"], cfg["benchmark"])
            votes = vote_labels(problems, cfg["kind"], pool, timeout=min(timeout, 5.0))
        metrics = compute_metrics(cfg, out_rows, gen_sha, grader, votes)
        atomic_write_jsonl(d / SAMPLES_FILE, out_rows)
        atomic_write_json(mpath, metrics)
        return metrics


def score(runs: str | Path, workers: int | None = None, timeout: float = 10.0, fast_path: bool = True,
          force: bool = False, show_progress: bool = True, boxes: str = "last", majority: bool = True,
          options: dict | None = None) -> list[dict]:
    """Score every finished job under ``runs`` with one worker pool; a failing job does not stop the others.

    ``options``: grading options (``require_box``, ``choice_extraction``; :data:`evaluation.grading.GRADING_DEFAULTS`).
    """
    check_grading_options(options or {})
    jobs = find_jobs(runs)
    if not jobs:
        raise ValueError(f"--runs {str(runs)!r} holds no finished generations (run `lpo-eval generate` first)")
    out, failed = [], []
    with GraderPool(workers=workers, timeout=timeout) as pool:
        for d in jobs:
            try:
                out.append(score_job(d, pool, timeout, fast_path, force, show_progress, boxes, majority, options))
            except (ValueError, KeyError, OSError) as e:
                failed.append(f"{d}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
                print(f"lpo-eval score: {failed[-1]}", file=sys.stderr)
    if failed:
        raise JobsFailed(f"{len(failed)} job(s) could not be scored (the others were):\n  " + "\n  ".join(failed))
    return out
