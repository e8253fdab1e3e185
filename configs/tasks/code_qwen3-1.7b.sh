# PRIME code (the code split of Eurus-2-RL-Data, 25.3k problems), Qwen3-1.7B-Base. Batch 256 / mini-batch
# 128 prompts, K = 8, 4096 response tokens (Appendix D.3). Prompts: PRIME's system prompt + the problem +
# its code instruction, through the chat template. Data:
#   python -m openrlhf_lpo.data.prepare prime-code --src PRIME-RL/Eurus-2-RL-Data --out data/prime_code_train.jsonl
# Reward: each response's last ```python block runs against the problem's tests in the bubblewrap sandbox
# (openrlhf_lpo/rewards/code.py, docs/code.md). Its settings reach the reward function in the Ray workers as
# environment variables: TASK_ENV below is the one place a launch script sets them (examples/scripts/lib/
# launch.sh exports them and passes them in the job's runtime env); each engine prints the effective values.
TASK_NAME=code_qwen3-1.7b
TASK_ARGS=(
  --actor.model_name_or_path "${MODEL:-Qwen/Qwen3-1.7B-Base}"
  --data.prompt_dataset "${DATA:-data/prime_code_train.jsonl}"
  --data.input_key prompt --data.label_key label --data.apply_chat_template   # [system, user] messages
  --reward.remote_url "${REWARD_FUNC:-openrlhf_lpo/rewards/reward_func.py}"
  --rollout.batch_size 256 --train.batch_size 1024
  --rollout.max_new_tokens 4096 --data.max_len 6144                           # problems up to 2048 tokens
  --train.micro_batch_size 2 --rollout.micro_batch_size 4
  --train.num_episodes "${EPISODES:-5}"                                       # ~99 steps per episode
)
TASK_ENV=(
  "LPO_CODE_SANDBOX=${LPO_CODE_SANDBOX:-bwrap}"      # none = no isolation (trusted single-user machines only)
  "LPO_CODE_REWARD=${LPO_CODE_REWARD:-fraction}"     # fraction of tests passed (PRIME's), or all
  "LPO_CODE_TIMEOUT_S=${LPO_CODE_TIMEOUT_S:-5}"      # CPU seconds per test
  "LPO_CODE_MEMORY_MB=${LPO_CODE_MEMORY_MB:-1024}"
  # sandboxes per engine process: auto = (usable cores - engines per node) // engines per node; the
  # colocated layout runs one engine per GPU (set it to GPUS_PER_NODE / VLLM_TP for tensor-parallel engines)
  "LPO_CODE_ENGINES_PER_NODE=${LPO_CODE_ENGINES_PER_NODE:-${GPUS_PER_NODE:-8}}"
  "LPO_CODE_WORKERS=${LPO_CODE_WORKERS:-auto}"
)
