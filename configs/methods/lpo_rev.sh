# LPO-rev (reverse KL projection), temperature of GRPO (group std).
METHOD_ARGS=(--algo.advantage.estimator lpo --lpo.divergence rev --lpo.temperature std)
