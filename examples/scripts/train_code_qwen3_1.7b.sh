#!/usr/bin/env bash
# code_qwen3-1.7b (PRIME code) with the paper's settings (configs/common.sh + configs/tasks/code_qwen3-1.7b.sh).
# Switch method with the one line below (or METHOD=... in the environment): lpo_fwd, lpo_rev,
# grpo, dr_grpo, maxrl, pointwise, lpo_{fwd,rev}_drgrpo, lpo_{fwd,rev}_maxrl (configs/methods/).
# Programs run in the bubblewrap sandbox: each engine refuses to start where it cannot (docs/code.md).
METHOD="${METHOD:-lpo_fwd}"
TASK=code_qwen3-1.7b
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"
