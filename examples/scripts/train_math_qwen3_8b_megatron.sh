#!/usr/bin/env bash
# math_qwen3-8b on the Megatron-core actor.
# Cluster: 1 node x 8 GPUs (80 GB class: A100/H100/H200; >= 512 GB of host memory), every GPU shared by the
# actor and a vLLM engine.
#   GPUs 0-7: Megatron actor, TP=2 x PP=1 per replica -> DP=4, distributed optimizer, bf16, full activation
#             recompute (--actor.gradient_checkpointing_enable, common.sh), colocated with 8 vLLM engines x TP1
#             (bf16, prefix caching, --vllm.gpu_memory_utilization 0.85): --train.colocate_all --vllm.enable_sleep
#             --ds.enable_sleep (configs/backends/megatron.sh, COLOCATE=1 by default). The two take turns: the
#             actor's parameters and optimizer state go to host memory (gradients dropped) while vLLM
#             generates, vLLM sleeps (level 1: weights to host memory, KV cache freed) while the actor trains,
#             and the weights reach vLLM through CUDA IPC.
# Memory per GPU (python -m openrlhf_lpo.megatron.colocation_memory examples/model_configs/qwen3-8b --tp 2
# --dp 4; lpo-train --dry-run prints it and stops a plan that does not fit):
#   generation 71.5 GB: vLLM's budget 0.85 x 80 GB (16.4 GB weights, KV cache for up to ~340k tokens) + its
#     CUDA context 0.5 GB + the offloaded actor's CUDA context and NCCL buffers 3 GB (no weights, no state);
#   training 49.5 GB: the actor (8.2B params; bf16 weights 8.2 GB + fp32 grads 16.4 GB + fp32 main params and
#     Adam moments 12.3 GB sharded over TP x DP ~ 36.9 GB static) peaks at forward/backward 44.5 GB (CE / entropy
#     temporaries 3.7 GB), optimizer step 41.0 GB (AdamW foreach sqrt(v) 4.1 GB), peak 47.5 GB with a 3 GB
#     allowance for the CUDA context and NCCL buffers; + 2 GB vLLM keeps asleep. See docs/megatron.md.
#   weight sync 32.4 GB; checkpoint save 32.1 GB: vLLM's weights stay awake after the sync, the actor reads its
#     optimizer state from host memory (nothing comes back for the checkpoint; the HF export brings the
#     bf16 weights back, as the sync does).
# Host memory of the node: 453.3 GB (python -m openrlhf_lpo.megatron.host_memory; the actor's host pools,
#   vLLM's sleep backups, checkpoint buffers, 6 GB per process); lpo-train stops a launch on a machine with
#   less than that / 0.95 (--megatron.host_memory_gb).
# COLOCATE=0: the split layout (GPUs 0-3 the actor, TP2 x DP2, peak 60.3 GB; GPUs 4-7 4 vLLM engines x TP1).
# lpo-train checks this placement against the running Ray cluster before any actor starts and stops
# with a message naming the GPUs needed vs present. Alternative: MEGATRON_TP=4 (DP=2).
# Layout rules: actor GPUs % (tp*pp) == 0; 8 KV heads % tp == 0; 36 layers % pp == 0; tp | GPUs per node.
METHOD="${METHOD:-lpo_fwd}"
TASK=math_qwen3-8b
BACKEND=megatron
NNODES="${NNODES:-1}"
MEGATRON_TP="${MEGATRON_TP:-2}"
MEGATRON_PP="${MEGATRON_PP:-1}"
VLLM_TP="${VLLM_TP:-1}"
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"
