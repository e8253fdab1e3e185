# RLOO (Ahmadian et al. 2024, arXiv 2402.14740): A = R - mean of the other K-1 rewards = K/(K-1)(R - mean) (OpenRLHF rloo;
# PPO clip 0.2), aggregated per response (seq-mean-token-mean: RLOO is a sequence-level REINFORCE estimator, and LPO's
# aggregation, so the on-policy gradient of lpo_rev_rloo.sh is this one: Prop. 1).
METHOD_ARGS=(--algo.advantage.estimator rloo --actor.loss_agg_mode seq-mean-token-mean)
