#!/usr/bin/env bash
# math_r1-distill-llama-70b on the Megatron-core actor (DeepSeek-R1-Distill-Llama-70B; MODEL=
# meta-llama/Llama-3.1-70B has the same shapes and takes the same cluster).
# Cluster: 8 nodes x 8 GPUs (80 GB class: A100/H100/H200), one Ray cluster.
#   nodes A-D, 32 GPUs: Megatron actor, TP=8 x PP=4 per replica -> DP=1, sequence parallelism, bf16,
#                       full activation recompute (--actor.gradient_checkpointing_enable, common.sh);
#                       each TP group is one node, each pipeline stage (20 layers) is one node
#   nodes E-H, 32 GPUs: 8 vLLM engines x TP4 (bf16, 35.3 GB of weights per GPU, prefix caching)
# Memory per actor GPU (70.6B params; the first stage = 20 layers + embedding, 2.27B params per GPU):
# bf16 weights 4.5 GB + fp32 grads 9.1 GB + fp32 main params and Adam moments 27.2 GB ~ 41 GB, plus
# ~1.4 GB for a 5k-token packed micro-batch with SP and recompute (layer inputs 0.84 GB for the 4
# micro-batches in flight on the first stage). Peaks (python -m openrlhf_lpo.megatron.memory
# examples/model_configs/deepseek-r1-distill-llama-70b --tp 8 --pp 4 --dp 1 --sp): forward/backward
# 43.1 GB (CE / entropy temporaries 0.8 GB), optimizer step 50.0 GB (AdamW foreach sqrt(v) 9.1 GB), peak
# 53.0 GB with a 3 GB allowance for the CUDA context and NCCL buffers. See docs/megatron.md (memory table).
# Old-log-prob forward: --rollout.micro_batch_size 16 = 4 x PP x micro-batch (configs/backends/megatron.sh),
# 16 micro-batches per pipeline schedule: efficiency 16/19 = 84.2% (it was 2/5 with chunks of 2); training
# windows of 1024 micro-batches: 99.7%. lpo-train --dry-run prints both.
# lpo-train checks this placement against the running Ray cluster before any actor starts and stops
# with a message naming the GPUs needed vs present. Alternative: MEGATRON_PP=2 ACTOR_NODES=4 (DP=2,
# 53 GB static per GPU).
# Layout rules: actor GPUs % (tp*pp) == 0; 8 KV heads % tp == 0; 80 layers % pp == 0; tp | GPUs per node.
METHOD="${METHOD:-lpo_fwd}"
TASK=math_r1-distill-llama-70b
BACKEND=megatron
NNODES="${NNODES:-8}"
MEGATRON_TP="${MEGATRON_TP:-8}"
MEGATRON_PP="${MEGATRON_PP:-4}"
MEGATRON_SP="${MEGATRON_SP:-1}"
ACTOR_NODES="${ACTOR_NODES:-4}"
ACTOR_GPUS="${ACTOR_GPUS:-8}"
VLLM_ENGINES="${VLLM_ENGINES:-8}"
VLLM_TP="${VLLM_TP:-4}"
# checkpoints of 0.8 TiB (fp32 params + Adam moments): once per episode (30 rollout batches), two kept (three
# at the peak, the new one is whole before the oldest goes) + HF exports: ~3.0 TiB, as --dry-run states
CKPT_SAVE_STEPS="${CKPT_SAVE_STEPS:-30}"
CKPT_MAX_NUM="${CKPT_MAX_NUM:-2}"
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"
