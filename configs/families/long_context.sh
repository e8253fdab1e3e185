# OpenRLHF's long-context reference recipe family: micro-batch 1, dynamic batching by tokens, packing.
# Under lpo the balancer is group-aware (whole groups per rank and window, token-budget micro-batches;
# docs/lpo_flags.md): a group that exceeds the budget is split over micro-batches and stays exact.
# Sourced by examples/scripts/lib/launch.sh when FAMILY=long_context; knobs: MAX_TOKENS_PER_GPU,
# ROLLOUT_MAX_TOKENS_PER_GPU (tokens per micro-batch in training / in the old-log-prob forward).
FAMILY_ARGS=(
  --train.micro_batch_size 1 --train.dynamic_batch_enable --ds.packing_samples
  --train.max_tokens_per_gpu "${MAX_TOKENS_PER_GPU:-16384}"
  --rollout.max_tokens_per_gpu "${ROLLOUT_MAX_TOKENS_PER_GPU:-32768}"
)
