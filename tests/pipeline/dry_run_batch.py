"""Run many ``lpo-train --dry-run`` command lines in one Python process (the imports paid once).

    python tests/pipeline/dry_run_batch.py JOBS.json OUT.json

JOBS.json: ``[{"name": ..., "argv": [...], "env": {...}}]``, each argv what a recipe script hands to
``python -m openrlhf_lpo.cli.train_ppo_ray`` (its ``LPO_PRINT_ARGS=1`` output) plus ``--dry-run``. Each job runs
``main(argv)`` with the process environment replaced by its ``env``, from the repository root as the scripts
do, and records its exit status, stdout and stderr; OUT.json is written atomically at the end.
tests/pipeline/test_dry_run.py checks that a script's own dry run prints what its job prints here.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback


def run_job(job: dict) -> dict:
    from openrlhf_lpo.cli.train_ppo_ray import main

    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(job["env"])
    out, err = io.StringIO(), io.StringIO()
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(list(job["argv"]))
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception:  # noqa: BLE001  (recorded: the test shows it)
                traceback.print_exc()
                code = 1
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def run_batch(jobs: list, root, timeout: int = 900) -> dict:
    """Run ``jobs`` through this script in one subprocess (files under ``root``); ``{name:
    CompletedProcess}`` of each job's exit status, stdout and stderr."""
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    jobs_path, out_path = Path(root) / "jobs.json", Path(root) / "batch.json"
    jobs_path.write_text(json.dumps(jobs))
    env = dict(os.environ, PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, __file__, str(jobs_path), str(out_path)], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=str(repo))
    assert done.returncode == 0, done.stderr[-3000:]
    return {name: subprocess.CompletedProcess([name], r["returncode"], r["stdout"], r["stderr"])
            for name, r in json.loads(out_path.read_text()).items()}


def main(argv=None) -> int:
    jobs_path, out_path = (argv or sys.argv[1:])[:2]
    jobs = json.load(open(jobs_path))
    results = {job["name"]: run_job(job) for job in jobs}
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f)
    os.replace(tmp, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
