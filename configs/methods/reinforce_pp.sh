# REINFORCE++-baseline (Hu et al. 2025, arXiv 2501.03262): A = R - group mean, whitened over the rollout batch (OpenRLHF reinforce_baseline; PPO clip 0.2, token-mean; KL off as in every recipe here).
METHOD_ARGS=(--algo.advantage.estimator reinforce_baseline)
