"""Grading throughput: items/s of the hang-safe pool on real references vs. math-verify called directly.

    python benchmarks/grading_throughput.py [--workers 2] [--out grading_throughput.json]

Item sets (real data from LPO_BENCHMARKS_DIR): MATH500 ``\\boxed{answer}`` and full ``solution`` texts,
OlympiadBench ``\\boxed{final_answer}``. For each set:
* ``direct``: ``math_verify.parse`` + ``verify`` in this process, one item after another (no timeout,
  no caches) -- the baseline cost of math-verify itself, on one core;
* ``pool1_full``: a 1-worker :class:`GraderPool`, every item through math-verify (``fast_path=False``);
  ``overhead = pool1_full time / direct time`` is the price of process isolation + the kill timeout
  (the pool also caches parsed golds/answers, so it can come out below 1);
* ``pool1_fast``: the same worker with the exact-string fast path: on ``*_boxed`` sets nearly every item
  skips sympy, so its time per item bounds the pipe/JSON round-trip cost of the pool;
* ``poolW`` / ``poolW_full``: ``--workers`` workers with / without the exact-string fast path;
  reported as items/s and items/s per worker (core).
Pools are warmed up (workers started) before timing; every timed run uses fresh workers (cold caches).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from evaluation.benchmarks import benchmarks_dir, load_benchmark  # noqa: E402
from openrlhf_lpo.rewards.grading import GraderPool  # noqa: E402


def item_sets() -> dict[str, list[tuple[str, str]]]:
    rows = [json.loads(line) for line in open(benchmarks_dir() / "math500" / "test.jsonl")]
    oly = load_benchmark("olympiadbench").problems
    return {
        "math500_boxed": [("\\boxed{%s}" % r["answer"], r["answer"]) for r in rows],
        "math500_solution": [(r["solution"], r["answer"]) for r in rows],
        "olympiad_boxed": [("\\boxed{%s}" % p.gold, p.gold) for p in oly],
    }


def run_direct(items) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) for parse + parse + verify of every item."""
    import logging

    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    t, c = time.perf_counter(), time.process_time()
    for resp, gold in items:
        g = parse("\\boxed{" + gold + "}", parsing_timeout=None)
        p = parse(resp, parsing_timeout=None)
        if g and p:
            verify(g, p, timeout_seconds=None)
    return time.perf_counter() - t, time.process_time() - c


def _cpu_seconds(pids) -> float:
    """utime + stime of processes (Linux /proc); 0 for processes that are gone."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


def _per_cpu(n: int, cpu_s: float) -> float | None:
    """Items per CPU-second, or None when the CPU time is below the clock's resolution."""
    return n / cpu_s if cpu_s >= 0.05 else None


def _fmt(v: float | None) -> str:
    return "    n/a" if v is None else f"{v:7.1f}"


def run_pool(items, workers: int, fast_path: bool, timeout: float) -> tuple[float, dict]:
    """Wall seconds for the batch; stats include the workers' CPU seconds (load-independent cost)."""
    kind = "math" if fast_path else "math_full"
    with GraderPool(workers=workers, timeout=timeout) as pool:
        pool.grade([("math", "\\boxed{%d}" % i, str(i)) for i in range(workers * 2)])  # start + warm every worker
        pids = [w.pid for w in pool._live]
        cpu0, t = _cpu_seconds(pids), time.perf_counter()
        res = pool.grade([(kind, r, g) for r, g in items])
        dt = time.perf_counter() - t
        cpu = _cpu_seconds(pids) - cpu0
        stats = dict(pool.stats, correct=sum(r.correct for r in res), n=len(res), worker_cpu_s=cpu)
    return dt, stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--sets", default="math500_boxed,math500_solution,olympiad_boxed")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--limit", type=int, default=None, help="first N items of each set (quick check)")
    args = ap.parse_args()
    if args.workers < 1:
        ap.error("--workers must be >= 1")
    sets = item_sets()
    results = {}
    for name in [s.strip() for s in args.sets.split(",") if s.strip()]:
        if name not in sets:
            ap.error(f"--sets: unknown set {name!r}; choose from {', '.join(sets)}")
        items = sets[name][: args.limit] if args.limit else sets[name]
        n = len(items)
        direct, direct_cpu = run_direct(items)
        p1, s1 = run_pool(items, 1, False, args.timeout)
        p1_fast, _ = run_pool(items, 1, True, args.timeout)
        pw_full, sw_full = run_pool(items, args.workers, False, args.timeout)
        pw, sw = run_pool(items, args.workers, True, args.timeout)
        results[name] = {
            "items": n,
            "direct_items_per_s": n / direct,
            "direct_items_per_cpu_s": n / direct_cpu,
            "pool1_fast_items_per_s": n / p1_fast,
            "pool1_full_items_per_s": n / p1,
            "pool1_full_items_per_worker_cpu_s": _per_cpu(n, s1["worker_cpu_s"]),
            "overhead_cpu_pool1_vs_direct": s1["worker_cpu_s"] / direct_cpu,
            "overhead_pool1_vs_direct": p1 / direct,
            f"pool{args.workers}_full_items_per_s": n / pw_full,
            f"pool{args.workers}_full_items_per_s_per_core": n / pw_full / args.workers,
            f"pool{args.workers}_items_per_s": n / pw,
            f"pool{args.workers}_items_per_s_per_core": n / pw / args.workers,
            f"pool{args.workers}_items_per_worker_cpu_s": _per_cpu(n, sw["worker_cpu_s"]),
            f"pool{args.workers}_full_items_per_worker_cpu_s": _per_cpu(n, sw_full["worker_cpu_s"]),
            "correct_full": sw_full["correct"],
            "correct_fast": sw["correct"],
            "timeouts": s1["timeouts"] + sw_full["timeouts"] + sw["timeouts"],
        }
        r = results[name]
        print(f"{name:18s} n={n:4d} direct {r['direct_items_per_s']:7.1f}/s ({n / direct_cpu:7.1f}/cpu-s) | "
              f"pool1 fast-path {n / p1_fast:7.1f}/s | pool1 {r['pool1_full_items_per_s']:7.1f}/s "
              f"(overhead x{r['overhead_pool1_vs_direct']:.2f}) | pool{args.workers} full "
              f"{n / pw_full:7.1f}/s ({n / pw_full / args.workers:6.1f}/s/core) | pool{args.workers} fast-path "
              f"{n / pw:7.1f}/s ({n / pw / args.workers:6.1f}/s/core) | correct {r['correct_full']}/{r['correct_fast']}\n"
              f"{'':18s} per CPU-second: direct {n / direct_cpu:7.1f} | pool1 full "
              f"{_fmt(r['pool1_full_items_per_worker_cpu_s'])} (overhead x{r['overhead_cpu_pool1_vs_direct']:.2f}) | "
              f"pool{args.workers} fast-path {_fmt(r[f'pool{args.workers}_items_per_worker_cpu_s'])} per worker-CPU-s",
              flush=True)
    results["_meta"] = {"workers": args.workers, "cpu_count": os.cpu_count(), "loadavg_1m": os.getloadavg()[0]}
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
