"""Runs the world's checks in order, each isolated from the others.

For each check: its status is written as started (a rank that hangs or is killed leaves that trace), the
check runs, its numbers go to the record's ``checks`` and its outcome to ``status[name] = {"ok", "error"
(the traceback), "seconds"}``, and the record is written again (atomically). Then every rank meets at
``torch.distributed.monitored_barrier`` (on a gloo group of the runner's own, whose messages cannot meet
those of an unfinished collective): a rank that raised in the middle of a check may have left the others
inside a collective. If the barrier fails the world is broken: the rank records where
(``world_broken``), marks the checks left as not run, writes its record and exits at once, which also ends
the collectives its peers wait in, so they record the same and exit too.

Environment (every rank):

* ``MCORE_WORKER_SUITE``: ``all`` (the default: :data:`ORDER`) or ``only:a,b`` (those checks, in that order);
* ``MCORE_WORKER_FAIL=name[,name2]``: each named check raises at its start, on every rank; ``name@R`` on
  rank R alone (its peers then wait in the check's collectives: a broken world);
* ``MCORE_WORKER_BARRIER_S``: how long the barrier after a check waits for the slowest rank (300 s);
* ``MCORE_WORKER_STACKS=N``: every rank dumps its stack and exits after N seconds (debugging a hang).
"""

import datetime
import faulthandler
import importlib
import os
import time
import traceback

from . import MODULES, ORDER
from . import world as W
from .registry import CHECKS

NOT_FINISHED = "started, did not finish (the rank hung or was killed)"


def selected(suite: str) -> list:
    """The checks a suite names, validated against :data:`ORDER`."""
    if suite == "all":
        return list(ORDER)
    if suite.startswith("only:"):
        names = [n for n in suite[len("only:"):].split(",") if n]
        unknown = [n for n in names if n not in ORDER]
        if unknown or not names:
            raise ValueError(f"MCORE_WORKER_SUITE={suite}: unknown check(s) {unknown}; valid: {', '.join(ORDER)}")
        return names
    raise ValueError(f"MCORE_WORKER_SUITE={suite}: expected 'all' or 'only:<check>,<check>'")


def planted_failure(name: str) -> None:
    """``MCORE_WORKER_FAIL``: make the check ``name`` raise at its start (development and the isolation test)."""
    for item in filter(None, os.environ.get("MCORE_WORKER_FAIL", "").split(",")):
        target, _, rank = item.partition("@")
        if target == name and (not rank or int(rank) == W.RANK):
            raise RuntimeError(f"planted failure (MCORE_WORKER_FAIL={item}) at the start of check {name!r}")


def run_one(name: str) -> None:
    """Run the check ``name`` and record its numbers and its outcome (never raises)."""
    record, status = W.RECORD, W.RECORD["status"]
    status[name] = {"ok": False, "error": NOT_FINISHED, "seconds": None}
    W.write_record()
    W.log(f"check {name}")
    t = time.time()
    try:
        planted_failure(name)
        out = CHECKS[name]() or {}
        taken = sorted(set(out) & set(record["checks"]))
        if taken:
            raise RuntimeError(f"check {name!r} returned record keys another check wrote: {taken}")
        record["checks"].update(out)
        status[name] = {"ok": True, "error": None, "seconds": round(time.time() - t, 1)}
    except (Exception, SystemExit):  # SystemExit: a flag parser's error inside a check is that check's failure
        status[name] = {"ok": False, "error": traceback.format_exc(), "seconds": round(time.time() - t, 1)}
    W.log(f"check {name}: {'ok' if status[name]['ok'] else 'FAILED'} ({status[name]['seconds']} s)")
    W.write_record()


def barrier_error(timeout_s: float):
    """None if every rank reaches this point within ``timeout_s`` (gloo's monitored barrier on the runner's
    own group, whose timeout is ``timeout_s`` too: the ranks other than 0 wait for rank 0 that long), else
    the error."""
    import torch.distributed as dist

    try:
        dist.monitored_barrier(group=W.BARRIER_GROUP, timeout=datetime.timedelta(seconds=timeout_s),
                               wait_all_ranks=True)
        return None
    except Exception:
        return traceback.format_exc()


def run(names: list, timeout_s: float) -> bool:
    """Run ``names`` in order; False if the world broke (the checks left are then marked not run)."""
    for i, name in enumerate(names):
        run_one(name)
        error = barrier_error(timeout_s)
        if error is not None:
            W.RECORD["world_broken"] = {"after": name, "error": error}
            for rest in names[i + 1:]:
                W.RECORD["status"][rest] = {"ok": False, "error": f"not run: world broken after {name}",
                                            "seconds": None}
            W.log(f"world broken after {name}: {len(names) - i - 1} check(s) not run")
            return False
    return True


def main(argv: list) -> int:
    """``RANK WORLD PORT OUT_DIR``: join the world, run the checks, write the record, leave the world."""
    rank, world, port, out = int(argv[0]), int(argv[1]), argv[2], argv[3]
    W.join(rank, world, port, out)
    import torch.distributed as dist

    timeout_s = float(os.environ.get("MCORE_WORKER_BARRIER_S", "300"))
    W.BARRIER_GROUP = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

    if os.environ.get("MCORE_WORKER_STACKS"):
        faulthandler.dump_traceback_later(int(os.environ["MCORE_WORKER_STACKS"]), exit=True)
    try:
        names = selected(os.environ.get("MCORE_WORKER_SUITE", "all"))
        for module in MODULES:
            importlib.import_module(f"{__package__}.{module}")
        if set(CHECKS) != set(ORDER):
            raise RuntimeError(f"registered checks differ from ORDER: {sorted(set(CHECKS) ^ set(ORDER))}")
        from . import census

        census.install()  # counts every collective from here on
    except Exception:
        W.RECORD["error"] = traceback.format_exc()
        W.write_record()
        os._exit(1)
    intact = run(names, timeout_s)
    W.RECORD["ok"] = all(W.RECORD["status"][n]["ok"] for n in names)
    W.RECORD["seconds"] = time.time() - W.T0
    W.write_record()
    if not intact:
        os._exit(1)  # the peers may sit in a collective: no clean exit from the process group
    dist.barrier()
    dist.destroy_process_group()
    return 0 if W.RECORD["ok"] else 1
