# MaxRL: advantages (r - mean) / mean (openrlhf_lpo estimator).
METHOD_ARGS=(--algo.advantage.estimator maxrl)
