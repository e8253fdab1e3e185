# Countdown (Countdown-34, 2000 training problems), Qwen3-4B-Base.
# Batch 128 prompts / mini-batch 64 prompts (2 updates per iteration), 1024 response tokens.
# OpenRLHF counts --train.batch_size in samples: 64 prompts x K=8 = 512.
TASK_NAME=countdown_qwen3-4b
TASK_ARGS=(
  --actor.model_name_or_path "${MODEL:-Qwen/Qwen3-4B-Base}"
  --data.prompt_dataset "${DATA:-data/countdown_train.jsonl}"
  --data.input_key prompt --data.label_key label          # raw TinyZero prompt, no chat template
  --reward.remote_url "${REWARD_FUNC:-openrlhf_lpo/rewards/reward_func.py}"
  --rollout.batch_size 128 --train.batch_size 512
  --rollout.max_new_tokens 1024 --data.max_len 1536
  --train.micro_batch_size 4 --rollout.micro_batch_size 8
  --train.num_episodes "${EPISODES:-8}"
)
