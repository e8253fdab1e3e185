# LPO-fwd with the temperature of Dr.GRPO (tau = 1).
METHOD_ARGS=(--algo.advantage.estimator lpo --lpo.divergence fwd --lpo.temperature one)
