# LPO-fwd (forward KL projection), temperature of GRPO (group std).
METHOD_ARGS=(--algo.advantage.estimator lpo --lpo.divergence fwd --lpo.temperature std)
