#!/usr/bin/env bash
# math_qwen3-14b on the Megatron-core actor.
# Cluster: 2 nodes x 8 GPUs (80 GB class: A100/H100/H200), one Ray cluster.
#   node A, 8 GPUs: Megatron actor, TP=4 x PP=1 per replica -> DP=2, distributed optimizer, bf16,
#                   full activation recompute (--actor.gradient_checkpointing_enable, common.sh)
#   node B, 8 GPUs: 8 vLLM engines x TP1 (bf16, 29.6 GB of weights each, prefix caching)
# Memory per actor GPU (Qwen3-14B, 14.8B params): bf16 weights 7.4 GB + fp32 grads 14.8 GB + fp32 main
# params and Adam moments 22.2 GB (sharded over TP x DP) ~ 44 GB, plus ~5 GB for one 5k-token packed
# micro-batch. Peaks (python -m openrlhf_lpo.megatron.memory examples/model_configs/qwen3-14b --tp 4
# --dp 2): forward/backward 49.7 GB (CE / entropy temporaries 1.9 GB), optimizer step 51.7 GB (AdamW
# foreach sqrt(v) 7.4 GB), peak 54.7 GB with a 3 GB allowance for the CUDA context and NCCL buffers.
# See docs/megatron.md. TP groups stay inside node A (tp divides 8 GPUs per node).
# lpo-train checks this placement against the running Ray cluster before any actor starts and stops
# with a message naming the GPUs needed vs present. Alternative: MEGATRON_TP=8 (DP=1).
# Layout rules: actor GPUs % (tp*pp) == 0; 8 KV heads % tp == 0; 40 layers % pp == 0; tp | GPUs per node.
METHOD="${METHOD:-lpo_fwd}"
TASK=math_qwen3-14b
BACKEND=megatron
NNODES="${NNODES:-2}"
MEGATRON_TP="${MEGATRON_TP:-4}"
MEGATRON_PP="${MEGATRON_PP:-1}"
ACTOR_NODES="${ACTOR_NODES:-1}"
ACTOR_GPUS="${ACTOR_GPUS:-8}"
VLLM_ENGINES="${VLLM_ENGINES:-8}"
VLLM_TP="${VLLM_TP:-1}"
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"
