# Megatron-core actor (--backend megatron, docs/megatron.md), not colocated: the actor takes
# ACTOR_NODES x ACTOR_GPUS GPUs (MEGATRON_TP x MEGATRON_PP per model replica, DP = the rest) and the
# VLLM_ENGINES engines of VLLM_TP GPUs each run on GPUs of their own (the Megatron actor has no sleep
# mode, and syncing into engines on the actor's GPUs would need CUDA IPC).
# Checked before anything starts: the layout against the model's HF config (argparse), and the
# placement against ray.cluster_resources() / ray.nodes() (each TP group and each engine on one node).
# Defaults fit any single-node recipe (BACKEND=megatron bash examples/scripts/train_*.sh on 8 GPUs): the
# engines take VLLM_ENGINES x VLLM_TP GPUs and the actor the rest of the node (8 - 4 = 4: TP 4, DP 1).
VLLM_ENGINES="${VLLM_ENGINES:-4}"
VLLM_TP="${VLLM_TP:-1}"
if [ -z "${ACTOR_GPUS:-}" ]; then
  if [ "$NNODES" = "1" ] && [ "${ACTOR_NODES:-1}" = "1" ]; then
    ACTOR_GPUS=$((GPUS_PER_NODE - VLLM_ENGINES * VLLM_TP))
    if [ "$ACTOR_GPUS" -lt 1 ]; then
      echo "BACKEND=megatron on one node of $GPUS_PER_NODE GPUs: $VLLM_ENGINES engines x VLLM_TP $VLLM_TP leave no GPU" \
           "for the actor; lower VLLM_ENGINES or set ACTOR_GPUS (and NNODES)" >&2
      exit 2
    fi
  else
    ACTOR_GPUS="$GPUS_PER_NODE"  # several nodes: the actor fills its nodes, the engines run on another
  fi
fi
CLUSTER_ARGS=(
  --backend megatron --megatron.tp "${MEGATRON_TP:-4}" --megatron.pp "${MEGATRON_PP:-1}"
  --megatron.params_dtype bf16 --megatron.distributed_optimizer
  --actor.num_nodes "${ACTOR_NODES:-1}" --actor.num_gpus_per_node "$ACTOR_GPUS"
  --vllm.num_engines "$VLLM_ENGINES" --vllm.tensor_parallel_size "$VLLM_TP"
  --vllm.gpu_memory_utilization 0.85 --vllm.enable_prefix_caching
)
# PP > 1: OpenRLHF runs the old-log-prob forward as one call per chunk of --rollout.micro_batch_size samples,
# and each call is one pipeline schedule of M = chunk / --train.micro_batch_size micro-batches at efficiency
# M/(M+pp-1) (2/3 at PP2 and 2/5 at PP4 with the tasks' chunks of 2). Chunks of 4 x pp train micro-batches
# keep it >= 80% (8/9 at PP2, 16/19 at PP4; lpo-train --dry-run prints it): derived from MEGATRON_PP unless
# ROLLOUT_MICRO_BATCH_SIZE is set (a task's larger chunk is kept).
_lpo_pp="${MEGATRON_PP:-1}"
if [ -z "${ROLLOUT_MICRO_BATCH_SIZE:-}" ] && [ "$_lpo_pp" -gt 1 ]; then
  _lpo_train_micro=1 _lpo_rollout_micro=1 _lpo_prev=""
  for _lpo_arg in ${TASK_ARGS[@]+"${TASK_ARGS[@]}"}; do
    case "$_lpo_prev" in
      --train.micro_batch_size) _lpo_train_micro="$_lpo_arg" ;;
      --rollout.micro_batch_size) _lpo_rollout_micro="$_lpo_arg" ;;
    esac
    _lpo_prev="$_lpo_arg"
  done
  ROLLOUT_MICRO_BATCH_SIZE=$((4 * _lpo_pp * _lpo_train_micro))
  [ "$_lpo_rollout_micro" -le "$ROLLOUT_MICRO_BATCH_SIZE" ] || ROLLOUT_MICRO_BATCH_SIZE="$_lpo_rollout_micro"
fi
[ -z "${ROLLOUT_MICRO_BATCH_SIZE:-}" ] || CLUSTER_ARGS+=(--rollout.micro_batch_size "$ROLLOUT_MICRO_BATCH_SIZE")
# MEGATRON_SP=1: sequence parallelism (TP > 1); MEGATRON_VPP=V: virtual pipeline stages (PP > 1)
[ "${MEGATRON_SP:-0}" != "1" ] || CLUSTER_ARGS+=(--megatron.sequence_parallel)
[ "${MEGATRON_VPP:-1}" = "1" ] || CLUSTER_ARGS+=(--megatron.vpp "$MEGATRON_VPP")
