# MATH (7.5k problems), DeepSeek-R1-Distill-Llama-70B (Llama 3.x architecture with Llama 3 RoPE
# scaling; MODEL=meta-llama/Llama-3.1-70B takes the same cluster): the 8B recipe (batch 256 /
# mini-batch 128 prompts, 4096 response tokens) with the 70B model; meant for the Megatron actor
# (examples/scripts/train_math_r1_distill_llama_70b_megatron.sh).
MODEL="${MODEL:-deepseek-ai/DeepSeek-R1-Distill-Llama-70B}"
# The 8B task's old-log-prob chunks of 2 samples would give a pipeline schedule of 2 micro-batches;
# with MEGATRON_PP > 1 configs/backends/megatron.sh raises --rollout.micro_batch_size to 4 x PP x micro-batch.
source "$(dirname "${BASH_SOURCE[0]}")/math_qwen3-8b.sh"
TASK_NAME=math_r1-distill-llama-70b
