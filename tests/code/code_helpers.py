"""Helpers of the code-reward tests: a leftover-process scanner and the pool health check."""

import os
import time
from pathlib import Path

from openrlhf_lpo.rewards.code import grade_code
from openrlhf_lpo.rewards.sandbox import CodeSandbox

REPO = Path(__file__).resolve().parents[2]
MARKER = b"LPO_SANDBOX_RUNNER"  # first line of the runner source: in the argv of every sandbox process
CORRECT = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
SUM_TESTS = {"inputs": ["1 2\n", "40 2\n"], "outputs": ["3\n", "42\n"]}


def sandbox_processes() -> list[int]:
    """PIDs of live processes (any user) that belong to a sandbox: bwrap, the runner, program children."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if MARKER in cmd and state != b"Z":
            pids.append(int(entry))
    return pids


def wait_no_sandbox_processes(timeout: float = 5.0) -> list[int]:
    """Wait (the kernel tears a PID namespace down asynchronously) until no sandbox process is left."""
    deadline = time.monotonic() + timeout
    while True:
        left = sandbox_processes()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def assert_pool_healthy(box: CodeSandbox) -> None:
    """The pool kept working: no slot leaked, a correct program still passes, nothing left running."""
    assert box.stats["in_flight"] == 0
    assert box.free_slots() == len(box.slots) == box.config.n_workers(), "a sandbox slot leaked"
    result = grade_code(CORRECT, SUM_TESTS, sandbox=box)
    assert (result.passed, result.total, result.status) == (2, 2, "ok")
    assert wait_no_sandbox_processes() == []
