# LPO-rev with the temperature of Dr.GRPO (tau = 1).
METHOD_ARGS=(--algo.advantage.estimator lpo --lpo.divergence rev --lpo.temperature one)
