# LPO-rev with the temperature of REINFORCE++-baseline (tau = batch std of R - group mean); on-policy its gradient is REINFORCE++-baseline's (Prop. 1).
METHOD_ARGS=(--algo.advantage.estimator lpo --lpo.divergence rev --lpo.temperature batch_std)
