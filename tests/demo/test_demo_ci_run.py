"""A shortened ``lpo-demo`` through the real pipeline: warm-up, LPO-fwd and GRPO via lpo-train
(Ray, OpenRLHF actors, CPU rollout engine, the demo's reward file), held-out evaluation of the
saved checkpoints, metrics, plot, summary.

The ``ci`` preset: the demo's tiny Qwen3 warmed up on ``pairsum`` until its sampled accuracy reaches
25% (a fresh private cache; ~200 supervised steps), K=4, 4 prompts per step; the shared run
(tests/conftest.py ``demo_ci_run``) gives each job 2 data-parallel ranks and 4 RL steps.
With p ~ 0.25 a group of 4 is informative (unequal rewards) with probability ~0.68, so 8 groups per
method all being degenerate has probability ~1e-4; the checks below fail if it happens.
The assertions live in ``demo_checks`` so a shared end-to-end fixture can reuse them.
"""

import pytest

from demo_checks import (check_heldout, check_informative, check_layout, check_paired_rollouts, check_pipeline_rows,
                         check_same_start, check_study_files, check_warmup, load_rows)

pytestmark = pytest.mark.e2e  # the demo through lpo-train (two pipeline runs)


@pytest.mark.timeout(1900)
def test_ci_preset_end_to_end(demo_ci_run):
    """The shared demo run (tests/conftest.py: the ci preset with 2 data-parallel ranks and 4 steps)."""
    run, proc = demo_ci_run["run"], demo_ci_run["proc"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    methods = ["lpo-fwd", "grpo"]
    config = check_layout(run, methods)
    assert config["backend"] == "pipeline" and config["rl"]["task"] == "pairsum"
    k, g, steps = config["rl"]["k"], config["rl"]["prompts_per_step"], config["rl"]["steps"]
    assert steps == demo_ci_run["steps"] and config["rl"]["pipeline_args"][:2] == ["--actor.num_gpus_per_node", "2"]
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
    check_study_files(run, methods, baseline="grpo")  # the demo is lpo-compare's runner and table for one seed
