# Geometry3k (2.1k training problems, one diagram each), Qwen2.5-VL-3B-Instruct: the paper's multi-modal domain.
# Batch 128 prompts / mini-batch 64 prompts (2 updates per iteration), 1024 response tokens (App. D.3).
# OpenRLHF counts --train.batch_size in samples: 64 prompts x K=8 = 512.
# Data: python -m openrlhf_lpo.data.prepare geometry3k --src hiyouga/geometry3k (or a local copy) --split train
#       --out data/geo3k_train.jsonl   (prompt = problem + verl's geo3k instruction, label, images as data URIs).
# Images go through OpenRLHF 0.11.2's VLM path: the processor expands each diagram into image tokens
# (counted in --data.max_len; an over-long image prompt is an error, never truncated); no packing, no critic.
# The vision tower trains too (verl/EasyR1 default); EXTRA_ARGS=--actor.freeze_visual_encoder freezes it.
TASK_NAME=geometry_qwen2.5-vl-3b
TASK_ARGS=(
  --actor.model_name_or_path "${MODEL:-Qwen/Qwen2.5-VL-3B-Instruct}"
  --data.prompt_dataset "${DATA:-data/geo3k_train.jsonl}"
  --data.input_key prompt --data.label_key label --data.apply_chat_template
  --data.image_key images --data.max_images_per_prompt 1
  --reward.remote_url "${REWARD_FUNC:-openrlhf_lpo/rewards/reward_func.py}"
  --rollout.batch_size 128 --train.batch_size 512
  --rollout.max_new_tokens 1024 --data.max_len 2048
  --train.micro_batch_size 4 --rollout.micro_batch_size 8
  --ds.zero_stage 2
  --train.num_episodes "${EPISODES:-10}"
)
