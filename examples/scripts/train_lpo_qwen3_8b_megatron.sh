#!/usr/bin/env bash
# LPO (forward KL) on Qwen3-8B with the Megatron-core actor: TP=4 x PP=1,
# 8 actor GPUs -> DP=2; 4 vLLM engines x TP2 for rollouts.
# Layout rules (checked before anything starts): actor GPUs % (tp*pp) == 0; 8 KV heads % tp == 0;
# 36 layers % pp == 0. Alternative: --megatron.tp 2 --megatron.pp 2.
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen3-8B}
DATA=${DATA:-/data/dapo-math-17k}
OUT=${OUT:-/checkpoints/qwen3-8b-lpo-megatron}

BACKEND_ARGS=(
  --backend megatron
  --megatron.tp 4
  --megatron.pp 1
  --megatron.params_dtype bf16
  --megatron.distributed_optimizer
)
ACTOR_ARGS=(
  --actor.model_name_or_path "$MODEL"
  --actor.num_nodes 1
  --actor.num_gpus_per_node 8
  --actor.adam.lr 1e-6
  --actor.max_norm 1.0
)
ROLLOUT_ARGS=(
  --vllm.num_engines 4
  --vllm.tensor_parallel_size 2
  --rollout.batch_size 128
  --rollout.n_samples_per_prompt 8
  --rollout.max_new_tokens 8192
  --rollout.temperature 1.0
  --data.max_len 10240
)
TRAIN_ARGS=(
  --train.batch_size 1024
  --train.micro_batch_size 8
  --train.max_epochs 1
  --train.num_episodes 1
)
ALGO_ARGS=(
  --algo.advantage.estimator lpo
  --lpo.divergence fwd
  --lpo.temperature std
  --algo.kl.init_coef 0
)
DATA_ARGS=(
  --data.prompt_dataset "$DATA"
  --data.input_key prompt
  --data.label_key answer
  --data.apply_chat_template
  --reward.remote_url "$(python3 -c 'import openrlhf_lpo.rewards.reward_func as m; print(m.__file__)')"
)
CKPT_ARGS=(
  --ckpt.path "$OUT/ckpt"
  --ckpt.output_dir "$OUT/final"
  --ckpt.save_steps 20
  --ckpt.save_hf
  --ckpt.load_enable
)

ray job submit --address="${RAY_ADDRESS:-http://127.0.0.1:8265}" -- \
  python3 -m openrlhf_lpo.cli.train_ppo_ray \
  "${BACKEND_ARGS[@]}" "${ACTOR_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${TRAIN_ARGS[@]}" \
  "${ALGO_ARGS[@]}" "${DATA_ARGS[@]}" "${CKPT_ARGS[@]}" "$@"
