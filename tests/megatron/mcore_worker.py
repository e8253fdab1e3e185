"""One rank of the shared Megatron gloo world; launched by the tests (``conftest.launch_world``).

Usage: python mcore_worker.py RANK WORLD PORT OUT_DIR

The rank joins the gloo world and runs the named checks of ``mcore_checks/`` in their fixed order
(``mcore_checks.ORDER``; the runner: ``mcore_checks/runner.py``). It writes OUT_DIR/rank{RANK}.json after
every check: the measured numbers (``checks``) and each check's outcome (``status``); the pytest side
asserts. A check that raises fails alone and the later ones still run. The references are independent
of megatron (``mcore_checks/references.py``).
"""

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mcore_checks import runner  # noqa: E402  (imports nothing heavy: the rank joins the world first)

if __name__ == "__main__":
    sys.exit(runner.main(sys.argv[1:]))
