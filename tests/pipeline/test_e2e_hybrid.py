"""lpo-train end to end in OpenRLHF's long-context hybrid-engine recipe (configs/families/long_context.sh) on
two data-parallel ranks, over partial last batches and two episodes: colocated engines that sleep, dynamic
batching by tokens with a budget below a group's tokens (groups split: the exact two-pass path), packing,
micro-batch 1, a KL loss against a reference model, an entropy bonus and dynamic filtering. The listwise loss is
Target Policy Optimization's configuration (configs/methods/tpo.sh: the summed, unclipped score, the old policy's
sequence log-probabilities as the anchor, the population-std temperature), so TPO trains end to end through the
same windows and passes as LPO (its math: tests/openrlhf/test_tpo.py).

Local Ray, OpenRLHF's trainer and actors, DeepSpeed ZeRO-2 on gloo, the CPU rollout engine, a tiny offline
Qwen3 and the vowel-fraction reward (tests/pipeline/toy_reward.py).
"""

import pytest

import math

from e2e_common import family_flags, method_flags, run_family, tb_steps

pytestmark = pytest.mark.e2e  # one lpo-train run (dp 2, colocated, a reference model)


@pytest.fixture(scope="module")
def hybrid(tiny_model_dir, tmp_path_factory):
    return run_family(tiny_model_dir, tmp_path_factory.mktemp("hybrid"), "hybrid", dp=2, extra=[
        "--train.colocate_all", "--vllm.num_engines", "2", "--vllm.enable_sleep", "--ds.enable_sleep",
        *family_flags("long_context", MAX_TOKENS_PER_GPU="64", ROLLOUT_MAX_TOKENS_PER_GPU="64"),
        "--train.max_epochs", "2",
        "--algo.kl.init_coef", "0.01", "--algo.kl.use_loss", "--algo.kl.estimator", "k3",
        "--ref.num_nodes", "1", "--ref.num_gpus_per_node", "2", "--actor.entropy_coef", "0.001",
        "--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0.0", "1.0",
        *method_flags("tpo")[2:]])


def test_hybrid_recipe_with_dynamic_batching_trains_two_episodes(hybrid):
    tb = hybrid["tb"]
    assert tb_steps(tb) == [1, 2, 3, 4]
    assert [tb["train/lpo/groups"][s] for s in (1, 2, 3, 4)] == [4.0, 2.0, 4.0, 2.0]
    # groups of ~4 x 20 tokens exceed the 64-token budget: samples are the items; one window per
    # batch and two epochs: c from s_t in epoch 1, from a pre-pass in epoch 2
    assert all(tb["train/lpo/one_pass_windows"][s] == 0.0 for s in (1, 2, 3, 4))
    assert all(tb["train/lpo/shortcut_windows"][s] == 1.0 and tb["train/lpo/pre_pass_windows"][s] == 1.0
               for s in (1, 2, 3, 4))
    assert all(tb["train/lpo/abs_coef_mean"][s] > 1e-3 for s in (1, 2, 3, 4))
    assert all(tb["train/kl"][s] > 0.0 for s in (2, 3, 4))  # the KL loss against the reference model
    assert all(tb["train/response_entropy"][s] > 0.0 for s in (1, 2, 3, 4))
    # TPO's configuration in effect: its method line, and P at the start of each update is p_old = softmax(l_old)
    # (the anchor), not uniform: its entropy is below log K in every informative step, and KL(q || p_old) > 0
    assert ("method: TPO (Target Policy Optimization, arXiv 2604.06159) as LPO listwise (divergence fwd), temperature "
            "pop_std; s sums the token log-ratios (no clip, no length normalisation); anchor l_old") in hybrid["log"]
    assert all(tb["train/lpo/entropy_p_start"][s] < math.log(4) - 1e-3 for s in (1, 2, 3, 4))
    assert all(tb["train/lpo/kl_start"][s] > 0.0 for s in (1, 2, 3, 4))
