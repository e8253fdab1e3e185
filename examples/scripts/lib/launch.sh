# Shared launcher of the LPO recipes (sourced by examples/scripts/train_*.sh).
# Inputs: TASK (configs/tasks/<TASK>.sh), METHOD (configs/methods/<METHOD>.sh), BACKEND
# (configs/backends/<BACKEND>.sh: deepspeed, the default, or megatron with MEGATRON_TP/MEGATRON_PP) and
# FAMILY (configs/families/<FAMILY>.sh: OpenRLHF's recipe families long_context and async; default standard).
# Environment knobs: NNODES, GPUS_PER_NODE, VLLM_ENGINES, VLLM_TP, RAY_ADDRESS, WORKING_DIR, SAVE_ROOT (default
# ~/lpo_runs: checkpoints, TensorBoard and the final model under $SAVE_ROOT/$RUN_NAME, never inside the checkout),
# WANDB_KEY, AUTO_RESUME (default 3: --ckpt.auto_resume, 0 turns it off), EXTRA_ARGS (appended last, so they override the recipe), LPO_PRINT_ARGS=1 (print the
# flags one per line and exit: used by tests/pipeline to parse every recipe with the lpo-train parser),
# LPO_PRINT_RUNTIME_ENV=1 (print the Ray job's runtime env and exit), LPO_SUBMISSION_ID (the Ray job's submission id;
# lpo-compare sets it). A task may set TASK_ENV=(NAME=value ...):
# environment variables for every Ray worker (e.g. the code reward's LPO_CODE_* settings), also exported here.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
CONFIGS="${LPO_CONFIGS:-$ROOT/configs}"
[ -f "$CONFIGS/tasks/$TASK.sh" ] || { echo "unknown TASK=$TASK (see $CONFIGS/tasks)" >&2; exit 2; }
[ -f "$CONFIGS/methods/$METHOD.sh" ] || { echo "unknown METHOD=$METHOD (see $CONFIGS/methods)" >&2; exit 2; }
BACKEND="${BACKEND:-deepspeed}"
[ -f "$CONFIGS/backends/$BACKEND.sh" ] || { echo "unknown BACKEND=$BACKEND (see $CONFIGS/backends)" >&2; exit 2; }
source "$CONFIGS/common.sh"
source "$CONFIGS/tasks/$TASK.sh"
source "$CONFIGS/methods/$METHOD.sh"

NNODES="${NNODES:-1}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
SAVE_ROOT="${SAVE_ROOT:-${HOME:-/tmp}/lpo_runs}"  # outside the checkout; shared storage on a multi-node cluster
RUN_NAME="${RUN_NAME:-${TASK}_${METHOD}}"
echo "[launch] checkpoints, TensorBoard and the final model go to $SAVE_ROOT/$RUN_NAME (SAVE_ROOT=...; --dry-run prints the disk they need)" >&2
source "$CONFIGS/backends/$BACKEND.sh"  # CLUSTER_ARGS
FAMILY="${FAMILY:-standard}"             # OpenRLHF recipe family: standard, long_context, async
FAMILY_ARGS=()
if [ "$FAMILY" != "standard" ]; then
  [ -f "$CONFIGS/families/$FAMILY.sh" ] || { echo "unknown FAMILY=$FAMILY (see $CONFIGS/families)" >&2; exit 2; }
  source "$CONFIGS/families/$FAMILY.sh"  # FAMILY_ARGS (and the cluster layout it needs)
fi
LOG_ARGS=(
  --ckpt.path "$SAVE_ROOT/$RUN_NAME/ckpt" --ckpt.output_dir "$SAVE_ROOT/$RUN_NAME/final"
  --ckpt.save_steps "${CKPT_SAVE_STEPS:-20}" --ckpt.save_hf --ckpt.max_num "${CKPT_MAX_NUM:-3}" --ckpt.load_enable
  --ckpt.auto_resume "${AUTO_RESUME:-3}"  # restart after a lost worker, node or driver (docs/pipeline.md)
  --logger.logging_steps 1 --logger.tensorboard_dir "$SAVE_ROOT/$RUN_NAME/tb"
)
if [ -n "${WANDB_KEY:-}" ]; then
  LOG_ARGS+=(--logger.wandb.key "$WANDB_KEY" --logger.wandb.project openrlhf_lpo --logger.wandb.run_name "$RUN_NAME")
fi
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"
ARGS=("${COMMON_ARGS[@]}" "${TASK_ARGS[@]}" "${CLUSTER_ARGS[@]}" "${FAMILY_ARGS[@]}" "${LOG_ARGS[@]}" "${METHOD_ARGS[@]}" "${EXTRA[@]}")

if [ "${LPO_PRINT_ARGS:-0}" = "1" ]; then
  printf '%s\n' "${ARGS[@]}"
  exit 0
fi
if [ "${LPO_DRY_RUN:-0}" = "1" ]; then
  source "$ROOT/examples/scripts/lib/python.sh"
  cd "$ROOT"
  exec "$PY" -m openrlhf_lpo.cli.train_ppo_ray "${ARGS[@]}" --dry-run
fi

ENV_JSON=""
for kv in ${TASK_ENV[@]+"${TASK_ENV[@]}"}; do
  ENV_JSON+="${ENV_JSON:+, }\"${kv%%=*}\": \"${kv#*=}\""
  export "${kv?}"
done
RUNTIME_ENV="{\"working_dir\": \"${WORKING_DIR:-$ROOT}\""
[ -z "$ENV_JSON" ] || RUNTIME_ENV+=", \"env_vars\": {$ENV_JSON}"
RUNTIME_ENV+="}"
if [ "${LPO_PRINT_RUNTIME_ENV:-0}" = "1" ]; then
  printf '%s\n' "$RUNTIME_ENV"
  exit 0
fi

SUBMIT_ID=()  # LPO_SUBMISSION_ID: the Ray job's submission id (lpo-compare follows or stops its runs by it)
[ -z "${LPO_SUBMISSION_ID:-}" ] || SUBMIT_ID=(--submission-id "$LPO_SUBMISSION_ID")
ray job submit --address="${RAY_ADDRESS:-http://127.0.0.1:8265}" ${SUBMIT_ID[@]+"${SUBMIT_ID[@]}"} \
  --runtime-env-json="$RUNTIME_ENV" \
  -- python3 -m openrlhf_lpo.cli.train_ppo_ray "${ARGS[@]}"
