#!/usr/bin/env bash
# math_qwen3-8b on the Megatron-core actor.
# Cluster: 1 node x 8 GPUs (80 GB class: A100/H100/H200).
#   GPUs 0-3: Megatron actor, TP=2 x PP=1 per replica -> DP=2, distributed optimizer, bf16,
#             full activation recompute (--actor.gradient_checkpointing_enable, common.sh)
#   GPUs 4-7: 4 vLLM engines x TP1 (bf16, prefix caching; weights streamed after every update)
# Memory per actor GPU (Qwen3-8B, 8.2B params): bf16 weights 8.2 GB + fp32 grads 16.4 GB + fp32 main
# params and Adam moments 24.6 GB (sharded over TP x DP) ~ 49 GB, plus ~6 GB for one 5k-token packed
# micro-batch (logits of the response rows only). Peaks (python -m openrlhf_lpo.megatron.memory
# examples/model_configs/qwen3-8b --tp 2 --dp 2): forward/backward 56.8 GB (CE / entropy temporaries
# 3.7 GB), optimizer step 57.3 GB (AdamW foreach sqrt(v) 8.2 GB), peak 60.3 GB with a 3 GB allowance for
# the CUDA context and NCCL buffers. See docs/megatron.md.
# lpo-train checks this placement against the running Ray cluster before any actor starts and stops
# with a message naming the GPUs needed vs present. Alternative: MEGATRON_TP=4 ACTOR_GPUS=4 (DP=1).
# Layout rules: actor GPUs % (tp*pp) == 0; 8 KV heads % tp == 0; 36 layers % pp == 0; tp | GPUs per node.
METHOD="${METHOD:-lpo_fwd}"
TASK=math_qwen3-8b
BACKEND=megatron
NNODES="${NNODES:-1}"
MEGATRON_TP="${MEGATRON_TP:-2}"
MEGATRON_PP="${MEGATRON_PP:-1}"
ACTOR_NODES="${ACTOR_NODES:-1}"
ACTOR_GPUS="${ACTOR_GPUS:-4}"
VLLM_ENGINES="${VLLM_ENGINES:-4}"
VLLM_TP="${VLLM_TP:-1}"
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"
