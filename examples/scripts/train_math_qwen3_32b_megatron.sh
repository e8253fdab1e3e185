#!/usr/bin/env bash
# math_qwen3-32b on the Megatron-core actor.
# Cluster: 4 nodes x 8 GPUs (80 GB class: A100/H100/H200), one Ray cluster.
#   nodes A+B, 16 GPUs: Megatron actor, TP=8 x PP=2 per replica -> DP=1, sequence parallelism, bf16,
#                       full activation recompute (--actor.gradient_checkpointing_enable, common.sh);
#                       each TP group is one node, the two pipeline stages are the two nodes
#   nodes C+D, 16 GPUs: 8 vLLM engines x TP2 (bf16, 32.8 GB of weights per GPU, prefix caching)
# Memory per actor GPU (Qwen3-32B, 32.8B params; stage = 32 layers + embedding or output layer, 2.05B
# params per GPU): bf16 weights 4.1 GB + fp32 grads 8.2 GB + fp32 main params and Adam moments 24.6 GB
# ~ 37 GB, plus ~1.1 GB for a 5k-token packed micro-batch with SP and recompute (layer inputs 0.42 GB
# for the 2 micro-batches in flight, logits 0.5 GB). Peaks (python -m openrlhf_lpo.megatron.memory
# examples/model_configs/qwen3-32b --tp 8 --pp 2 --dp 1 --sp): forward/backward 38.9 GB (CE / entropy
# temporaries 0.9 GB), optimizer step 45.1 GB (AdamW foreach sqrt(v) 8.2 GB), peak 48.1 GB with a 3 GB
# allowance for the CUDA context and NCCL buffers. See docs/megatron.md (memory table, formula).
# Old-log-prob forward: --rollout.micro_batch_size 8 = 4 x PP x micro-batch (configs/backends/megatron.sh),
# 8 micro-batches per pipeline schedule: efficiency 8/9 = 88.9% (it was 2/3 with chunks of 2); training
# windows of 1024 micro-batches: 99.9%. lpo-train --dry-run prints both.
# lpo-train checks this placement against the running Ray cluster before any actor starts and stops
# with a message naming the GPUs needed vs present. Alternative: ACTOR_NODES=4 (DP=2, 12.3 GB less
# optimizer state per GPU; NNODES=6).
# Layout rules: actor GPUs % (tp*pp) == 0; 8 KV heads % tp == 0; 64 layers % pp == 0; tp | GPUs per node.
METHOD="${METHOD:-lpo_fwd}"
TASK=math_qwen3-32b
BACKEND=megatron
NNODES="${NNODES:-4}"
MEGATRON_TP="${MEGATRON_TP:-8}"
MEGATRON_PP="${MEGATRON_PP:-2}"
MEGATRON_SP="${MEGATRON_SP:-1}"
ACTOR_NODES="${ACTOR_NODES:-2}"
ACTOR_GPUS="${ACTOR_GPUS:-8}"
VLLM_ENGINES="${VLLM_ENGINES:-8}"
VLLM_TP="${VLLM_TP:-2}"
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"
