# LPO-fwd with the temperature of TPO (tau = population std of the group: TPO's u = (R - mean)/tau); Eq. 4's score, no anchor. docs/methods.md states when it coincides with tpo.sh.
METHOD_ARGS=(--algo.advantage.estimator lpo --lpo.divergence fwd --lpo.temperature pop_std)
