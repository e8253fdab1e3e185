"""Time limits under load: a response stops at its first timeout in both reward modes, and the wall
clock does not count the time a program waits for a CPU, so a correct program near the CPU limit keeps
its reward on an oversubscribed machine."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from code_helpers import assert_pool_healthy
from openrlhf_lpo.rewards.code import grade_code

LOOPS_ON_2 = "```python\nx = int(input())\nwhile x == 2:\n    pass\nprint(x)\n```"
FOUR = {"inputs": ["1\n", "2\n", "3\n", "4\n"], "outputs": ["1", "2", "3", "4"]}


@pytest.mark.parametrize("stop_on_fail", [False, True], ids=["fraction", "all"])
def test_a_response_stops_at_its_first_timeout(box, stop_on_fail):
    stopped = box.stats["stopped"]
    t0 = time.monotonic()
    r = grade_code(LOOPS_ON_2, FOUR, sandbox=box, stop_on_fail=stop_on_fail)
    took = time.monotonic() - t0
    # test 0 passed, test 1 timed out, tests 2 and 3 never ran (they would have passed): 1 of 4
    assert (r.passed, r.total, r.status, r.detail) == (1, 4, "timeout", "test 1: time limit")
    assert r.reward("fraction") == 0.25 and r.reward("all") == 0.0
    assert box.stats["stopped"] == stopped + 1
    assert took < 3.0 + 3.0 + 6.0  # one wall limit at most (3 s), plus start-up on a loaded machine
    if not stop_on_fail:
        full = grade_code(LOOPS_ON_2, FOUR, sandbox=box, stop_on_timeout=False)  # the old behaviour, on request
        assert (full.passed, full.status) == (3, "timeout")
    assert_pool_healthy(box)


OVERSUBSCRIBED = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    from openrlhf_lpo.rewards.code import grade_code
    from openrlhf_lpo.rewards.sandbox import CodeSandbox, SandboxConfig
    os.sched_setaffinity(0, {0})  # this process, its sandboxes and the busy loops share one core
    boxes = {m: CodeSandbox(SandboxConfig(timeout_s=1.0, workers=1, wall_mode=m)) for m in ("unqueued", "elapsed")}
    for b in boxes.values():
        b.ensure_ready()
    # each in a session of its own: with autogroup scheduling, CPU time is shared per session
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(7)]
    time.sleep(0.3)
    near_limit = "```python\\nimport time\\nwhile time.process_time() < 0.5:\\n    pass\\nprint(input())\\n```"
    out = {}
    try:
        for m, b in boxes.items():
            t0 = time.monotonic()
            r = grade_code(near_limit, {"inputs": ["7\\n"], "outputs": ["7"]}, sandbox=b)
            out[m] = [r.status, round(time.monotonic() - t0, 2)]
    finally:
        for p in busy:
            p.kill()
            p.wait()
    print(json.dumps(out))
    """
)


def test_a_near_limit_program_keeps_its_reward_on_an_oversubscribed_core(repo_env):
    """One core shared by 8 runnable processes: a correct program needing 0.5 of its 1 CPU-second takes
    ~4 s of wall clock. The plain wall clock (3 s) times it out; the unqueued one (elapsed minus the
    time spent waiting for the CPU, /proc/<pid>/schedstat) lets it finish."""
    if not os.path.exists("/proc/self/schedstat"):
        pytest.skip("this kernel has no /proc/<pid>/schedstat (CONFIG_SCHED_INFO): the wall clock is elapsed time")
    out = subprocess.run([sys.executable, "-c", OVERSUBSCRIBED], capture_output=True, text=True, env=repo_env,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["elapsed"][0] == "timeout", got  # the old wall clock: its reward depends on load
    assert got["unqueued"][0] == "ok" and got["unqueued"][1] > 3.0, got  # passed after more than 3 s
