"""The 2025 baselines' LPO pairings against upstream itself (real OpenRLHF 0.11.2 classes, lpo_fixtures.py):

* the advantages of the stock ``RemoteExperienceMaker`` for ``rloo`` and ``reinforce_baseline`` are the paired
  temperatures' (R - mean)/tau: tau = (K-1)/K (``loo``), tau = the batch std of R - group mean (``batch_std``;
  token-weighted with unequal lengths, ``batch_std_temperature(rewards, weights)``);
* Prop. 1 through the shipped method files and the real trainer: tests/openrlhf/test_matched_pairs.py
  (``tests/core/test_baseline_pairings.py`` checks the same against a closed form).
"""


import numpy as np
import pytest
import torch

from lpo_fixtures import (CPUStrategy, make_actor, make_experiences, make_rollout_samples,
                          parse_args, equal_length_samples)
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

from openrlhf_lpo import listwise as lw

K, G = 4, 4


def _equal_length_samples(seed, length=5):
    return equal_length_samples(seed, G, K, length)


def _stock_advantages(exps):
    """Per sample (prompt-major index): the advantage upstream gave its first response token, and its length."""
    n = sum(len(e.index) for e in exps)
    adv, length = np.zeros(n), np.zeros(n)
    for e in exps:
        for row, i in enumerate(e.index):
            tokens = e.action_mask[row].bool()
            adv[i] = float(e.advantages[row][tokens][0])
            length[i] = float(tokens.sum())
    return adv.reshape(G, K), length.reshape(G, K)


@pytest.mark.parametrize("equal_lengths", [True, False])
def test_stock_rloo_and_reinforce_baseline_advantages_are_the_paired_temperatures(tiny_model_dir, equal_lengths):
    samples = _equal_length_samples(seed=1) if equal_lengths else make_rollout_samples(G, K, seed=1)
    rewards = torch.tensor([float(s.rewards) for s in samples], dtype=torch.float64).view(G, K)
    actor = make_actor(tiny_model_dir)
    for estimator, temperature in (("rloo", "loo"), ("reinforce_baseline", "batch_std")):
        args = parse_args(tiny_model_dir, estimator=estimator, micro=2)
        adv, length = _stock_advantages(make_experiences(args, CPUStrategy(args), actor, samples,
                                                         maker_cls=RemoteExperienceMaker))
        if estimator == "rloo" or equal_lengths:
            tau = lw.group_temperature(rewards, temperature)
            want = lw.pg_advantages(rewards, "rloo" if estimator == "rloo" else "reinforce_pp").numpy()
            np.testing.assert_allclose(want, ((rewards - rewards.mean(1, keepdim=True)) / tau).numpy(), atol=1e-12)
            np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-6)  # upstream computes in float32
        else:  # token-weighted whitening: (a - m)/sigma_w, sigma_w = batch_std_temperature(rewards, lengths)
            sigma = float(lw.batch_std_temperature(rewards, torch.tensor(length))[0, 0])
            a = (rewards - rewards.mean(1, keepdim=True)).numpy()
            m = (length * a).sum() / length.sum()
            np.testing.assert_allclose(adv, (a - m) / sigma, rtol=1e-5, atol=1e-6)
            assert abs(m) > 1e-3  # unequal lengths shift the advantages (docs/lpo_flags.md)
