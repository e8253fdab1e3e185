"""The hang-safe pool: hard timeouts (Math-Verify #65), threads, fork, crashed workers, statuses."""

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from openrlhf_lpo.rewards import grading
from openrlhf_lpo.rewards.grading import GraderPool, GradeResult, grade_math, grade_math_batch

HANG = "\\boxed{\\dfrac{5^{(5^{(5^{(5^5)})}-4)}-5}{16}}"  # Math-Verify #65: parse never returns


def test_issue65_input_times_out_within_limit_and_pool_keeps_working():
    with GraderPool(workers=1, timeout=2.0) as pool:
        assert pool.grade([("math", "\\boxed{1}", "1")]) == [GradeResult(True, "ok", "1")]  # warm worker
        t = time.monotonic()
        res = pool.grade([("math_full", HANG, "1")])
        elapsed = time.monotonic() - t
        assert res == [GradeResult(False, "timeout", None)]
        assert elapsed < 2.0 + 2.0, elapsed
        assert pool.stats["timeouts"] == 1
        # the killed worker was replaced; items around a hang in one batch are all graded
        res = pool.grade([("math", "\\boxed{3}", "3"), ("math_full", HANG, "1"), ("math_full", "x = \\boxed{4}", "4")],
                         timeout=8.0)  # generous: a fresh worker's first items may be slow on a busy machine
        assert [r.status for r in res] == ["ok", "timeout", "ok"]
        assert [r.correct for r in res] == [True, False, True]


def test_shared_grade_math_from_threads():
    grading.shutdown_shared_pool()
    items = [(f"so \\boxed{{{i}}}", str(i)) for i in range(12)] + [(f"\\boxed{{{i + 1}}}", str(i)) for i in range(12)]
    expected = [True] * 12 + [False] * 12
    with ThreadPoolExecutor(max_workers=6) as ex:
        got = list(ex.map(lambda it: grade_math(*it), items))
    assert [r.correct for r in got] == expected
    assert all(r.status == "ok" for r in got)
    # math-verify's own signal timeout cannot run in a thread; our grader does not use it
    errors, verdicts = [], []

    def call():
        try:
            verdicts.append(grade_math("\\boxed{\\frac12}", "0.5").correct)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    th = threading.Thread(target=call)
    th.start()
    th.join(60)
    assert not th.is_alive(), "grade_math called from a thread did not return within 60 s"
    assert not errors and verdicts == [True]


def test_grade_math_in_forked_child_gets_its_own_pool():
    assert grade_math("\\boxed{2}", "2").correct  # parent pool is up
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            ok = grade_math("\\boxed{7}", "7").correct and not grade_math("\\boxed{8}", "7").correct
            os.write(w, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1"
    assert grade_math("\\boxed{5}", "5").correct  # parent pool untouched by the child


def test_crashed_worker_reports_error_and_the_rest_is_graded():
    with GraderPool(workers=1, timeout=30.0, chunk_size=4) as pool:
        pool.grade([("math", "\\boxed{1}", "1")])
        (w,) = list(pool._live)
        killer = threading.Timer(1.0, lambda: os.kill(w.pid, signal.SIGKILL))
        killer.start()
        res = pool.grade([("math_full", HANG, "1"), ("math", "\\boxed{2}", "2"), ("math", "\\boxed{3}", "4")])
        killer.join()
        assert [(r.correct, r.status) for r in res] == [(False, "error"), (True, "ok"), (False, "ok")]
        assert pool.stats["crashes"] == 1


def test_statuses_think_blocks_and_validation():
    res = grade_math_batch(
        ["<think>maybe \\boxed{200}</think> so \\boxed{204}", "<think> long reasoning \\boxed{204}", "no math here", "\\boxed{5}"],
        ["204", "204", "204", ""],
    )
    assert [(r.correct, r.status) for r in res] == [(True, "ok"), (False, "no_answer"), (False, "no_answer"), (False, "error")]
    with pytest.raises(ValueError, match="response"):
        grade_math(None, "1")
    with pytest.raises(ValueError, match="timeout"):
        grade_math("\\boxed{1}", "1", timeout=0)
    with pytest.raises(ValueError, match="same length"):
        grade_math_batch(["a"], [])
