#!/usr/bin/env bash
# math_qwen3-14b on the Megatron-core actor: TP=8 x PP=1 per replica, 2 nodes x 8 actor GPUs -> DP=2,
# plus 4 vLLM engines x TP2 on GPUs of their own. Alternative: MEGATRON_TP=4 MEGATRON_PP=2.
# Layout rules (checked before anything starts): actor GPUs % (tp*pp) == 0; 8 KV heads % tp == 0;
# 40 layers % pp == 0. Switch method with the one line below (configs/methods/).
METHOD="${METHOD:-lpo_fwd}"
TASK=math_qwen3-14b
BACKEND=megatron
MEGATRON_TP="${MEGATRON_TP:-8}"
MEGATRON_PP="${MEGATRON_PP:-1}"
NNODES="${NNODES:-2}"
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"
