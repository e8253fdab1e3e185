"""The shared Megatron world's runner (``mcore_checks/runner.py``) isolates its checks, shown on a world of
its own: 2 gloo ranks running two cheap checks (``nodes``: one collective; ``census``: none), with
``MCORE_WORKER_FAIL`` planting the failure. Not the shared world: these tests cost a world start each.

* A check that raises (on every rank) is recorded failed with its traceback, and the next check still
  runs and is recorded ok; a test that reads the failed check fails naming it.
* A check that raises on one rank while the other waits in the check's collective breaks the world: the
  barrier after the check fails, both ranks record where, mark the checks left as not run, and exit in
  seconds rather than at the launch's timeout.
"""

import time

import pytest

from .mcore_records import launch_world, world_checks

pytestmark = pytest.mark.e2e  # a gloo world of its own (2 ranks, seconds of work after the imports)

SUITE = "only:nodes,census"


def test_a_failing_check_fails_alone_and_the_next_one_runs(tmp_path):
    world = launch_world(tmp_path, world=2, suite=SUITE, timeout=300, env={"MCORE_WORKER_FAIL": "nodes"})
    assert [rec["rank"] for rec in world] == [0, 1]
    for rec in world:
        assert list(rec["status"]) == ["nodes", "census"] and "world_broken" not in rec, rec["status"]
        failed, ran = rec["status"]["nodes"], rec["status"]["census"]
        assert failed["ok"] is False and failed["seconds"] is not None
        assert failed["error"].startswith("Traceback (most recent call last):")
        assert "RuntimeError: planted failure (MCORE_WORKER_FAIL=nodes) at the start of check 'nodes'" in failed["error"]
        assert ran == {"ok": True, "error": None, "seconds": ran["seconds"]} and ran["seconds"] >= 0
        assert "nodes" not in rec["checks"]  # a failed check leaves no numbers
        assert rec["checks"]["groups"]["live"] >= 1 and rec["checks"]["collectives"]["mismatches"] == []
    # the pytest side: a test of the failed check fails naming it, on which ranks, with its traceback;
    # a test of the other check reads its numbers
    with pytest.raises(AssertionError) as failure:
        world_checks(world, "nodes")
    message = str(failure.value)
    assert message.startswith("check 'nodes' on rank(s) [0, 1]: Traceback (most recent call last):")
    assert "planted failure" in message
    assert [checks["groups"] for checks in world_checks(world, "census")] == [rec["checks"]["groups"] for rec in world]


def test_a_rank_failing_inside_a_collective_breaks_the_world_cleanly(tmp_path):
    start = time.time()
    world = launch_world(tmp_path, world=2, suite=SUITE, timeout=300,
                         env={"MCORE_WORKER_FAIL": "nodes@1", "MCORE_WORKER_BARRIER_S": "4"})
    took = time.time() - start
    for rec in world:
        assert rec["world_broken"]["after"] == "nodes", rec.get("world_broken")
        assert rec["status"]["nodes"]["ok"] is False
        assert rec["status"]["census"] == {"ok": False, "error": "not run: world broken after nodes", "seconds": None}
        assert "seconds" in rec  # the record was finished, not left at the last check
    # rank 1 raised at the start; rank 0 was left in the check's all-gather, which failed when rank 1 left
    assert "planted failure (MCORE_WORKER_FAIL=nodes@1)" in world[1]["status"]["nodes"]["error"]
    assert "planted failure" not in world[0]["status"]["nodes"]["error"]
    assert took < 240, took  # the ranks exit by themselves (the launch would kill them at 300 s)
