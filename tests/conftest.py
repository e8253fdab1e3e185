"""Fixtures shared by several test directories.

``demo_ci_run``: the one demo run CI pays for. ``lpo-demo --preset ci`` (warm-up of the demo's tiny
Qwen3 on pairsum to 25% sampled accuracy, so groups are informative, then LPO-fwd and GRPO through
``lpo-train``), here with two data-parallel ranks, 4 steps and micro-batches of 2 (< K: the first
window of each batch takes c from s_t, the second a no-grad pre-pass). tests/demo checks the demo's
outputs on it; tests/pipeline/test_e2e_cpu_pipeline.py checks its LPO job's training, weight syncs and
checkpoints.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Offline before anything imports huggingface_hub (it reads these once): a hub name that is not cached fails at
# once instead of after five retries (about 23 s each).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:  # --import-mode=importlib: the helpers shared by every test directory (shared_ray)
    sys.path.insert(0, TESTS)

from shared_ray import shared_ray_env, shutdown as shutdown_shared_ray  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEMO_CI_PIPELINE_ARGS = "--actor.num_gpus_per_node 2 --train.micro_batch_size 2 --rollout.micro_batch_size 2"
DEMO_CI_STEPS = 4


@pytest.fixture(scope="session")
def demo_ci_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo_ci")
    run = root / "run"
    env = dict(os.environ, LPO_CACHE_DIR=str(root / "cache"), OMP_NUM_THREADS="1",
               LPO_CPU_PARITY_LOG=str(root / "parity.jsonl"))
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    for key in ("RAY_ADDRESS", "LPO_CPU_MODE"):
        env.pop(key, None)
    env.update(shared_ray_env())  # both methods' lpo-train runs join this worker's Ray cluster
    proc = subprocess.run([sys.executable, "-m", "openrlhf_lpo.demo.cli", "--preset", "ci", "--run-dir", str(run),
                           "--no-progress", "--steps", str(DEMO_CI_STEPS), "--pipeline-args", DEMO_CI_PIPELINE_ARGS,
                           "--jobs", "1"],  # one job after the other: the parity log is LPO's, then GRPO's
                          env=env, capture_output=True, text=True, timeout=1800, cwd=str(REPO))
    return {"root": root, "run": run, "proc": proc, "parity_log": root / "parity.jsonl", "steps": DEMO_CI_STEPS}


# Fixtures that start a pipeline, a Ray cluster or a multi-process world: a test that uses one is an
# end-to-end test (left out of ``run_tests.sh --quick``).
HEAVY_FIXTURES = ("demo_ci_run", "mcore_world", "ray_head", "dry_runs", "multinode")

# Under pytest-xdist (``run_tests.sh`` runs 2 workers) a module's tests run on one worker, so a module-scoped
# fixture starts once; the modules that share a session-scoped heavy fixture are one unit (a session fixture
# starts once per worker that uses it). pytest 9 ignores the node-id suffix behind xdist's ``--dist
# loadgroup``, hence a scheduler of our own (below). Checked at collection: a module that uses one of these
# fixtures must be listed here.
SHARED_SESSION_MODULES = {
    "tests/demo/test_demo_ci_run.py": "demo_ci_run",
    "tests/pipeline/test_e2e_cpu_pipeline.py": "demo_ci_run",
    "tests/megatron/test_megatron_layouts.py": "mcore_world",
    "tests/megatron/test_megatron_training.py": "mcore_world",
    "tests/megatron/test_megatron_parallel.py": "mcore_world",
}
# Directories that are one unit: the code-sandbox tests count sandbox processes and host uids machine-wide,
# so no other sandbox may run meanwhile (the code e2e's reward runs in one).
SHARED_DIRECTORIES = {"tests/code/": "tests/code"}
# the longest units first (measured: docs/testing.md), so that none of them starts when the other worker is
# almost done
FIRST = ("tests/pipeline/test_e2e_research.py", "demo_ci_run", "tests/megatron/test_megatron_pipeline_e2e.py",
         "tests/pipeline/test_e2e_families.py", "tests/pipeline/test_e2e_layouts.py", "mcore_world",
         "tests/pipeline/test_e2e_hybrid.py", "tests/code", "tests/pipeline/test_e2e_reward_errors.py",
         "tests/pipeline/test_dry_run.py", "tests/megatron/test_megatron_gpu_check.py",
         "tests/pipeline/test_e2e_vlm_pipeline.py")


def work_unit(nodeid: str) -> str:
    """The xdist work unit of a test: its module, the shared session fixture of its module, or its
    directory (:data:`SHARED_DIRECTORIES`)."""
    module = nodeid.split("::", 1)[0]
    for prefix, unit in SHARED_DIRECTORIES.items():
        if module.startswith(prefix):
            return unit
    return SHARED_SESSION_MODULES.get(module, module)


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ModuleUnits(LoadScopeScheduling):
        """xdist's load-scope scheduling with :func:`work_unit` as the scope, in collection order. A worker
        gets its next unit only when it runs the last test of its current one (xdist's default sends it
        when two are left: a worker that runs a one-test unit would take two of the long units at once)."""

        def __init__(self, config, log=None):
            super().__init__(config, log)
            config.option.loadscopereorder = False  # keep the order below (longest units first)

        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

        def _reschedule(self, node) -> None:
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
            elif self._pending_of(self.assigned_work[node]) <= 1:  # the worker holds its last test until
                self._assign_work_unit(node)                      # it knows the next one

    return ModuleUnits(config, log)


def pytest_collection_modifyitems(config, items):
    """Mark the users of :data:`HEAVY_FIXTURES` e2e, check :data:`SHARED_SESSION_MODULES`, and order the
    work units: :data:`FIRST`, then the other units with an e2e test, then the rest (stable within)."""
    shared = {"demo_ci_run", "mcore_world"}
    for item in items:
        used = set(item.fixturenames) & set(HEAVY_FIXTURES)
        if used:
            item.add_marker(pytest.mark.e2e)
        module = item.nodeid.split("::", 1)[0]
        for name in used & shared:
            if SHARED_SESSION_MODULES.get(module) != name:
                raise pytest.UsageError(f"{module} uses the session fixture {name}: add it to "
                                        "SHARED_SESSION_MODULES in tests/conftest.py (one xdist worker runs them)")
    heavy = {work_unit(i.nodeid) for i in items if i.get_closest_marker("e2e")}

    def rank(item):
        unit = work_unit(item.nodeid)
        return (FIRST.index(unit) if unit in FIRST else len(FIRST) + (unit not in heavy))

    items.sort(key=rank)


def pytest_sessionfinish(session, exitstatus):
    shutdown_shared_ray()  # this process's shared Ray cluster, if an end-to-end test started one
