"""The pytest side of the shared Megatron gloo world: launching it and reading its records.

Each rank writes OUT/rank{R}.json (``mcore_checks/runner.py``): ``checks`` (the numbers, keyed as the tests
read them), ``status`` (per check name: ``ok``, ``error`` = the traceback, ``seconds``), and
``world_broken`` when the barrier after a check failed. A test asks :func:`world_checks` for the checks it
reads: a check that failed, or never ran, fails that test with the check's name and traceback.
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from .mcore_checks import ORDER

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WORLD = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_world(out_dir: Path, world: int = WORLD, suite: str = "all", timeout: int = 1500,
                 worker: str = "mcore_worker.py", env: dict = None):
    """Run ``worker`` (default ``mcore_worker.py``) on ``world`` gloo ranks with ``MCORE_WORKER_SUITE=suite``
    (and ``env`` on top); return the per-rank records."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MCORE_WORKER_SUITE=suite, **(env or {}))
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    port = str(_free_port())
    procs = []
    for r in range(world):
        log = open(out_dir / f"log{r}.txt", "w")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(HERE / worker), str(r), str(world), port, str(out_dir)],
                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO),
            )
        )
    try:
        deadline = time.time() + timeout
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        pass  # what each rank wrote stands: it writes its record after every check
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for r in range(world):
        f = out_dir / f"rank{r}.json"
        if not f.exists():
            tail = (out_dir / f"log{r}.txt").read_text()[-4000:]
            raise AssertionError(f"rank {r} wrote no result; log tail:\n{tail}")
        results.append(json.loads(f.read_text()))
    return results


def check_problems(world, names):
    """Lines naming each of ``names`` that did not run ok, with its ranks and its traceback (or why it did
    not run); the same error on several ranks is given once."""
    by_error = {}  # (check, message) -> ranks
    for rec in world:
        for name in names:
            st = rec.get("status", {}).get(name)
            if st is None:
                why = ("the rank failed before its first check:\n" + rec["error"]) if rec.get("error") else \
                    "it never started: the rank ended before it (killed at the launch's timeout, or crashed)"
                msg = f"not run: {why}"
            elif st["ok"]:
                continue
            else:
                msg = st["error"]
            by_error.setdefault((name, msg), []).append(rec["rank"])
    return [f"check {name!r} on rank(s) {ranks}: {msg}" for (name, msg), ranks in by_error.items()]


def world_checks(world, *names):
    """Each rank's ``checks`` (the measured numbers), after asserting that the checks ``names`` ran ok on
    every rank; else an AssertionError that names the check and carries its traceback."""
    unknown = [n for n in names if n not in ORDER]
    assert not unknown, f"no check named {unknown} in mcore_checks.ORDER"
    problems = check_problems(world, names)
    if problems:
        raise AssertionError("\n\n".join(problems))
    return [rec["checks"] for rec in world]
