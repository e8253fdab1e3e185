"""Code-reward throughput: correct programs per second per core, sandboxed vs. unsandboxed, same run;
and (``--step``) a recipe-shaped RL step: tail latency and lost rewards under oversubscription.

    python benchmarks/code_sandbox_throughput.py [--workers 2] [--rounds 3] [--out code_throughput.json]
    python benchmarks/code_sandbox_throughput.py --step [--responses 1024] [--tests 10] [--timeout 1]
        [--oversubscription 1,2] [--cores N] [--out step.json]

Programs (all correct, so every test runs): HumanEval's 164 canonical solutions (one assert-style test
each) and 40 stdin/stdout programs (a+b over 5 test inputs each). Three ways to run the same programs,
each with ``--workers`` threads, interleaved over ``--rounds`` rounds (medians reported):

* ``bwrap``: :func:`openrlhf_lpo.rewards.code.grade_code_batch` with the bubblewrap sandbox (one
  sandbox per program: namespaces, mounts, limits, the runner forking one child per test);
* ``none``: the same runner and limits without the sandbox (``LPO_CODE_SANDBOX=none``): what the
  namespaces and mounts cost;
* ``plain``: the naive unsandboxed baseline, ``python -I -S -c <program [+ tests]>`` once per test,
  output compared in the parent; no limits, no isolation.

Printed per mode: the median wall seconds, programs/s and programs/s per core (divided by ``--workers``),
and the ratios bwrap/plain and bwrap/none (< 1: the sandbox is slower). CPU time is not reported: the
sandbox's processes live in a PID namespace whose CPU time does not reach ``getrusage`` reliably. On a
machine shared with other jobs the wall-clock rates are noisy; the ratio, measured in one interleaved run,
is the number to read.

``--step``: ``--responses`` responses with ``--tests`` stdin/stdout tests each, shuffled: 8 in 10 correct
and fast, 1 in 10 looping on every test, 1 in 10 correct but using 0.6 of the CPU limit (``--timeout``)
on every test. Graded with ``--cores`` x k concurrent sandboxes for each k in ``--oversubscription``, two
ways in the same run: ``before`` (the wall clock is elapsed time and a response keeps running its tests
after a timeout) and ``after`` (the defaults: the wall clock does not count CPU wait, a response stops at
its first timeout). Per run: responses/s per core, the step's critical path (per-response grading time
p50 / p99 / max, and the makespan), and how many correct responses lost reward (reward < 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from openrlhf_lpo.data.code import humaneval_problems, humaneval_question_and_tests  # noqa: E402
from openrlhf_lpo.rewards.code import grade_code_batch, outputs_match, parse_tests  # noqa: E402
from openrlhf_lpo.rewards.sandbox import CodeSandbox, SandboxConfig  # noqa: E402

AB = "a, b = map(int, input().split())\nprint(a + b)\n"


def workload():
    """(response, tests) pairs: HumanEval canonical solutions and a+b programs with 5 tests each."""
    items = []
    for r in humaneval_problems():
        tests = humaneval_question_and_tests(r)[1]
        items.append((f"```python\n{r['prompt']}{r['canonical_solution']}\n```", tests))
    for i in range(40):
        tests = {"inputs": [f"{i} {j}\n" for j in range(5)], "outputs": [f"{i + j}\n" for j in range(5)]}
        items.append((f"```python\n{AB}```", tests))
    return items


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run_sandboxed(box: CodeSandbox, items, workers: int):
    results = grade_code_batch([r for r, _ in items], [t_ for _, t_ in items], sandbox=box, workers=workers)
    bad = [res for res in results if res.status != "ok"]
    assert not bad, f"{len(bad)} correct programs did not pass: {bad[:3]}"


def _plain_one(python: str, response: str, tests: dict) -> bool:
    code = response.split("```python\n", 1)[1].rsplit("```", 1)[0]
    t = parse_tests(tests)
    env = {"PATH": "/usr/bin:/bin"}
    if t.mode == "assert":
        program = t.prefix + "\n" + code + "\n" + t.test_code + f"\ncheck({t.entry_point})\n"
        return subprocess.run([python, "-I", "-S", "-c", program], capture_output=True, env=env).returncode == 0
    for stdin, expected in zip(t.inputs, t.outputs):
        out = subprocess.run([python, "-I", "-S", "-c", code], input=stdin.encode(), capture_output=True, env=env)
        if out.returncode != 0 or not outputs_match(out.stdout.decode(), expected):
            return False
    return True


def run_plain(python: str, items, workers: int):
    with ThreadPoolExecutor(workers) as ex:
        ok = list(ex.map(lambda it: _plain_one(python, *it), items))
    assert all(ok), f"{ok.count(False)} programs failed unsandboxed"


FAST = "a, b = map(int, input().split())\nprint(a + b)\n"
LOOPING = "while True:\n    pass\n"
NEAR_LIMIT = "import time\nwhile time.process_time() < {cpu}:\n    pass\na, b = map(int, input().split())\nprint(a + b)\n"


def step_workload(n: int, tests: int, timeout: float, seed: int = 0):
    """(kind, response, tests) for a recipe-shaped step: 8/10 fast, 1/10 looping, 1/10 near the CPU limit."""
    import random

    kinds = ["looping" if i % 10 == 0 else "near_limit" if i % 10 == 1 else "fast" for i in range(n)]
    random.Random(seed).shuffle(kinds)
    out = []
    for i, kind in enumerate(kinds):
        program = {"fast": FAST, "looping": LOOPING, "near_limit": NEAR_LIMIT.format(cpu=0.6 * timeout)}[kind]
        t = {"inputs": [f"{i} {j}\n" for j in range(tests)], "outputs": [f"{i + j}\n" for j in range(tests)]}
        out.append((kind, f"```python\n{program}```", t))
    return out


def _percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, max(0, int(round(q * (len(values) - 1)))))]


def run_step(items, workers: int, timeout: float, after: bool) -> dict:
    """Grade the step once; per-response grading times, makespan and lost rewards."""
    from openrlhf_lpo.rewards.code import grade_code

    box = CodeSandbox(SandboxConfig(timeout_s=timeout, workers=workers, wall_mode="unqueued" if after else "elapsed"))
    box.ensure_ready()

    def one(item):
        kind, response, tests = item
        t0 = time.perf_counter()
        result = grade_code(response, tests, sandbox=box, stop_on_timeout=after)
        return kind, result, time.perf_counter() - t0

    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as ex:
        graded = list(ex.map(one, items))
    makespan = time.perf_counter() - t0
    lat = [s for _, _, s in graded]
    lost = {k: sum(1 for kind, r, _ in graded if kind == k and r.reward("fraction") < 1.0) for k in ("fast", "near_limit")}
    wrong = [r for kind, r, _ in graded if kind == "looping" and r.reward("fraction") > 0]
    assert not wrong, f"looping programs earned reward: {wrong[:3]}"
    return {
        "makespan_s": makespan, "latency_p50_s": _percentile(lat, 0.5), "latency_p99_s": _percentile(lat, 0.99),
        "latency_max_s": max(lat), "lost_fast": lost["fast"], "lost_near_limit": lost["near_limit"],
        "looping_latency_max_s": max(s for kind, _, s in graded if kind == "looping"),
    }


def step_main(args) -> int:
    items = step_workload(args.responses, args.tests, args.timeout)
    n_kind = {k: sum(1 for kind, _, _ in items if kind == k) for k in ("fast", "looping", "near_limit")}
    levels = [int(x) for x in args.oversubscription.split(",")]
    print(f"step: {args.responses} responses x {args.tests} tests ({n_kind['fast']} fast, {n_kind['looping']} looping, "
          f"{n_kind['near_limit']} correct at 0.6 of the {args.timeout:g} s CPU limit), {args.cores} cores, "
          f"oversubscription {levels}")
    rows = []
    for k in levels:
        for after in (False, True):
            row = {"oversubscription": k, "workers": k * args.cores, "mode": "after" if after else "before",
                   **run_step(items, k * args.cores, args.timeout, after), "load_average": os.getloadavg()[0]}
            row["responses_per_s_per_core"] = args.responses / row["makespan_s"] / args.cores
            rows.append(row)
            print(f"{k}x {row['mode']:6s} workers {row['workers']:3d}: {row['responses_per_s_per_core']:6.2f} responses/s/core, "
                  f"makespan {row['makespan_s']:7.1f} s, per response p50 {row['latency_p50_s']:5.2f} p99 "
                  f"{row['latency_p99_s']:6.2f} max {row['latency_max_s']:6.2f} s; lost reward: "
                  f"{row['lost_near_limit']}/{n_kind['near_limit']} near-limit, {row['lost_fast']}/{n_kind['fast']} fast "
                  f"(load average {row['load_average']:.1f})", flush=True)
    for k in levels:
        before, after = (r for r in rows if r["oversubscription"] == k)
        print(f"{k}x after/before: makespan {after['makespan_s'] / before['makespan_s']:.2f}, p99 "
              f"{after['latency_p99_s'] / before['latency_p99_s']:.2f}, max {after['latency_max_s'] / before['latency_max_s']:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"responses": args.responses, "tests": args.tests, "timeout_s": args.timeout,
                       "cores": args.cores, "kinds": n_kind, "runs": rows}, f, indent=1)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="also write the numbers as JSON")
    p.add_argument("--step", action="store_true", help="the recipe-shaped step instead of the throughput comparison")
    p.add_argument("--responses", type=int, default=1024)
    p.add_argument("--tests", type=int, default=10)
    p.add_argument("--timeout", type=float, default=1.0, help="CPU seconds per test")
    p.add_argument("--oversubscription", default="1,2", help="concurrent sandboxes per core, comma-separated")
    p.add_argument("--cores", type=int, default=None, help="cores to size the workers by (default: usable cores)")
    args = p.parse_args(argv)
    if args.step:
        from openrlhf_lpo.rewards.sandbox_budget import usable_cores

        args.cores = args.cores or usable_cores()
        return step_main(args)
    items = workload()
    n = len(items)
    bwrap = CodeSandbox(SandboxConfig(workers=args.workers))
    bwrap.ensure_ready()
    none = CodeSandbox(SandboxConfig(mode="none", workers=args.workers))
    none.ensure_ready()
    python = bwrap.ensure_ready().argv[bwrap.ensure_ready().argv.index("--") + 1]  # the same interpreter
    runs = {
        "bwrap": lambda: run_sandboxed(bwrap, items, args.workers),
        "none": lambda: run_sandboxed(none, items, args.workers),
        "plain": lambda: run_plain(python, items, args.workers),
    }
    wall = {k: [] for k in runs}
    run_sandboxed(bwrap, items[:8], args.workers)  # warm the page cache
    for _ in range(args.rounds):
        for k, fn in runs.items():
            wall[k].append(timed(fn))
    rate = {k: n / statistics.median(v) for k, v in wall.items()}
    tests = sum(parse_tests(t).total for _, t in items)
    print(f"{n} correct programs ({tests} tests), {args.workers} workers, {args.rounds} rounds, sandbox: "
          f"{bwrap.description}")
    print(f"{'mode':8s} {'median s':>9s} {'programs/s':>11s} {'per core':>9s}")
    for k in runs:
        print(f"{k:8s} {statistics.median(wall[k]):9.2f} {rate[k]:11.1f} {rate[k] / args.workers:9.1f}")
    result = {
        "programs": n, "tests": tests, "workers": args.workers, "wall_s": wall,
        "programs_per_s": rate, "programs_per_s_per_core": {k: v / args.workers for k, v in rate.items()},
        "ratio_bwrap_vs_plain": rate["bwrap"] / rate["plain"], "ratio_bwrap_vs_none": rate["bwrap"] / rate["none"],
        "sandbox": bwrap.description, "load_average": os.getloadavg(),
    }
    print(f"throughput ratio bwrap/plain = {result['ratio_bwrap_vs_plain']:.2f}, "
          f"bwrap/none = {result['ratio_bwrap_vs_none']:.2f}  (load average {os.getloadavg()[0]:.1f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
