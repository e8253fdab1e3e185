# GSPO (Zheng et al. 2025, arXiv 2507.18071): GRPO advantages, the length-normalised sequence ratio clipped to [1 - 3e-4, 1 + 4e-4], sequence-mean loss (OpenRLHF --actor.policy_loss_type gspo).
METHOD_ARGS=(--algo.advantage.estimator group_norm --actor.policy_loss_type gspo --actor.eps_clip_low_high 3e-4 4e-4)
