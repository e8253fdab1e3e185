#!/usr/bin/env bash
# GPU smoke test of the Megatron-core actor (--backend megatron): a tiny offline Qwen3, a few LPO
# steps in fp32 and bf16 on one GPU (Transformer Engine layer spec when TE is installed), checked
# against HF. Prints one JSON line per dtype; exit status 0 when every check passes.
#   bash examples/scripts/gpu_smoke_megatron.sh            # 1 GPU, TP=1
#   NPROC=2 TP=2 bash examples/scripts/gpu_smoke_megatron.sh   # 2 GPUs, TP=2
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-${PY:-}}"
source "$ROOT/examples/scripts/lib/python.sh"
NPROC=${NPROC:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
if [ "${LPO_DRY_RUN:-0}" = "1" ]; then  # what would run, on how many GPUs
  echo "gpu_smoke_megatron.sh --dry-run: GPUs needed: $NPROC (torchrun, TP=${TP:-1} PP=${PP:-1}, dtypes ${DTYPES:-fp32,bf16})"
  exit 0
fi
exec "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" \
  -m openrlhf_lpo.checks.megatron_smoke --steps "${STEPS:-3}" --tp "${TP:-1}" --pp "${PP:-1}" --dtypes "${DTYPES:-fp32,bf16}"
