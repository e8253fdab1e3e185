# Megatron-core actor (--backend megatron, docs/megatron.md). Two layouts:
# * colocated (COLOCATE=1, the default unless FAMILY=async, on one node or several): the actor takes every GPU of
#   the NNODES nodes (MEGATRON_TP x MEGATRON_PP per model replica, DP = the rest) and the VLLM_ENGINES engines of
#   VLLM_TP GPUs each share them (default NNODES x GPUS_PER_NODE / VLLM_TP engines: one per GPU at VLLM_TP 1), as
#   configs/backends/deepspeed.sh does: --train.colocate_all --vllm.enable_sleep --ds.enable_sleep. Between
#   phases the actor's parameters and optimizer state go to host memory (its gradient buffers are dropped) while
#   vLLM generates, vLLM sleeps (level 1: weights to the host, KV cache freed) while the actor trains, and the
#   weights reach vLLM through CUDA IPC: on several nodes each node's actor ranks hand them to that node's engines
#   (every TP group and every engine sits inside one node). lpo-train --dry-run prints the memory per GPU of every
#   phase (generation, training, weight sync, checkpoint save), per node, and the host memory per node, and stops
#   a plan that does not fit --megatron.gpu_memory_gb (80) or --megatron.host_memory_gb (default: the memory of
#   the machine it is launched on).
# * split (COLOCATE=0, the default with FAMILY=async): the actor takes ACTOR_NODES x ACTOR_GPUS GPUs and the
#   engines run on GPUs of their own. On one node the engines take VLLM_ENGINES x VLLM_TP GPUs (default 4 x 1) and
#   the actor the rest (8 - 4 = 4); on several nodes the actor fills its nodes and the engines run on others.
# VLLM_GPU_MEMORY_UTILIZATION (default 0.85): vLLM's share of each of its GPUs, in both layouts.
# Checked before anything starts: the layout against the model's HF config (argparse), and the
# placement against ray.cluster_resources() / ray.nodes() (each TP group and each engine on one node).
VLLM_TP="${VLLM_TP:-1}"
if [ -z "${COLOCATE:-}" ]; then
  # async training (FAMILY=async) generates while the actor trains: its engines cannot sleep on the actor's GPUs
  if [ "${FAMILY:-standard}" != "async" ]; then COLOCATE=1; else COLOCATE=0; fi
fi
case "$COLOCATE" in
  1)
    if [ "${FAMILY:-standard}" = "async" ]; then
      echo "BACKEND=megatron COLOCATE=1 with FAMILY=async: async engines generate while the actor trains, so they" \
           "cannot share (and sleep on) its GPUs; set COLOCATE=0" >&2
      exit 2
    fi
    _lpo_gpus=$((NNODES * GPUS_PER_NODE))
    VLLM_ENGINES="${VLLM_ENGINES:-$((_lpo_gpus / VLLM_TP))}"
    _lpo_bad=0
    [ -z "${ACTOR_GPUS:-}" ] || [ "$ACTOR_GPUS" = "$GPUS_PER_NODE" ] || _lpo_bad=1
    [ -z "${ACTOR_NODES:-}" ] || [ "$ACTOR_NODES" = "$NNODES" ] || _lpo_bad=1
    if [ "$_lpo_bad" = "1" ]; then
      echo "BACKEND=megatron COLOCATE=1: the actor takes every GPU (NNODES $NNODES x GPUS_PER_NODE" \
           "$GPUS_PER_NODE), got ACTOR_NODES=${ACTOR_NODES:-} ACTOR_GPUS=${ACTOR_GPUS:-}; unset them, or set" \
           "COLOCATE=0 to give the engines GPUs of their own" >&2
      exit 2
    fi
    if [ $((VLLM_ENGINES * VLLM_TP)) != "$_lpo_gpus" ]; then
      echo "BACKEND=megatron COLOCATE=1: VLLM_ENGINES $VLLM_ENGINES x VLLM_TP $VLLM_TP must share exactly the actor's" \
           "$_lpo_gpus GPUs (NNODES x GPUS_PER_NODE); set VLLM_ENGINES=$((_lpo_gpus / VLLM_TP)) or COLOCATE=0" >&2
      exit 2
    fi
    ACTOR_NODES="$NNODES"
    ACTOR_GPUS="$GPUS_PER_NODE"
    _lpo_placement=(--train.colocate_all --vllm.enable_sleep --ds.enable_sleep)
    ;;
  0)
    VLLM_ENGINES="${VLLM_ENGINES:-4}"
    if [ -z "${ACTOR_GPUS:-}" ]; then
      if [ "$NNODES" = "1" ] && [ "${ACTOR_NODES:-1}" = "1" ]; then
        ACTOR_GPUS=$((GPUS_PER_NODE - VLLM_ENGINES * VLLM_TP))
        if [ "$ACTOR_GPUS" -lt 1 ]; then
          echo "BACKEND=megatron COLOCATE=0 on one node of $GPUS_PER_NODE GPUs: $VLLM_ENGINES engines x VLLM_TP" \
               "$VLLM_TP leave no GPU for the actor; lower VLLM_ENGINES or set ACTOR_GPUS (and NNODES)" >&2
          exit 2
        fi
      else
        ACTOR_GPUS="$GPUS_PER_NODE"  # several nodes: the actor fills its nodes, the engines run on another
      fi
    fi
    _lpo_placement=()
    ;;
  *)
    echo "BACKEND=megatron: COLOCATE must be 1 (actor and vLLM engines share every GPU) or 0 (engines on GPUs of" \
         "their own), got '$COLOCATE'" >&2
    exit 2
    ;;
esac
CLUSTER_ARGS=(
  --backend megatron --megatron.tp "${MEGATRON_TP:-4}" --megatron.pp "${MEGATRON_PP:-1}"
  --megatron.params_dtype bf16 --megatron.distributed_optimizer
  --actor.num_nodes "${ACTOR_NODES:-1}" --actor.num_gpus_per_node "$ACTOR_GPUS"
  --vllm.num_engines "$VLLM_ENGINES" --vllm.tensor_parallel_size "$VLLM_TP"
  --vllm.gpu_memory_utilization "${VLLM_GPU_MEMORY_UTILIZATION:-0.85}" --vllm.enable_prefix_caching
  ${_lpo_placement[@]+"${_lpo_placement[@]}"}
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
