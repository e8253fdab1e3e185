# GRPO (Shao et al. 2024, arXiv 2402.03300, Eq. 3): group-normalised advantages (r - mean) / std, the mean over responses
# of each response's token mean (seq-mean-token-mean: GRPO's own objective, and LPO's per-prompt aggregation, so the
# on-policy gradient of its LPO-rev pair lpo_rev.sh is this one: Prop. 1; docs/methods.md "Matched pairs").
METHOD_ARGS=(--algo.advantage.estimator group_norm --actor.loss_agg_mode seq-mean-token-mean)
