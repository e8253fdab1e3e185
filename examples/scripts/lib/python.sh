# Sourced by the example scripts: PY = the Python that has the project installed.
# Order: $PYTHON, then the venv the README's install made ($ROOT/.venv), then python3 on PATH.
# Needs ROOT (the repository root). Fails with what to do when that Python lacks the project.
if [ -n "${PYTHON:-}" ]; then
  PY="$PYTHON"
elif [ -x "$ROOT/.venv/bin/python" ]; then
  PY="$ROOT/.venv/bin/python"
else
  PY=python3
fi
# find_spec, not import: the check costs a Python start, not the seconds of importing torch and openrlhf
if ! "$PY" -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in ('torch', 'openrlhf', 'openrlhf_lpo')))" 2>/dev/null; then
  echo "$(basename "$0"): $PY cannot import torch, openrlhf and openrlhf_lpo." >&2
  echo "  Install them with: bash $ROOT/scripts/setup_env.sh   (a venv in $ROOT/.venv, used automatically)" >&2
  echo "  or point PYTHON=/path/to/python at an environment that has them." >&2
  exit 2
fi
