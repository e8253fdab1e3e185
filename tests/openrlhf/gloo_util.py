"""Helpers of the gloo multi-process tests (imported by name: ``conftest`` is not unique across test dirs)."""

import os
import socket

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_dp2_matrix(model_dir, out, *extra):
    """Start the two gloo ranks of ``lpo_dp_worker.py`` (rank 0 writes the exactness table to ``out``)."""
    import subprocess
    import sys

    port = str(free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return [subprocess.Popen([sys.executable, os.path.join(HERE, "lpo_dp_worker.py"), str(r), "2", port, model_dir,
                              out, *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in range(2)]


def collect_dp2_matrix(procs, out, timeout=1200):
    """Wait for the ranks (failing with the tail of their log) and read rank 0's table."""
    import json
    import subprocess

    for p in procs:
        try:
            stdout, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, _ = p.communicate()
        assert p.returncode == 0, f"dp=2 worker failed:\n{stdout[-3000:]}"
    with open(out) as f:
        return json.load(f)


def kill_all(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
