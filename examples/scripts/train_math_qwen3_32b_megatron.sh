#!/usr/bin/env bash
# math_qwen3-32b on the Megatron-core actor.
# Cluster: 2 nodes x 8 GPUs (80 GB class: A100/H100/H200; >= 700 GB of host memory each), one Ray cluster,
# every GPU shared by the actor and a vLLM engine (COLOCATE=1, configs/backends/megatron.sh).
#   nodes A+B, 16 GPUs: Megatron actor, TP=8 x PP=2 per replica -> DP=1, sequence parallelism, bf16,
#                       full activation recompute (--actor.gradient_checkpointing_enable, common.sh);
#                       each TP group is one node, the two pipeline stages are the two nodes; colocated with
#                       8 vLLM engines x TP2 (bf16, 32.8 GB of weights per GPU, prefix caching, 4 per node):
#                       --train.colocate_all --vllm.enable_sleep --ds.enable_sleep. The actor's weights and
#                       optimizer state go to host memory while vLLM generates (gradients dropped), vLLM sleeps
#                       while the actor trains, and each node's actor ranks hand the weights to that node's
#                       engines through CUDA IPC.
# Memory per actor GPU (Qwen3-32B, 32.8B params; stage = 32 layers + embedding or output layer, 2.05B
# params per GPU): bf16 weights 4.1 GB + fp32 grads 8.2 GB + fp32 main params and Adam moments 24.6 GB
# ~ 37 GB, plus ~1.1 GB for a 5k-token packed micro-batch with SP and recompute (layer inputs 0.42 GB
# for the 2 micro-batches in flight, logits 0.5 GB). Peaks (python -m openrlhf_lpo.megatron.memory
# examples/model_configs/qwen3-32b --tp 8 --pp 2 --dp 1 --sp): forward/backward 38.9 GB (CE / entropy
# temporaries 0.9 GB), optimizer step 45.1 GB (AdamW foreach sqrt(v) 8.2 GB), peak 48.1 GB with a 3 GB
# allowance for the CUDA context and NCCL buffers. See docs/megatron.md (memory table, formula).
# Colocated, per GPU of either node (python -m openrlhf_lpo.megatron.colocation_memory examples/model_configs/qwen3-32b
# --tp 8 --pp 2 --dp 1 --sp --vllm-tp 2; lpo-train --dry-run prints every phase per node and stops a plan that does
# not fit): generation 71.5 GB (KV cache for up to ~257k tokens per engine), training 50.1 GB, weight sync 45.0 GB,
# checkpoint save 45.0 GB (the optimizer state is read from host memory; the HF export brings the weights back).
# Host memory per node: 652.2 GB (actor host pools 229.4 GB, vLLM's sleep backups ~292 GB, checkpoint buffers,
# 6 GB per process); lpo-train stops a launch whose node has less than that / 0.95 (--megatron.host_memory_gb).
# Old-log-prob forward: --rollout.micro_batch_size 8 = 4 x PP x micro-batch (configs/backends/megatron.sh),
# 8 micro-batches per pipeline schedule: efficiency 8/9 = 88.9% (it was 2/3 with chunks of 2); training
# windows of 1024 micro-batches: 99.9%. lpo-train --dry-run prints both.
# COLOCATE=0: the split layout on 4 nodes (NNODES=4 then): nodes A+B the actor (same peak), nodes C+D 8 vLLM
# engines x TP2; half the GPUs wait while the other half works in the synchronous loop.
# lpo-train checks this placement against the running Ray cluster before any actor starts and stops
# with a message naming the GPUs needed vs present. Alternative: NNODES=4 (DP=2, 16 engines, 12.3 GB less
# optimizer state per GPU).
# Layout rules: actor GPUs % (tp*pp) == 0; 8 KV heads % tp == 0; 64 layers % pp == 0; tp | GPUs per node.
METHOD="${METHOD:-lpo_fwd}"
TASK=math_qwen3-32b
BACKEND=megatron
if [ "${COLOCATE:-}" = "0" ]; then  # the split layout: the actor on nodes A+B, 8 engines on nodes C+D
  NNODES="${NNODES:-4}"
  ACTOR_NODES="${ACTOR_NODES:-2}"
  ACTOR_GPUS="${ACTOR_GPUS:-8}"
  VLLM_ENGINES="${VLLM_ENGINES:-8}"
fi
NNODES="${NNODES:-2}"
MEGATRON_TP="${MEGATRON_TP:-8}"
MEGATRON_PP="${MEGATRON_PP:-2}"
MEGATRON_SP="${MEGATRON_SP:-1}"
VLLM_TP="${VLLM_TP:-2}"
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"
