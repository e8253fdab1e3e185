# LPO-rev with the temperature of REINFORCE++-baseline (tau = OpenRLHF's token-weighted batch std of R - group mean); on-policy its gradient is reinforce_pp.sh's when response lengths carry no reward information (Prop. 1; docs/methods.md "Matched pairs").
METHOD_ARGS=(--algo.advantage.estimator lpo --lpo.divergence rev --lpo.temperature batch_std)
