"""lpo-train end to end in the layouts users run: data-parallel ranks, OpenRLHF's reference recipe
families, partial last batches over two episodes, policy-gradient runs with the listwise metrics.

Every run: local Ray, OpenRLHF's trainer and actors, DeepSpeed ZeRO-2 on gloo, the CPU rollout
engine, a tiny offline Qwen3 and the vowel-fraction reward (tests/pipeline/toy_reward.py).
"""

import os
import subprocess

import pytest

from e2e_common import (REPO, base_args, load_weights, max_weight_diff, run_cli, run_env, tb_scalars, tb_steps,
                        write_prompts)

# ----------------------------------------------------------------------------- dp 2 == dp 1


@pytest.fixture(scope="module")
def dp_runs(tiny_model_dir, tmp_path_factory):
    """One rollout batch (4 prompts x K=4), one optimizer window, two epochs, SGD (LPO_CPU_OPTIMIZER):
    the update is proportional to the gradient, so equal final weights mean equal gradients. The same
    seed gives every run the same rollouts (per-request engine seeds)."""
    root = tmp_path_factory.mktemp("dp")
    data = write_prompts(root / "prompts.jsonl", 4)
    env = run_env({"LPO_CPU_OPTIMIZER": "sgd"})
    runs = {}
    for name, dp, micro in (("dp1_one_pass", 1, 4), ("dp2_two_pass", 2, 2), ("dp2_one_pass", 2, 4)):
        out = root / name
        args = base_args(tiny_model_dir, data, out, dp=dp, micro=micro, train=16,
                         extra=["--train.max_epochs", "2", "--actor.adam.lr", "0.2"])
        rc, wall, log = run_cli(args, env, root / f"{name}.log")
        assert rc == 0, f"{name} failed (rc={rc}); tail:\n{log[-6000:]}"
        runs[name] = {"weights": load_weights(out / "final"), "tb": tb_scalars(out / "tb"), "wall": wall}
    runs["init"] = load_weights(tiny_model_dir)
    print("\n[e2e dp] " + ", ".join(f"{k} {v['wall']:.0f}s" for k, v in runs.items() if k != "init"))
    return runs


def test_two_ranks_update_like_one(dp_runs):
    ref = dp_runs["dp1_one_pass"]
    moved = max_weight_diff(ref["weights"], dp_runs["init"])
    assert moved > 1e-3, "SGD did not move the weights: the comparison would be vacuous"
    for name in ("dp2_two_pass", "dp2_one_pass"):
        diff = max_weight_diff(dp_runs[name]["weights"], ref["weights"])
        print(f"\n[e2e dp] {name} vs dp1_one_pass: max |dw| {diff:.3g} (moved {moved:.3g})")
        assert diff < 1e-4 * moved, name
    # the two-pass run really took the exact two-pass path: c from s_t, then a no-grad pre-pass
    tb = dp_runs["dp2_two_pass"]["tb"]
    assert tb["train/lpo/shortcut_windows"][1] == 1.0 and tb["train/lpo/pre_pass_windows"][1] == 1.0
    assert dp_runs["dp2_one_pass"]["tb"]["train/lpo/one_pass_windows"][1] == 2.0


# ----------------------------------------------------------------------------- recipe families, two episodes


