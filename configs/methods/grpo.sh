# GRPO: group-normalised advantages (r - mean) / std.
METHOD_ARGS=(--algo.advantage.estimator group_norm)
