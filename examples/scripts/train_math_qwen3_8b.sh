#!/usr/bin/env bash
# math_qwen3-8b with the paper's settings (configs/common.sh + configs/tasks/math_qwen3-8b.sh).
# Switch method with the one line below (or METHOD=... in the environment): lpo_fwd, lpo_rev,
# grpo, dr_grpo, maxrl, pointwise, lpo_{fwd,rev}_drgrpo, lpo_{fwd,rev}_maxrl (configs/methods/).
METHOD="${METHOD:-lpo_fwd}"
TASK=math_qwen3-8b
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"
