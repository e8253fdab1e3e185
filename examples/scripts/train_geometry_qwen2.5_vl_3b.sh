#!/usr/bin/env bash
# geometry_qwen2.5-vl-3b (Geometry3k, images) with the paper's settings (configs/common.sh +
# configs/tasks/geometry_qwen2.5-vl-3b.sh). Switch method with the one line below (or METHOD=... in the
# environment): lpo_fwd, lpo_rev, grpo, dr_grpo, maxrl, pointwise, lpo_{fwd,rev}_drgrpo, lpo_{fwd,rev}_maxrl.
# DeepSpeed only: the Megatron backend refuses vision-language models.
METHOD="${METHOD:-lpo_fwd}"
TASK=geometry_qwen2.5-vl-3b
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"
