# MATH (7.5k problems), Qwen3-32B: the 8B recipe (batch 256 / mini-batch 128 prompts, 4096 response
# tokens) with the 32B model; meant for the Megatron actor
# (examples/scripts/train_math_qwen3_32b_megatron.sh). Qwen released no Qwen3-32B-Base: the default is
# the post-trained Qwen3-32B (set MODEL to another checkpoint of the same shape).
MODEL="${MODEL:-Qwen/Qwen3-32B}"
# The 8B task's old-log-prob chunks of 2 samples would give a pipeline schedule of 2 micro-batches;
# with MEGATRON_PP > 1 configs/backends/megatron.sh raises --rollout.micro_batch_size to 4 x PP x micro-batch.
source "$(dirname "${BASH_SOURCE[0]}")/math_qwen3-8b.sh"
TASK_NAME=math_qwen3-32b
