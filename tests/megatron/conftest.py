"""Shared gloo world for the Megatron tests: one launch of 4 ranks runs every layout check.

Each rank of tests/megatron/mcore_worker.py builds actors in all layouts in turn (re-initialising
megatron's parallel state on the same process group), then runs the sequence-parallel and virtual-pipeline
checks of mcore_parallel_worker.py, so process start-up and imports are paid once per session.
OMP_NUM_THREADS=1 per rank.
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WORLD = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_world(out_dir: Path, world: int = WORLD, suite: str = "layouts", timeout: int = 1500,
                 worker: str = "mcore_worker.py"):
    """Run ``worker`` (default ``mcore_worker.py``) on ``world`` gloo ranks; return the per-rank result dicts."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MCORE_WORKER_SUITE=suite)
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
        pass  # what each rank wrote stands (the layout checks are written before the parallel ones)
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


@pytest.fixture(scope="session")
def mcore_world(tmp_path_factory):
    """Every rank's record: the layout checks (``checks``), then the sequence-parallel and virtual-pipeline
    checks of mcore_parallel_worker.py in the same world (``parallel``)."""
    return launch_world(tmp_path_factory.mktemp("mcore_world"))
