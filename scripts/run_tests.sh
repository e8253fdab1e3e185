#!/usr/bin/env bash
# The project's test command (README quick start, CI). Extra arguments go to pytest.
#   bash scripts/run_tests.sh            the whole suite (every promise, end-to-end runs included)
#   bash scripts/run_tests.sh --quick    the unit-level tier: every test not marked e2e (docs/testing.md)
# Tests run in LPO_TEST_WORKERS pytest-xdist processes (default 2; 0 runs them in this process), each module
# (or group of modules sharing a heavy session fixture) on one worker: tests/conftest.py.
# It ends with one line: the wall time and the number of tests that ran (LPO_TEST_REPORT=FILE keeps the JUnit XML).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${LPO_VENV:-$ROOT/.venv}"
export LPO_BENCHMARKS_DIR="${LPO_BENCHMARKS_DIR:-$ROOT/../shared/benchmarks}"
export TOKENIZERS_PARALLELISM=false
TIER=full
ARGS=()
for a in "$@"; do
  if [ "$a" = "--quick" ]; then TIER=quick; else ARGS+=("$a"); fi
done
[ "$TIER" = quick ] && ARGS=(-m "not e2e" "${ARGS[@]}")
WORKERS="${LPO_TEST_WORKERS:-2}"
[ "$WORKERS" = 0 ] || ARGS=(-n "$WORKERS" "${ARGS[@]}")
# one torch thread per worker process when the workers share the cores
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$([ "$WORKERS" -ge 2 ] && echo 1 || echo 2)}"
REPORT="$(mktemp -t lpo-tests-XXXXXX.xml)"
T0=$(date +%s)
# --timeout-method=thread: a test stuck where Python's signal handler cannot reach it (a ray.get that waits on
# resources nobody frees) is dumped and its worker killed; xdist reports it and starts a new worker
"$VENV/bin/python" -m pytest -q --timeout=1800 --timeout-method=thread --durations=30 --junitxml="$REPORT" "${ARGS[@]}"
rc=$?
WALL=$(( $(date +%s) - T0 ))
COUNT=$("$VENV/bin/python" - "$REPORT" <<'EOF' 2>/dev/null
import sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (ET.ParseError, OSError):
    print("no report"); raise SystemExit
suites = [root] if root.tag == "testsuite" else list(root)
n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
print(f"{n['tests']} tests ({n['failures']} failed, {n['errors']} errors, {n['skipped']} skipped)")
EOF
)
if [ -n "${LPO_TEST_REPORT:-}" ]; then cp "$REPORT" "$LPO_TEST_REPORT"; fi  # the JUnit XML, per-test times
rm -f "$REPORT"
printf '[run_tests] %s tier: %s in %dm%02ds wall\n' "$TIER" "$COUNT" $((WALL / 60)) $((WALL % 60))
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
