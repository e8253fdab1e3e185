# MATH (7.5k problems), Qwen3-14B-Base: the 8B recipe (batch 256 / mini-batch 128 prompts, 4096
# response tokens) with the 14B model; meant for the Megatron actor
# (examples/scripts/train_math_qwen3_14b_megatron.sh).
MODEL="${MODEL:-Qwen/Qwen3-14B-Base}"
source "$(dirname "${BASH_SOURCE[0]}")/math_qwen3-8b.sh"
TASK_NAME=math_qwen3-14b
