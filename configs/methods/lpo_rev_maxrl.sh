# LPO-rev with the temperature of MaxRL (tau = group mean reward).
METHOD_ARGS=(--algo.advantage.estimator lpo --lpo.divergence rev --lpo.temperature mean)
