# Megatron-core actor (--backend megatron, docs/megatron.md), not colocated: the actor takes
# ACTOR_NODES x ACTOR_GPUS GPUs (MEGATRON_TP x MEGATRON_PP per model replica, DP = the rest) and the
# VLLM_ENGINES engines of VLLM_TP GPUs each run on GPUs of their own (the Megatron actor has no sleep
# mode, and syncing into engines on the actor's GPUs would need CUDA IPC).
# Checked before anything starts: the layout against the model's HF config (argparse), and the
# placement against ray.cluster_resources() / ray.nodes() (each TP group and each engine on one node).
VLLM_ENGINES="${VLLM_ENGINES:-4}"
CLUSTER_ARGS=(
  --backend megatron --megatron.tp "${MEGATRON_TP:-4}" --megatron.pp "${MEGATRON_PP:-1}"
  --megatron.params_dtype bf16 --megatron.distributed_optimizer
  --actor.num_nodes "${ACTOR_NODES:-1}" --actor.num_gpus_per_node "${ACTOR_GPUS:-$GPUS_PER_NODE}"
  --vllm.num_engines "$VLLM_ENGINES" --vllm.tensor_parallel_size "${VLLM_TP:-1}"
  --vllm.gpu_memory_utilization 0.85 --vllm.enable_prefix_caching
)
# MEGATRON_SP=1: sequence parallelism (TP > 1); MEGATRON_VPP=V: virtual pipeline stages (PP > 1)
[ "${MEGATRON_SP:-0}" != "1" ] || CLUSTER_ARGS+=(--megatron.sequence_parallel)
[ "${MEGATRON_VPP:-1}" = "1" ] || CLUSTER_ARGS+=(--megatron.vpp "$MEGATRON_VPP")
