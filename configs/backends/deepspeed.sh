# DeepSpeed actor (OpenRLHF's default), colocated with the vLLM engines (sleep mode between phases).
# Sourced by examples/scripts/lib/launch.sh after NNODES / GPUS_PER_NODE are set.
VLLM_ENGINES="${VLLM_ENGINES:-$((NNODES * GPUS_PER_NODE))}"
CLUSTER_ARGS=(
  --actor.num_nodes "$NNODES" --actor.num_gpus_per_node "$GPUS_PER_NODE"
  --ref.num_nodes "$NNODES" --ref.num_gpus_per_node "$GPUS_PER_NODE"
  --vllm.num_engines "$VLLM_ENGINES" --vllm.tensor_parallel_size 1
  --vllm.gpu_memory_utilization 0.6 --vllm.enable_sleep --ds.enable_sleep
  --train.colocate_all
)
