# REINFORCE++-baseline (Hu et al. 2025, arXiv 2501.03262): A = R - group mean, whitened over the rollout batch token-weighted
# (OpenRLHF reinforce_baseline; PPO clip 0.2; KL off as in every recipe here), aggregated per response (seq-mean-token-mean,
# LPO's aggregation). Its LPO pair lpo_rev_reinforce_pp.sh takes the same token-weighted sigma; the whitening's mean shift
# (the same for every response) has no listwise counterpart: Prop. 1 holds exactly when lengths carry no reward
# information, docs/methods.md "Matched pairs" gives the gap otherwise.
METHOD_ARGS=(--algo.advantage.estimator reinforce_baseline --actor.loss_agg_mode seq-mean-token-mean)
