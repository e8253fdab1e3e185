# LPO-fwd with the temperature of REINFORCE++-baseline (tau = OpenRLHF's token-weighted batch std of R - group mean, one value per rollout batch).
METHOD_ARGS=(--algo.advantage.estimator lpo --lpo.divergence fwd --lpo.temperature batch_std)
