"""lpo-train end to end in OpenRLHF's async recipe (configs/families/async.sh: partial rollout, behaviour log-probs from
the engine, LPO's listwise off-policy correction; micro-batches of K: the one-pass path) and a DAPO run
(configs/methods/dapo.sh) with the listwise metrics and OpenRLHF's ``--eval.*`` path, both over partial last batches
and two episodes on one rank. The long-context hybrid recipe on two ranks: test_e2e_hybrid.py; GRPO's listwise
metrics on two ranks: the demo's CI run (tests/demo/test_demo_ci_run.py, GRPO at dp 2 checks lpo/kl_end every step)
and, against brute force with groups split across two gloo ranks,
tests/openrlhf/test_lpo_gradient_exactness.py::test_pg_end_kl_with_groups_split_across_two_ranks.
"""

import pytest

from e2e_common import family_flags, method_flags, run_family, tb_steps

pytestmark = pytest.mark.e2e  # two lpo-train runs (async LPO, DAPO with --eval.*)


@pytest.fixture(scope="module")
def families(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {
        # OpenRLHF's async recipe: partial rollout, behaviour log-probs from the engine, LPO's
        # listwise off-policy correction (token clip); micro-batches of K: the one-pass path
        "async": run_family(tiny_model_dir, root, "async", dp=1, micro=4, extra=[
            *family_flags("async"), "--eval.dataset", str(root / "prompts6.jsonl"), "--eval.steps", "2",
            "--eval.n_samples_per_prompt", "2"]),
        # a policy-gradient run (the DAPO baseline as configs/methods/dapo.sh gives it: clip-higher, dynamic
        # sampling, overlong shaping over the last 1 of 8 tokens, token-mean) with the listwise metrics at its
        # paired temperature and OpenRLHF's --eval.* path (every 2 steps) through our grader and the unbiased pass@k
        "dapo_dp1": run_family(tiny_model_dir, root, "dapo_dp1", dp=1,
                               estimator=(*method_flags("dapo", **{"rollout.max_new_tokens": 8})[1:], "--lpo.end_kl"),
                               extra=["--eval.dataset", str(root / "prompts6.jsonl"), "--eval.steps", "2",
                                      "--eval.n_samples_per_prompt", "2"]),
    }


def test_async_recipe_logs_the_behaviour_correction(families):
    run = families["async"]
    assert tb_steps(run["tb"]) == [1, 2, 3, 4]
    tb = run["tb"]
    assert [tb["train/lpo/groups"][s] for s in (1, 2, 3, 4)] == [4.0, 2.0, 4.0, 2.0]
    for key in ("train/lpo/behaviour_abs_mean", "train/lpo/behaviour_abs_max", "train/lpo/behaviour_ess"):
        assert sorted(tb[key]) == [1, 2, 3, 4], key
    # micro-batches of K hold whole groups: each step's window in one pass (no pre-pass, no shortcut)
    for key, want in (("one_pass_windows", 1.0), ("shortcut_windows", 0.0), ("pre_pass_windows", 0.0)):
        assert [tb[f"train/lpo/{key}"][s] for s in (1, 2, 3, 4)] == [want] * 4, key
    # later batches were sampled by an older policy than the one that starts their update: s_t != 0
    assert max(tb["train/lpo/behaviour_abs_mean"].values()) > 1e-4
    assert all(0.0 < v <= 1.0 for v in tb["train/lpo/behaviour_ess"].values())
    # the async generator's --eval.* rounds go through evaluation.training_eval too (maj/worst are ours)
    evals = {k for k in tb if k.startswith("eval/")}
    assert any(k.endswith("_pass2") for k in evals) and any("_worst2" in k for k in evals), evals
    print("\n[e2e family] async s_t: " + "; ".join(
        f"step {s}: mean|s_t| {tb['train/lpo/behaviour_abs_mean'][s]:.3g}, max {tb['train/lpo/behaviour_abs_max'][s]:.3g}, "
        f"ESS/K {tb['train/lpo/behaviour_ess'][s]:.3f}" for s in (1, 2, 3, 4)))


def test_policy_gradient_run_logs_the_listwise_kl_over_partial_batches(families):
    run = families["dapo_dp1"]
    assert tb_steps(run["tb"]) == [1, 2, 3, 4]
    tb = run["tb"]
    assert [tb["train/lpo/groups"][s] for s in (1, 2, 3, 4)] == [4.0, 2.0, 4.0, 2.0]
    assert all(tb["train/lpo/kl_end"][s] >= 0.0 for s in (1, 2, 3, 4))
    # evaluation during training, graded by evaluation.training_eval
    evals = {k for k in tb if k.startswith("eval/")}
    assert any(k.endswith("_pass1") for k in evals) and any(k.endswith("_pass2") for k in evals), evals
    assert any("_maj2" in k or "_worst2" in k for k in evals), evals  # not in OpenRLHF's own metrics
    assert sorted(tb[next(k for k in evals if k.endswith("_pass1"))]) == [2, 4]
    # DAPO's settings as the method file gives them, in effect: the run's method line, and dynamic sampling's pass
    # rate at every step. The vowel-fraction reward's group means lie in (0, 1), so every group passes; OpenRLHF
    # 0.11.2 divides the samples kept by the prompts drawn (x 100), so "all pass" reads K x 100 = 400
    log = run["log"]
    for setting in ("token ratio clipped to [1-0.2, 1+0.28]", "aggregation token-mean",
                    "dynamic sampling (group mean score in (0, 1))", "overlong shaping over the last 1 of 8 tokens (x1)"):
        assert setting in log, setting
    assert tb["train/dynamic_filtering_pass_rate"] == {1: 400.0, 2: 400.0, 3: 400.0, 4: 400.0}


def test_both_runs_log_the_metric_contract(families):
    """The async LPO run (behaviour correction: vllm_kl, is_filter_ratio, lpo/behaviour_*) and DAPO with --lpo.end_kl
    log exactly the keys of docs/metrics.md."""
    from metric_contract import check_run

    for name in ("async", "dapo_dp1"):
        check_run(families[name]["tb"], families[name]["argv"])
