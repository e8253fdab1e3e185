# Dr.GRPO (Liu et al. 2025, arXiv 2503.20783): advantages r - mean (no std normalisation). Aggregated per response
# (seq-mean-token-mean) to match its LPO pair lpo_rev_drgrpo.sh (tau = 1, Prop. 1); Dr.GRPO's second change (a token sum
# over a constant instead of each response's token mean) has no LPO counterpart: LPO's s is length-normalised (Eq. 4).
METHOD_ARGS=(--algo.advantage.estimator dr_grpo --actor.loss_agg_mode seq-mean-token-mean)
