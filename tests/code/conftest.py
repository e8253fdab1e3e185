"""Fixtures of the code-reward tests: a real bubblewrap sandbox pool (helpers in code_helpers.py)."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from code_helpers import REPO  # noqa: E402
from openrlhf_lpo.rewards.sandbox import CodeSandbox, SandboxConfig  # noqa: E402


@pytest.fixture(scope="session")
def box() -> CodeSandbox:
    """One real bubblewrap pool for the session: 1 CPU-second per test (wall clock 3 s), 2 slots."""
    sandbox = CodeSandbox(SandboxConfig(timeout_s=1.0, workers=2))
    sandbox.ensure_ready()
    return sandbox


@pytest.fixture
def repo_env():
    """Environment for subprocesses: the repository importable, one thread each, no LPO_CODE_* overrides."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LPO_CODE_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env
