"""lpo-train end to end on two data-parallel ranks: dp 2 (two passes) updates like dp 1 (one pass). dp 2's
one-pass path (micro-batch K) is the gradient matrix's, in one process against the float64 window reference
(tests/openrlhf/test_lpo_gradient_exactness.py, dp 2, micro K): no third pipeline run for it.
OpenRLHF's recipe families over partial batches: test_e2e_hybrid.py and test_e2e_families.py.

Every run: local Ray, OpenRLHF's trainer and actors, DeepSpeed ZeRO-2 on gloo, the CPU rollout
engine, a tiny offline Qwen3 and the vowel-fraction reward (tests/pipeline/toy_reward.py).
"""

import re

import pytest

from e2e_common import base_args, load_weights, max_weight_diff, run_cli, run_env, tb_scalars, write_prompts

pytestmark = pytest.mark.e2e  # two lpo-train runs: dp 1, dp 2 two-pass

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
    for name, dp, micro in (("dp1_one_pass", 1, 4), ("dp2_two_pass", 2, 2)):
        out = root / name
        args = base_args(tiny_model_dir, data, out, dp=dp, micro=micro, train=16,
                         extra=["--train.max_epochs", "2", "--actor.adam.lr", "0.2"])
        rc, wall, log = run_cli(args, env, root / f"{name}.log")
        assert rc == 0, f"{name} failed (rc={rc}); tail:\n{log[-6000:]}"
        runs[name] = {"weights": load_weights(out / "final"), "tb": tb_scalars(out / "tb"), "wall": wall, "log": log}
    runs["init"] = load_weights(tiny_model_dir)
    print("\n[e2e dp] " + ", ".join(f"{k} {v['wall']:.0f}s" for k, v in runs.items() if k != "init"))
    return runs


def test_two_ranks_update_like_one(dp_runs):
    ref = dp_runs["dp1_one_pass"]
    moved = max_weight_diff(ref["weights"], dp_runs["init"])
    assert moved > 1e-3, "SGD did not move the weights: the comparison would be vacuous"
    diff = max_weight_diff(dp_runs["dp2_two_pass"]["weights"], ref["weights"])
    print(f"\n[e2e dp] dp2_two_pass vs dp1_one_pass: max |dw| {diff:.3g} (moved {moved:.3g})")
    assert diff < 1e-4 * moved
    # the two-pass run really took the exact two-pass path: c from s_t, then a no-grad pre-pass
    tb = dp_runs["dp2_two_pass"]["tb"]
    assert tb["train/lpo/shortcut_windows"][1] == 1.0 and tb["train/lpo/pre_pass_windows"][1] == 1.0
    assert ref["tb"]["train/lpo/one_pass_windows"][1] == 2.0  # and the reference the one-pass path
    # the DeepSpeed actor group's ranks in node-major bundle order (openrlhf/placement.py)
    assert re.search(r"\[placement\] \w+: node 0 \([0-9a-f]{8}\): ranks 0-1\n", dp_runs["dp2_two_pass"]["log"])
