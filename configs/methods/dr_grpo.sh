# Dr.GRPO: advantages r - mean (no std normalisation).
METHOD_ARGS=(--algo.advantage.estimator dr_grpo)
