# LPO-fwd with the temperature of MaxRL (tau = group mean reward).
METHOD_ARGS=(--algo.advantage.estimator lpo --lpo.divergence fwd --lpo.temperature mean)
