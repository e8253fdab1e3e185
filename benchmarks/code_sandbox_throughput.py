"""Code-reward throughput: correct programs per second per core, sandboxed vs. unsandboxed, same run.

    python benchmarks/code_sandbox_throughput.py [--workers 2] [--rounds 3] [--out code_throughput.json]

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="also write the numbers as JSON")
    args = p.parse_args(argv)
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
