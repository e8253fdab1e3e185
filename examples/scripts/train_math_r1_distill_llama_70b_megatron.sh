#!/usr/bin/env bash
# math_r1-distill-llama-70b on the Megatron-core actor (DeepSeek-R1-Distill-Llama-70B; MODEL=
# meta-llama/Llama-3.1-70B has the same shapes and takes the same cluster).
# Cluster: 4 nodes x 8 GPUs (80 GB class: A100/H100/H200; >= 800 GB of host memory each), one Ray cluster,
# every GPU shared by the actor and a vLLM engine (COLOCATE=1, configs/backends/megatron.sh).
#   nodes A-D, 32 GPUs: Megatron actor, TP=8 x PP=4 per replica -> DP=1, sequence parallelism, bf16,
#                       full activation recompute (--actor.gradient_checkpointing_enable, common.sh);
#                       each TP group is one node, each pipeline stage (20 layers) is one node; colocated with
#                       8 vLLM engines x TP4 (bf16, 35.3 GB of weights per GPU, prefix caching, 2 per node):
#                       --train.colocate_all --vllm.enable_sleep --ds.enable_sleep. The actor's weights and
#                       optimizer state go to host memory while vLLM generates (gradients dropped), vLLM sleeps
#                       while the actor trains, and each node's actor ranks hand the weights to that node's
#                       engines through CUDA IPC.
# Memory per actor GPU (70.6B params; the first stage = 20 layers + embedding, 2.27B params per GPU):
# bf16 weights 4.5 GB + fp32 grads 9.1 GB + fp32 main params and Adam moments 27.2 GB ~ 41 GB, plus
# ~1.4 GB for a 5k-token packed micro-batch with SP and recompute (layer inputs 0.84 GB for the 4
# micro-batches in flight on the first stage). Peaks (python -m openrlhf_lpo.megatron.memory
# examples/model_configs/deepseek-r1-distill-llama-70b --tp 8 --pp 4 --dp 1 --sp): forward/backward
# 43.1 GB (CE / entropy temporaries 0.8 GB), optimizer step 50.0 GB (AdamW foreach sqrt(v) 9.1 GB), peak
# 53.0 GB with a 3 GB allowance for the CUDA context and NCCL buffers. See docs/megatron.md (memory table).
# Colocated, per GPU of the fullest node (python -m openrlhf_lpo.megatron.colocation_memory
# examples/model_configs/deepseek-r1-distill-llama-70b --tp 8 --pp 4 --dp 1 --sp --vllm-tp 4; lpo-train --dry-run
# prints every phase per node and stops a plan that does not fit): generation 71.5 GB (KV cache for up to ~381k
# tokens per engine), training 55.0 GB, weight sync 48.5 GB, checkpoint save 49.7 GB (the optimizer state is read
# from host memory). Host memory per node: up to 724.2 GB (actor host pools 254.3 GB, vLLM's sleep backups ~331 GB,
# checkpoint buffers, 6 GB per process); lpo-train stops a launch whose node has less than that / 0.95
# (--megatron.host_memory_gb).
# Old-log-prob forward: --rollout.micro_batch_size 16 = 4 x PP x micro-batch (configs/backends/megatron.sh),
# 16 micro-batches per pipeline schedule: efficiency 16/19 = 84.2% (it was 2/5 with chunks of 2); training
# windows of 1024 micro-batches: 99.7%. lpo-train --dry-run prints both.
# COLOCATE=0: the split layout on 8 nodes (NNODES=8 then): nodes A-D the actor (same peak), nodes E-H 8 vLLM
# engines x TP4; half the GPUs wait while the other half works in the synchronous loop.
# lpo-train checks this placement against the running Ray cluster before any actor starts and stops
# with a message naming the GPUs needed vs present. Alternative: MEGATRON_PP=2 NNODES=4 (DP=2,
# 53 GB static per GPU).
# Layout rules: actor GPUs % (tp*pp) == 0; 8 KV heads % tp == 0; 80 layers % pp == 0; tp | GPUs per node.
METHOD="${METHOD:-lpo_fwd}"
TASK=math_r1-distill-llama-70b
BACKEND=megatron
if [ "${COLOCATE:-}" = "0" ]; then  # the split layout: the actor on nodes A-D, 8 engines on nodes E-H
  NNODES="${NNODES:-8}"
  ACTOR_NODES="${ACTOR_NODES:-4}"
  ACTOR_GPUS="${ACTOR_GPUS:-8}"
  VLLM_ENGINES="${VLLM_ENGINES:-8}"
fi
NNODES="${NNODES:-4}"
MEGATRON_TP="${MEGATRON_TP:-8}"
MEGATRON_PP="${MEGATRON_PP:-4}"
MEGATRON_SP="${MEGATRON_SP:-1}"
VLLM_TP="${VLLM_TP:-4}"
# checkpoints of 0.8 TiB (fp32 params + Adam moments): once per episode (30 rollout batches), two kept (three
# at the peak, the new one is whole before the oldest goes) + HF exports: ~3.0 TiB, as --dry-run states
CKPT_SAVE_STEPS="${CKPT_SAVE_STEPS:-30}"
CKPT_MAX_NUM="${CKPT_MAX_NUM:-2}"
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"
