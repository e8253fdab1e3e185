# CISPO (MiniMax-M1 2025, arXiv 2506.13585, Eq. 4): GRPO advantages, REINFORCE weighted by the detached importance ratio clipped to [0, 4] (no lower bound; cap 4 as ScaleRL, arXiv 2510.13786), token-mean loss.
METHOD_ARGS=(--algo.advantage.estimator group_norm --actor.policy_loss_type cispo --actor.eps_clip_low_high 1.0 3.0 --actor.loss_agg_mode token-mean)
