#!/usr/bin/env bash
# math_qwen3-14b on the Megatron-core actor.
# Cluster: 1 node x 8 GPUs (80 GB class: A100/H100/H200; >= 768 GB of host memory), every GPU shared by the
# actor and a vLLM engine.
#   GPUs 0-7: Megatron actor, TP=4 x PP=1 per replica -> DP=2, distributed optimizer, bf16, full activation
#             recompute (--actor.gradient_checkpointing_enable, common.sh), colocated with 8 vLLM engines x TP1
#             (bf16, 29.5 GB of weights each, prefix caching, --vllm.gpu_memory_utilization 0.85):
#             --train.colocate_all --vllm.enable_sleep --ds.enable_sleep (configs/backends/megatron.sh,
#             COLOCATE=1 by default). The two take turns: the actor's parameters and optimizer
#             state go to host memory (gradients dropped) while vLLM generates, vLLM sleeps (level 1: weights
#             to host memory, KV cache freed) while the actor trains, and the weights reach vLLM through CUDA IPC.
# Memory per GPU (python -m openrlhf_lpo.megatron.colocation_memory examples/model_configs/qwen3-14b --tp 4
# --dp 2; lpo-train --dry-run prints it and stops a plan that does not fit):
#   generation 71.5 GB: vLLM's budget 0.85 x 80 GB (29.5 GB weights, KV cache for up to ~226k tokens) + its
#     CUDA context 0.5 GB + the offloaded actor's CUDA context and NCCL buffers 3 GB (no weights, no state);
#   training 56.7 GB: the actor (14.8B params; bf16 weights 7.4 GB + fp32 grads 14.8 GB + fp32 main params and
#     Adam moments 22.2 GB sharded over TP x DP ~ 44.3 GB static) peaks at forward/backward 49.7 GB (CE / entropy
#     temporaries 1.9 GB), optimizer step 51.7 GB (AdamW foreach sqrt(v) 7.4 GB), peak 54.7 GB with a 3 GB
#     allowance for the CUDA context and NCCL buffers; + 2 GB vLLM keeps asleep. See docs/megatron.md.
#   weight sync 45.1 GB; checkpoint save 45.0 GB: vLLM's weights stay awake after the sync, the actor reads its
#     optimizer state from host memory (nothing comes back for the checkpoint; the HF export brings the
#     bf16 weights back, as the sync does).
# Host memory of the node: 709.8 GB (python -m openrlhf_lpo.megatron.host_memory; the actor's host pools,
#   vLLM's sleep backups, checkpoint buffers, 6 GB per process); lpo-train stops a launch on a machine with
#   less than that / 0.95 (--megatron.host_memory_gb).
# COLOCATE=0: the split layout on 2 nodes (NNODES=2 by default then): node A the actor (TP4 x DP2, same peak),
# node B 8 vLLM engines x TP1. TP groups stay inside a node (tp divides 8 GPUs per node).
# lpo-train checks this placement against the running Ray cluster before any actor starts and stops
# with a message naming the GPUs needed vs present. Alternative: MEGATRON_TP=8 (DP=1, peak 43.6 GB).
# Layout rules: actor GPUs % (tp*pp) == 0; 8 KV heads % tp == 0; 40 layers % pp == 0; tp | GPUs per node.
METHOD="${METHOD:-lpo_fwd}"
TASK=math_qwen3-14b
BACKEND=megatron
if [ "${COLOCATE:-}" = "0" ]; then  # the split layout: the actor on node A, 8 engines on node B
  NNODES="${NNODES:-2}"
  ACTOR_NODES="${ACTOR_NODES:-1}"
  ACTOR_GPUS="${ACTOR_GPUS:-8}"
  VLLM_ENGINES="${VLLM_ENGINES:-8}"
fi
NNODES="${NNODES:-1}"
MEGATRON_TP="${MEGATRON_TP:-4}"
MEGATRON_PP="${MEGATRON_PP:-1}"
VLLM_TP="${VLLM_TP:-1}"
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"
