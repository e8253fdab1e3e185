"""Runs a study's matrix, ``jobs`` runs at a time: a finished run is never rerun, a killed one resumes.

Two markers in each run's directory, both written atomically (:mod:`openrlhf_lpo.compare.files`):

* ``attempt.json`` when an attempt starts: the run's settings hash and the attempt number;
* ``done.json`` when the run finished: the settings hash, the job's result and the wall time.

Per run, :func:`decide` picks one of

* ``skip`` (policy ``resume``): ``done.json`` holds this settings hash and the metrics file is there; nothing
  runs;
* ``resume`` (policy ``resume``): ``attempt.json`` holds this hash and there is no ``done.json`` (the last
  attempt was killed or failed); the job starts again in the same directory, where ``lpo-train`` continues
  from the run's last checkpoint (its flags carry ``--ckpt.load_enable``);
* ``fresh``: anything else (no attempt yet, other settings, or policy ``fresh``: every run again); the run's
  directory and metrics file are removed first, so nothing of another run is loaded.

A job is an object with ``run(spec, attempt) -> dict`` (raises on failure) and ``stop()`` (Ctrl-C: stop every
process it started). Runs of a job run in threads; each ``lpo-train`` is a process of its own.
"""

from __future__ import annotations

import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Protocol, Sequence

from openrlhf_lpo.compare.files import atomic_write_json, read_json
from openrlhf_lpo.compare.plan import RunSpec

DONE, ATTEMPT = "done.json", "attempt.json"
POLICIES = ("resume", "fresh")


class Job(Protocol):
    def run(self, spec: RunSpec, attempt: Dict) -> Dict: ...

    def stop(self) -> None: ...


def decide(spec: RunSpec, policy: str = "resume") -> str:
    """``skip``, ``resume`` or ``fresh`` for ``spec`` (module docstring)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}; got {policy!r}")
    if policy == "fresh":
        return "fresh"
    done = read_json(spec.work_dir / DONE)
    if done and done.get("settings_hash") == spec.settings_hash and spec.metrics_path.exists():
        return "skip"
    if done:
        return "fresh"
    attempt = read_json(spec.work_dir / ATTEMPT)
    if attempt and attempt.get("settings_hash") == spec.settings_hash:
        return "resume"
    return "fresh"


def start_attempt(spec: RunSpec, decision: str) -> Dict:
    """Prepare the run's directory for an attempt and write its ``attempt.json``; returns the attempt."""
    previous = read_json(spec.work_dir / ATTEMPT) if decision == "resume" else None
    if decision == "fresh":
        shutil.rmtree(spec.work_dir, ignore_errors=True)
        spec.metrics_path.unlink(missing_ok=True)
    spec.work_dir.mkdir(parents=True, exist_ok=True)
    spec.metrics_path.parent.mkdir(parents=True, exist_ok=True)
    attempt = {"settings_hash": spec.settings_hash, "n": (previous or {}).get("n", 0) + 1,
               "resume": decision == "resume", "started": time.time(), "method": spec.method, "seed": spec.seed}
    atomic_write_json(spec.work_dir / ATTEMPT, attempt)
    return attempt


def mark_done(spec: RunSpec, attempt: Dict, result: Dict, wall_s: float) -> Dict:
    done = {**result, "settings_hash": spec.settings_hash, "attempts": attempt["n"], "wall_s": wall_s,
            "finished": time.time(), "method": spec.method, "seed": spec.seed}
    atomic_write_json(spec.work_dir / DONE, done)
    return done


def run_matrix(specs: Sequence[RunSpec], job: Job, jobs: int = 1, policy: str = "resume",
               record: Optional[Callable[[RunSpec, Dict], None]] = None,
               log: Callable[[str], None] = lambda msg: None) -> Dict[str, Dict]:
    """Run every spec that is not finished, ``jobs`` at a time, in ``specs`` order; returns ``{key: status}``
    (``state``: done, failed or interrupted; ``kept`` for a run finished before). ``record(spec, status)``
    sees every change (the caller writes its status files). Ctrl-C stops the job's processes, records the
    runs that did not finish as interrupted, and raises KeyboardInterrupt."""
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1; got {jobs}")
    statuses: Dict[str, Dict] = {}
    lock = threading.Lock()
    stopping = threading.Event()

    def set_status(spec: RunSpec, entry: Dict) -> None:
        with lock:
            statuses[spec.key] = entry
            if record is not None:
                record(spec, entry)

    todo: List = []
    for spec in specs:
        decision = decide(spec, policy)
        if decision == "skip":
            set_status(spec, {**read_json(spec.work_dir / DONE), "state": "done", "kept": True})
            log(f"{spec.key}: finished before, kept")
        else:
            todo.append((spec, decision))
            set_status(spec, {"state": "pending", "decision": decision})

    def one(spec: RunSpec, decision: str) -> None:
        if stopping.is_set():
            return
        attempt = start_attempt(spec, decision)
        log(f"{spec.key}: {'resuming (attempt ' + str(attempt['n']) + ')' if attempt['resume'] else 'starting'}")
        set_status(spec, {"state": "running", "attempt": attempt["n"], "resume": attempt["resume"]})
        t0 = time.time()
        try:
            result = job.run(spec, attempt)
        except Exception as e:  # keep what finished; the next invocation resumes this run
            state = "interrupted" if stopping.is_set() else "failed"
            set_status(spec, {"state": state, "attempt": attempt["n"], "wall_s": time.time() - t0,
                              "error": f"{type(e).__name__}: {e}"})
            log(f"{spec.key} {state}: {type(e).__name__}: {e}")
            return
        set_status(spec, {**mark_done(spec, attempt, result, time.time() - t0), "state": "done"})
        log(f"{spec.key}: done in {time.time() - t0:.0f}s")

    if not todo:
        return statuses
    pool = ThreadPoolExecutor(max_workers=min(jobs, len(todo)))
    futures = [pool.submit(one, *t) for t in todo]
    try:
        for f in futures:
            f.result()
    except KeyboardInterrupt:
        stopping.set()
        job.stop()
        pool.shutdown(wait=False, cancel_futures=True)
        for spec, _ in todo:
            if statuses[spec.key]["state"] in ("pending", "running"):
                set_status(spec, {**statuses[spec.key], "state": "interrupted"})
        raise
    pool.shutdown()
    return statuses
