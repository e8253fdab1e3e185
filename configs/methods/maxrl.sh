# MaxRL: advantages (r - mean) / mean (openrlhf_lpo estimator), aggregated per response (seq-mean-token-mean) like its
# LPO pair lpo_rev_maxrl.sh (tau = group mean, Prop. 1).
METHOD_ARGS=(--algo.advantage.estimator maxrl --actor.loss_agg_mode seq-mean-token-mean)
