# MATH (7.5k problems), Qwen3-1.7B-Base. Batch 256 / mini-batch 128 prompts, 4096 response tokens.
TASK_NAME=math_qwen3-1.7b
TASK_ARGS=(
  --actor.model_name_or_path "${MODEL:-Qwen/Qwen3-1.7B-Base}"
  --data.prompt_dataset "${DATA:-data/math_train.jsonl}"
  --data.input_key prompt --data.label_key label --data.apply_chat_template   # verl template as user turn
  --reward.remote_url "${REWARD_FUNC:-openrlhf_lpo/rewards/reward_func.py}"
  --rollout.batch_size 256 --train.batch_size 1024
  --rollout.max_new_tokens 4096 --data.max_len 5120
  --train.micro_batch_size 2 --rollout.micro_batch_size 4
  --train.num_episodes "${EPISODES:-10}"
)
