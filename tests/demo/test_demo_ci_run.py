"""A shortened ``lpo-demo`` through the real pipeline: warm-up, LPO-fwd and GRPO via lpo-train
(Ray, OpenRLHF actors, CPU rollout engine, the demo's reward file), held-out evaluation of the
saved checkpoints, metrics, plot, summary.

The ``ci`` preset: the demo's tiny Qwen3 warmed up on ``pairsum`` until its sampled accuracy reaches
25% (a fresh private cache; ~200 supervised steps), K=4, 4 prompts per step, 2 RL steps per method.
With p ~ 0.25 a group of 4 is informative (unequal rewards) with probability ~0.68, so 8 groups per
method all being degenerate has probability ~1e-4; the checks below fail if it happens.
The assertions live in ``demo_checks`` so a shared end-to-end fixture can reuse them.
"""

import os
import subprocess
import sys

import pytest

from demo_checks import (check_heldout, check_informative, check_layout, check_paired_rollouts, check_pipeline_rows,
                         check_same_start, check_warmup, load_rows)


@pytest.mark.timeout(1500)
def test_ci_preset_end_to_end(tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, LPO_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "openrlhf_lpo.demo.cli", "--preset", "ci", "--run-dir", str(run),
                           "--no-progress"], env=env, capture_output=True, text=True, timeout=1450)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    methods = ["lpo-fwd", "grpo"]
    config = check_layout(run, methods)
    assert config["backend"] == "pipeline" and config["rl"]["task"] == "pairsum"
    k, g, steps = config["rl"]["k"], config["rl"]["prompts_per_step"], config["rl"]["steps"]
    warm = check_warmup(run, min_accuracy=0.25)
    assert warm["cached"] is False
    rows = {m: load_rows(run, m) for m in methods}
    for name in methods:
        train = check_pipeline_rows(rows[name], name, k, g, steps)
        check_informative(train, k)
        check_heldout(rows[name], config["rl"]["eval_samples"])
        assert (run / "pipeline" / name / "command.txt").read_text().startswith("lpo-train ")
    check_same_start(rows)
    check_paired_rollouts(rows)  # same seed: same prompts and the same step-1 samples for every method
