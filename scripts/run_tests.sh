#!/usr/bin/env bash
# The project's test command (README quick start, CI). Extra arguments go to pytest.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${LPO_VENV:-$ROOT/.venv}"
export LPO_BENCHMARKS_DIR="${LPO_BENCHMARKS_DIR:-$ROOT/../shared/benchmarks}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
export TOKENIZERS_PARALLELISM=false
"$VENV/bin/python" -m pytest -q --timeout=1800 --durations=30 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
