"""One local Ray cluster per test process, shared by every ``lpo-train`` launch of the end-to-end tests.

A launch that starts its own cluster pays Ray's start-up (GCS, raylet, dashboard and runtime-env agents,
log monitor, idle workers started ahead): measured on a quiet 2-core machine, a one-rank two-step launch
took 67 s and 110 CPU-s on its own cluster, 56 s and 94 CPU-s on a shared one. Here the first launch of
a pytest process (an xdist worker) starts a head with 16 logical CPU and GPU slots, the size
``lpo-train``'s CPU mode gives its own cluster, and later launches join it through ``RAY_ADDRESS`` with
``LPO_CPU_MODE=1`` (the environment's ``--cpu.mode on``: ``auto`` would see the logical GPUs and pick the
GPU pipeline). Each launch is its own Ray job: its actors, placement groups and runtime env (the
``LPO_*`` variables, ``tests/pipeline/e2e_common.run_env``) end with its driver. A run that a test kills
like a node (SIGKILL of its process group) starts its own cluster instead (``run_env(shared_ray=False)``):
on the shared one its actors would outlive the driver for a moment and could finish a step.
``LPO_TEST_SHARED_RAY=0`` gives every launch its own cluster again.

The head is a driver process of its own (``ray.init``), not ``ray start``: that would record its address
in ``/tmp/ray/ray_current_cluster``, where every plain ``ray.init()`` on the machine (the other xdist
worker's in-process tests) would find it. For the same reason a simulated multi-node cluster
(``ray.cluster_utils.Cluster``, which records its address too) starts and stops inside :func:`private_ray_tmpdir`,
and the tests' own local clusters start with ``address="local"`` (a recorded cluster, such as one ``ray start``
left on the machine, is then not joined). It lives while this process holds its stdin open. Tests about
starting Ray (``test_cpu_mode_decision.py``, the cannot-fit dry run, the multi-node placement checks) keep
their own clusters.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, Iterator

HEAD_SLOTS = 16  # logical CPU and GPU slots, as openrlhf_lpo.cpu.mode.init_ray's local cluster
HEAD = r"""
import sys, ray
# no idle workers started ahead: every actor of a launch needs a worker with its own job's runtime env
ray.init(address="local", num_cpus=int(sys.argv[1]), num_gpus=int(sys.argv[1]), object_store_memory=1 << 30,
         include_dashboard=False,
         _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False})
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()  # until the test process closes the pipe (or exits)
ray.shutdown()
"""
_HEAD = None  # (process, address)


def enabled() -> bool:
    return os.environ.get("LPO_TEST_SHARED_RAY", "1") != "0"


def shared_ray_env() -> Dict[str, str]:
    """``{"RAY_ADDRESS": ..., "LPO_CPU_MODE": "1"}`` for a launch that joins this process's cluster
    (started on the first call); ``{}`` with ``LPO_TEST_SHARED_RAY=0``."""
    global _HEAD
    if not enabled():
        return {}
    if _HEAD is None or _HEAD[0].poll() is not None:
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "LPO_CPU_MODE")}
        proc = subprocess.Popen([sys.executable, "-c", HEAD, str(HEAD_SLOTS)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
        address = proc.stdout.readline().strip()
        if not address:
            proc.kill()
            raise RuntimeError("the shared Ray head did not start (LPO_TEST_SHARED_RAY=0 runs without it)")
        _HEAD = (proc, address)
    return {"RAY_ADDRESS": _HEAD[1], "LPO_CPU_MODE": "1"}


def shutdown() -> None:
    """Stop this process's cluster (pytest_sessionfinish; a process that dies closes the pipe too)."""
    global _HEAD
    if _HEAD is not None:
        proc = _HEAD[0]
        _HEAD = None
        proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def private_ray_tmpdir(path: str = None) -> Iterator[str]:
    """``RAY_TMPDIR`` of this process set to ``path`` (default: a new short folder under /tmp, where Ray's
    sockets fit) while the block runs: a ``ray.cluster_utils.Cluster`` started inside keeps its session and the
    record of its address there, not in ``/tmp/ray`` (where a plain ``ray.init()`` anywhere on the machine would
    join it, and its shutdown would delete a ``ray start`` cluster's record). Yields the folder; the caller
    removes it (:func:`remove_ray_tmpdir`) after the cluster's shutdown, done inside the same context."""
    path = path or tempfile.mkdtemp(prefix="lpo-ray-", dir="/tmp")
    saved = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = path
    try:
        yield path
    finally:
        if saved is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = saved


def remove_ray_tmpdir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