def family_flags(family, **env):
    """The flags a recipe family's config file adds (configs/families/<family>.sh), as the scripts get them."""
    out = subprocess.run(["bash", "-c", f'NNODES=1 GPUS_PER_NODE=2 source configs/families/{family}.sh; '
                                        'printf "%s\n" "${FAMILY_ARGS[@]}"'],
                         cwd=str(REPO), env=dict(os.environ, **env), capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def _family(tiny_model_dir, root, name, *, dp, extra=(), estimator=("lpo", "--lpo.divergence", "fwd"), env=None,
            micro=2, train=16):
    """6 prompts in batches of 4, two episodes: steps of 4, 2, 4, 2 groups; an optimizer window holds
    4 groups, so each episode's partial last batch (2 groups) is smaller than a window."""
    data = write_prompts(root / "prompts6.jsonl", 6)
    out = root / name
    args = base_args(tiny_model_dir, data, out, dp=dp, micro=micro, train=train, episodes=2, estimator=estimator,
                     extra=extra)
    rc, wall, log = run_cli(args, run_env(env), root / f"{name}.log")
    assert rc == 0, f"{name} failed (rc={rc}); tail:\n{log[-6000:]}"
    print(f"\n[e2e family] {name}: {wall:.0f}s")
    return {"log": log, "tb": tb_scalars(out / "tb")}


@pytest.fixture(scope="module")
def families(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {
        # OpenRLHF's long-context hybrid-engine recipe: colocated engines, dynamic batching by tokens
        # (a budget below a group's tokens: groups split, exact two-pass path), packing, micro-batch 1,
        # plus a KL loss against a reference model, an entropy bonus and dynamic filtering
        "hybrid": _family(tiny_model_dir, root, "hybrid", dp=2, extra=[
            "--train.colocate_all", "--vllm.num_engines", "2", "--vllm.enable_sleep", "--ds.enable_sleep",
            *family_flags("long_context", MAX_TOKENS_PER_GPU="64", ROLLOUT_MAX_TOKENS_PER_GPU="64"),
            "--train.max_epochs", "2",
            "--algo.kl.init_coef", "0.01", "--algo.kl.use_loss", "--algo.kl.estimator", "k3",
            "--ref.num_nodes", "1", "--ref.num_gpus_per_node", "2", "--actor.entropy_coef", "0.001",
            "--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0.0", "1.0"]),
        # OpenRLHF's async recipe: partial rollout, behaviour log-probs from the engine, LPO's
        # listwise off-policy correction (token clip)
        "async": _family(tiny_model_dir, root, "async", dp=1, extra=[
            *family_flags("async"), "--eval.dataset", str(root / "prompts6.jsonl"), "--eval.steps", "2",
            "--eval.n_samples_per_prompt", "2"]),
        # a policy-gradient run with the listwise metrics, on both layouts
        "grpo_dp2": _family(tiny_model_dir, root, "grpo_dp2", dp=2, estimator=("group_norm", "--lpo.end_kl")),
        # ... and OpenRLHF's --eval.* path (every 2 steps) through our grader and the unbiased pass@k
        "grpo_dp1": _family(tiny_model_dir, root, "grpo_dp1", dp=1, estimator=("group_norm", "--lpo.end_kl"), extra=[
            "--eval.dataset", str(root / "prompts6.jsonl"), "--eval.steps", "2", "--eval.n_samples_per_prompt", "2"]),
    }


def test_hybrid_recipe_with_dynamic_batching_trains_two_episodes(families):
    run = families["hybrid"]
    assert tb_steps(run["tb"]) == [1, 2, 3, 4]
    tb = run["tb"]
    assert [tb["train/lpo/groups"][s] for s in (1, 2, 3, 4)] == [4.0, 2.0, 4.0, 2.0]
    # groups of ~4 x 20 tokens exceed the 64-token budget: samples are the items; one window per
    # batch and two epochs: c from s_t in epoch 1, from a pre-pass in epoch 2
    assert all(tb["train/lpo/one_pass_windows"][s] == 0.0 for s in (1, 2, 3, 4))
    assert all(tb["train/lpo/shortcut_windows"][s] == 1.0 and tb["train/lpo/pre_pass_windows"][s] == 1.0
               for s in (1, 2, 3, 4))
    assert all(tb["train/lpo/abs_coef_mean"][s] > 1e-3 for s in (1, 2, 3, 4))
    assert all(tb["train/kl"][s] > 0.0 for s in (2, 3, 4))  # the KL loss against the reference model
    assert all(tb["train/entropy_loss"][s] > 0.0 for s in (1, 2, 3, 4))


def test_async_recipe_logs_the_behaviour_correction(families):
    run = families["async"]
    assert tb_steps(run["tb"]) == [1, 2, 3, 4]
    tb = run["tb"]
    assert [tb["train/lpo/groups"][s] for s in (1, 2, 3, 4)] == [4.0, 2.0, 4.0, 2.0]
    for key in ("train/lpo/behaviour_abs_mean", "train/lpo/behaviour_abs_max", "train/lpo/behaviour_ess"):
        assert sorted(tb[key]) == [1, 2, 3, 4], key
    # later batches were sampled by an older policy than the one that starts their update: s_t != 0
    assert max(tb["train/lpo/behaviour_abs_mean"].values()) > 1e-4
    assert all(0.0 < v <= 1.0 for v in tb["train/lpo/behaviour_ess"].values())
    # the async generator's --eval.* rounds go through evaluation.training_eval too (maj/worst are ours)
    evals = {k for k in tb if k.startswith("eval/")}
    assert any(k.endswith("_pass2") for k in evals) and any("_worst2" in k for k in evals), evals
    print("\n[e2e family] async s_t: " + "; ".join(
        f"step {s}: mean|s_t| {tb['train/lpo/behaviour_abs_mean'][s]:.3g}, max {tb['train/lpo/behaviour_abs_max'][s]:.3g}, "
        f"ESS/K {tb['train/lpo/behaviour_ess'][s]:.3f}" for s in (1, 2, 3, 4)))


@pytest.mark.parametrize("name", ["grpo_dp1", "grpo_dp2"])
def test_policy_gradient_runs_log_the_listwise_kl_over_partial_batches(families, name):
    run = families[name]
    assert tb_steps(run["tb"]) == [1, 2, 3, 4]
    tb = run["tb"]
    assert [tb["train/lpo/groups"][s] for s in (1, 2, 3, 4)] == [4.0, 2.0, 4.0, 2.0]
    assert all(tb["train/lpo/kl_end"][s] >= 0.0 for s in (1, 2, 3, 4))
    if name == "grpo_dp1":  # evaluation during training, graded by evaluation.training_eval
        evals = {k for k in tb if k.startswith("eval/")}
        assert any(k.endswith("_pass1") for k in evals) and any(k.endswith("_pass2") for k in evals), evals
        assert any("_maj2" in k or "_worst2" in k for k in evals), evals  # not in OpenRLHF's own metrics
        assert sorted(tb[next(k for k in evals if k.endswith("_pass1"))]) == [2, 4]
