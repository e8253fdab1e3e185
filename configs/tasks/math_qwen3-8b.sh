# MATH (7.5k problems), Qwen3-8B-Base. Same recipe as 1.7B; ZeRO-3 to fit the 8B actor.
TASK_NAME=math_qwen3-8b
TASK_ARGS=(
  --actor.model_name_or_path "${MODEL:-Qwen/Qwen3-8B-Base}"
  --data.prompt_dataset "${DATA:-data/math_train.jsonl}"
  --data.input_key prompt --data.label_key label --data.apply_chat_template
  --reward.remote_url "${REWARD_FUNC:-openrlhf_lpo/rewards/reward_func.py}"
  --rollout.batch_size 256 --train.batch_size 1024
  --rollout.max_new_tokens 4096 --data.max_len 5120
  --train.micro_batch_size 1 --rollout.micro_batch_size 2
  --ds.zero_stage 3
  --train.num_episodes "${EPISODES:-10}"
)
