"""Fixtures shared by several test directories.

``demo_ci_run``: the one demo run CI pays for. ``lpo-demo --preset ci`` (warm-up of the demo's tiny
Qwen3 on pairsum to 25% sampled accuracy, so groups are informative, then LPO-fwd and GRPO through
``lpo-train``), here with two data-parallel ranks, 4 steps and micro-batches of 2 (< K: the first
window of each batch takes c from s_t, the second a no-grad pre-pass). tests/demo checks the demo's
outputs on it; tests/pipeline/test_e2e_cpu_pipeline.py uses its LPO job as the uninterrupted run that
a killed-and-resumed run must reproduce.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    proc = subprocess.run([sys.executable, "-m", "openrlhf_lpo.demo.cli", "--preset", "ci", "--run-dir", str(run),
                           "--no-progress", "--steps", str(DEMO_CI_STEPS), "--pipeline-args", DEMO_CI_PIPELINE_ARGS],
                          env=env, capture_output=True, text=True, timeout=1800, cwd=str(REPO))
    return {"root": root, "run": run, "proc": proc, "parity_log": root / "parity.jsonl", "steps": DEMO_CI_STEPS}
