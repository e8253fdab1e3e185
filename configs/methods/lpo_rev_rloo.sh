# LPO-rev with the temperature of RLOO (tau = (K-1)/K); on-policy its gradient is rloo.sh's (Prop. 1; both per response).
METHOD_ARGS=(--algo.advantage.estimator lpo --lpo.divergence rev --lpo.temperature loo)
