# Pointwise ablation: -sum_k w*_k s_k (the target without the listwise normaliser), GRPO temperature.
METHOD_ARGS=(--algo.advantage.estimator lpo --lpo.projection pointwise --lpo.temperature std)
