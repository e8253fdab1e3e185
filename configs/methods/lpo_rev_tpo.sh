# LPO-rev with the temperature of TPO (tau = population std of the group).
METHOD_ARGS=(--algo.advantage.estimator lpo --lpo.divergence rev --lpo.temperature pop_std)
