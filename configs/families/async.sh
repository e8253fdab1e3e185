# OpenRLHF's async reference recipe family: generation overlaps training (--train.async_enable, queue of
# ASYNC_QUEUE batches), weights synced mid-generation (--train.partial_rollout_enable), and the engine's
# behaviour log-probs feed LPO's listwise off-policy target w* = softmax(R/tau + s_t) (token clip of
# log pi_t/mu to [0.5, 5]; docs/lpo_flags.md). Async engines cannot sleep, so on the DeepSpeed backend
# the actor takes ACTOR_GPUS (default half the cluster) and the vLLM engines the rest.
# Sourced by examples/scripts/lib/launch.sh when FAMILY=async.
FAMILY_ARGS=(
  --train.async_enable --train.async_queue_size "${ASYNC_QUEUE:-1}" --train.partial_rollout_enable
  --algo.advantage.is_correction_level token --algo.advantage.is_correction_mode clip
  --algo.advantage.is_correction_threshold 0.5 5.0
)
if [ "${BACKEND:-deepspeed}" = "deepspeed" ]; then
  ACTOR_GPUS="${ACTOR_GPUS:-$((NNODES * GPUS_PER_NODE / 2))}"
  VLLM_ENGINES="${ASYNC_VLLM_ENGINES:-$((NNODES * GPUS_PER_NODE - ACTOR_GPUS))}"
  CLUSTER_ARGS=(
    --actor.num_nodes 1 --actor.num_gpus_per_node "$ACTOR_GPUS"
    --ref.num_nodes 1 --ref.num_gpus_per_node "$ACTOR_GPUS"
    --vllm.num_engines "$VLLM_ENGINES" --vllm.tensor_parallel_size 1 --vllm.gpu_memory_utilization 0.85
  )
fi
