# LPO-fwd with the temperature of RLOO (tau = (K-1)/K: A_RLOO = K/(K-1)(R - mean) = (R - mean)/tau).
METHOD_ARGS=(--algo.advantage.estimator lpo --lpo.divergence fwd --lpo.temperature loo)
