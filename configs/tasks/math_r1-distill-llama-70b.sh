# MATH (7.5k problems), DeepSeek-R1-Distill-Llama-70B (Llama 3.x architecture with Llama 3 RoPE
# scaling; MODEL=meta-llama/Llama-3.1-70B takes the same cluster): the 8B recipe (batch 256 /
# mini-batch 128 prompts, 4096 response tokens) with the 70B model; meant for the Megatron actor
# (examples/scripts/train_math_r1_distill_llama_70b_megatron.sh).
MODEL="${MODEL:-deepseek-ai/DeepSeek-R1-Distill-Llama-70B}"
source "$(dirname "${BASH_SOURCE[0]}")/math_qwen3-8b.sh"
TASK_NAME=math_r1-distill-llama-70b
