# Megatron-core actor (--backend megatron, docs/megatron.md): MEGATRON_TP x MEGATRON_PP GPUs per
# model replica, DP = NNODES*GPUS_PER_NODE / (TP*PP). Not colocated: the VLLM_ENGINES engines of
# VLLM_TP GPUs each run on GPUs of their own (the Megatron actor has no sleep mode).
# The layout is checked against the model's HF config before anything starts.
VLLM_ENGINES="${VLLM_ENGINES:-4}"
CLUSTER_ARGS=(
  --backend megatron --megatron.tp "${MEGATRON_TP:-4}" --megatron.pp "${MEGATRON_PP:-1}"
  --megatron.params_dtype bf16 --megatron.distributed_optimizer
  --actor.num_nodes "$NNODES" --actor.num_gpus_per_node "$GPUS_PER_NODE"
  --vllm.num_engines "$VLLM_ENGINES" --vllm.tensor_parallel_size "${VLLM_TP:-2}"
  --vllm.gpu_memory_utilization 0.85
)
