#!/usr/bin/env bash
# math_qwen3-8b in OpenRLHF's async recipe family (configs/families/async.sh) with the paper's settings.
# Cluster: 1 node x 8 GPUs (actor on 4, vLLM engines on 4).
# Switch method with the one line below (or METHOD=... in the environment): lpo_fwd, lpo_rev,
# grpo, dr_grpo, maxrl, pointwise, lpo_{fwd,rev}_drgrpo, lpo_{fwd,rev}_maxrl (configs/methods/).
METHOD="${METHOD:-lpo_fwd}"
TASK=math_qwen3-8b
FAMILY=async
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"
