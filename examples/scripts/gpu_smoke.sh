#!/usr/bin/env bash
# GPU smoke test of the LPO pipeline (one GPU, a few minutes): a tiny random Qwen3 built offline,
# generated Countdown data, real vLLM + DeepSpeed + Ray, two LPO iterations with checkpoints,
# then a resume from the step-2 checkpoint; the steps are checked in TensorBoard. Run from the repository root on a machine with a GPU
# and the project installed (scripts/setup_env.sh installs CPU wheels; use a CUDA torch/vllm there).
#   bash examples/scripts/gpu_smoke.sh            # METHOD=lpo_rev / grpo / ... to switch method
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WORK="${WORK:-/tmp/lpo_gpu_smoke}"
METHOD="${METHOD:-lpo_fwd}"
source "$ROOT/configs/methods/$METHOD.sh"

ARGS=(
  --actor.model_name_or_path "$WORK/tiny-qwen3"
  --data.prompt_dataset "$WORK/countdown.jsonl" --data.input_key prompt --data.label_key label
  --reward.remote_url "$ROOT/openrlhf_lpo/rewards/reward_func.py"
  --actor.num_nodes 1 --actor.num_gpus_per_node 1 --ref.num_nodes 1 --ref.num_gpus_per_node 1
  --vllm.num_engines 1 --vllm.tensor_parallel_size 1 --vllm.gpu_memory_utilization 0.3
  --vllm.enable_sleep --ds.enable_sleep --train.colocate_all --vllm.enforce_eager
  --algo.kl.init_coef 0
  --rollout.batch_size 4 --rollout.n_samples_per_prompt 8 --train.batch_size 16
  --train.micro_batch_size 4 --rollout.micro_batch_size 8
  --rollout.max_new_tokens 64 --data.max_len 768 --data.max_samples 8 --train.num_episodes 1
  --actor.adam.lr 1e-4 --ds.zero_stage 2 --ds.param_dtype bf16 --ds.attn_implementation flash_attention_2
  --ckpt.save_steps 1 --ckpt.path "$WORK/ckpt" --ckpt.output_dir "$WORK/final"
  --logger.tensorboard_dir "$WORK/tb"
  "${METHOD_ARGS[@]}"
)
if [ "${LPO_PRINT_ARGS:-0}" = "1" ]; then printf '%s\n' "${ARGS[@]}"; exit 0; fi
source "$ROOT/examples/scripts/lib/python.sh"
if [ "${LPO_DRY_RUN:-0}" = "1" ]; then  # validate and print the plan; builds only the tiny model and data
  mkdir -p "$WORK"
  [ -f "$WORK/tiny-qwen3/config.json" ] || "$PY" -c "from openrlhf_lpo.testing.tiny import build_tiny_model; build_tiny_model('$WORK/tiny-qwen3')"
  [ -f "$WORK/countdown.jsonl" ] || "$PY" -m openrlhf_lpo.data.prepare countdown --n 8 --seed 0 --num-counts 3 --out "$WORK/countdown.jsonl"
  exec "$PY" -m openrlhf_lpo.cli.train_ppo_ray "${ARGS[@]}" --dry-run
fi

"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_smoke.sh needs a GPU (use examples/scripts/cpu_debug.sh on a CPU)')"
rm -rf "$WORK"; mkdir -p "$WORK"
"$PY" -c "from openrlhf_lpo.testing.tiny import build_tiny_model; build_tiny_model('$WORK/tiny-qwen3')"
"$PY" -m openrlhf_lpo.data.prepare countdown --n 8 --seed 0 --num-counts 3 --out "$WORK/countdown.jsonl"
# steps are read from TensorBoard, which the trainer writes itself (Ray may drop forwarded log lines at exit)
"$PY" -m openrlhf_lpo.cli.train_ppo_ray "${ARGS[@]}" 2>&1 | tee "$WORK/run_a.log"
"$PY" -m openrlhf_lpo.testing.tensorboard_rows "$WORK/tb" --steps 1,2 --exact
test -d "$WORK/ckpt/_actor/global_step2"
"$PY" -m openrlhf_lpo.cli.train_ppo_ray "${ARGS[@]}" --ckpt.load_enable --train.num_episodes 2 \
  --logger.tensorboard_dir "$WORK/tb_resume" 2>&1 | tee "$WORK/run_b.log"
# the resumed run trains exactly the second episode's steps: it started from the step-2 checkpoint
"$PY" -m openrlhf_lpo.testing.tensorboard_rows "$WORK/tb_resume" --steps 3,4 --exact
echo "[gpu_smoke] OK: 2 iterations, checkpoint, resume ($METHOD). Logs in $WORK"
