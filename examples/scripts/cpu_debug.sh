#!/usr/bin/env bash
# Debug a recipe on a machine without a GPU (openrlhf_lpo's CPU mode, docs/pipeline.md): the real
# Ray pipeline with DeepSpeed on the CPU, the CPU rollout engine (LPO_CPU_ENGINE=hf|vllm) and a tiny
# random Qwen3 built offline; two LPO iterations, a checkpoint each, weight-sync parity checked.
#   bash examples/scripts/cpu_debug.sh              # METHOD=lpo_rev / grpo / ... to switch method
#   TASK=geometry bash examples/scripts/cpu_debug.sh   # images: a tiny Qwen2.5-VL on PIL-drawn diagrams
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WORK="${WORK:-/tmp/lpo_cpu_debug}"
METHOD="${METHOD:-lpo_fwd}"
TASK="${TASK:-countdown}"
source "$ROOT/configs/methods/$METHOD.sh"
case "$TASK" in
  countdown) MODEL_DIR="$WORK/tiny-qwen3"; DATA_FILE="$WORK/countdown.jsonl"; TASK_FLAGS=() ;;
  geometry) MODEL_DIR="$WORK/tiny-qwen2.5-vl"; DATA_FILE="$WORK/geometry.jsonl"
    # the tiny VLM's image-only processor is code shipped in its folder: the CPU engine may run it
    TASK_FLAGS=(--data.image_key images --data.max_images_per_prompt 1 --data.apply_chat_template
                --cpu.trust_remote_code) ;;
  *) echo "unknown TASK=$TASK (countdown or geometry)" >&2; exit 2 ;;
esac

ARGS=(
  --actor.model_name_or_path "$MODEL_DIR"
  --data.prompt_dataset "$DATA_FILE" --data.input_key prompt --data.label_key label "${TASK_FLAGS[@]}"
  --reward.remote_url "$ROOT/openrlhf_lpo/rewards/reward_func.py"
  --actor.num_nodes 1 --actor.num_gpus_per_node 1 --ref.num_nodes 1 --ref.num_gpus_per_node 1
  --vllm.num_engines 1 --vllm.sync_backend gloo
  --algo.kl.init_coef 0
  --rollout.batch_size 2 --rollout.n_samples_per_prompt 4 --train.batch_size 8
  --train.micro_batch_size 4 --rollout.micro_batch_size 4
  --rollout.max_new_tokens 16 --data.max_len 640 --data.max_samples 4 --train.num_episodes 1
  --ds.zero_stage 2 --ds.attn_implementation sdpa --actor.adam.lr 1e-3
  --ckpt.save_steps 1 --ckpt.path "$WORK/ckpt" --ckpt.output_dir "$WORK/final"
  --logger.tensorboard_dir "$WORK/tb"
  "${METHOD_ARGS[@]}"
)
if [ "${LPO_PRINT_ARGS:-0}" = "1" ]; then printf '%s\n' "${ARGS[@]}"; exit 0; fi
source "$ROOT/examples/scripts/lib/python.sh"
build_model_and_data() {  # the tiny model and a 4-prompt data file of $TASK
  if [ "$TASK" = geometry ]; then
    [ -f "$MODEL_DIR/config.json" ] || "$PY" -c "from openrlhf_lpo.testing.tiny_vlm import build_tiny_vlm; build_tiny_vlm('$MODEL_DIR')"
    [ -f "$DATA_FILE" ] || "$PY" -m openrlhf_lpo.data.prepare geometry --n 4 --seed 0 --template geometry-short --out "$DATA_FILE"
  else
    [ -f "$MODEL_DIR/config.json" ] || "$PY" -c "from openrlhf_lpo.testing.tiny import build_tiny_model; build_tiny_model('$MODEL_DIR')"
    [ -f "$DATA_FILE" ] || "$PY" -m openrlhf_lpo.data.prepare countdown --n 4 --seed 0 --num-counts 3 --out "$DATA_FILE"
  fi
}
if [ "${LPO_DRY_RUN:-0}" = "1" ]; then  # validate and print the plan; builds only the tiny model and data
  mkdir -p "$WORK"
  build_model_and_data
  exec "$PY" -m openrlhf_lpo.cli.train_ppo_ray "${ARGS[@]}" --dry-run
fi

rm -rf "$WORK"; mkdir -p "$WORK"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" LPO_CPU_PARITY_LOG="$WORK/parity.jsonl"
build_model_and_data
"$PY" -m openrlhf_lpo.cli.train_ppo_ray "${ARGS[@]}" 2>&1 | tee "$WORK/run.log"
echo "[cpu_debug] done; weight-sync parity per step:"; cat "$WORK/parity.jsonl" | "$PY" -c \
  "import json,sys; [print(' max|diff|', json.loads(l).get('probe', 'text'), json.loads(l)['max_abs_diff']) for l in sys.stdin]"
