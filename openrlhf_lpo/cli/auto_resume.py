"""``lpo-train --ckpt.auto_resume N``: the run supervises itself and restarts after a preemption.

With N > 0, ``lpo-train`` checks the flags and inputs once, then runs the training as a child process
(``python -m openrlhf_lpo.cli.train_ppo_ray`` with the same flags, in its own process group) and waits:

* exit 0: done;
* a final cause, never restarted (:data:`FINAL_EXIT`): exit 2 (a flag or input error, a ``--ckpt.path`` that
  the nodes do not share), 3 (a GPU node cannot build DeepSpeed's optimizer op: an install error,
  ``cli/gpu_build.py``), 4 (reward errors persisted), 5 (the cluster lacks the GPUs the layout needs: at the
  first attempt, or still after ``--ckpt.auto_resume_wait`` on a restart, ``cli/capacity.py``);
* anything else (a Ray worker, a node or the driver died: ``ActorDiedError``, a signal): the child's whole
  process group is killed, the last complete checkpoint is chosen
  (:func:`openrlhf_lpo.cli.preflight.checkpoint.resume_point`: ``latest`` is repaired if a kill cut a save
  off), and the run restarts with ``--ckpt.load_enable`` after ``--ckpt.auto_resume_delay`` seconds. Each
  restart is logged with its cause and the checkpoint it loads.

A restart first waits, up to ``--ckpt.auto_resume_wait`` seconds, until the cluster again has the GPUs the
layout needs and they are free (a lost node back, the dead attempt's GPUs and their memory released:
:func:`openrlhf_lpo.cli.capacity.check_or_wait`, in the restarted child). Waiting is not a failure: only an
attempt that dies counts against N. What a restart must not decide again from the cluster it finds is decided
once by the supervisor and given to every attempt in its environment (:func:`register_child_env`; the CPU
mode: a GPU-less driver whose GPU nodes are all lost would otherwise restart on CPUs).

N bounds the restarts in a row from one checkpoint: a restart that gets the run to a newer checkpoint resets
the count, so a week-long run survives any number of preemptions while it makes progress, and a failure
that repeats at the same step (a bug, bad data) stops the run after N restarts, naming the cause, instead of
looping.

What it cannot survive: the supervisor's own death (run it under the cluster's job scheduler with its
restart policy, which then resumes through ``--ckpt.load_enable``), and a hang that raises no error (the
collectives' timeouts turn most into errors). docs/pipeline.md has the table.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, Optional, Sequence, TextIO, Tuple

from openrlhf_lpo.registry import register_unique

SUPERVISED_ENV = "LPO_AUTO_RESUME_ATTEMPT"  # set in the child: the attempt number (1, 2, ...)
# exit statuses that are no preemption (the numbers of cli/gpu_build.py, rewards, cli/capacity.py)
FINAL_EXIT = {2: "a flag or input error", 3: "a GPU node cannot build DeepSpeed's optimizer op (an install error)",
              4: "reward errors persisted (--reward.error_stop_frac)",
              5: "the Ray cluster lacks the GPUs the layout needs (--ckpt.auto_resume_wait passed on a restart)"}
TAIL_LINES = 400
# "SomeError: message" or "ray.exceptions.ActorDiedError: message" at the start of a line
_EXCEPTION_LINE = re.compile(r"^(?:\(\S+\)\s+)?([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Died|Exit))\b(:.*)?$")
PREFIX = "lpo-train auto-resume:"

# name -> fn(args) -> (environment variables every attempt gets, a line for the log or None): a decision the
# supervisor makes once for the whole run, so that a restart into a changed cluster does not make it otherwise
# (cpu/mode.py pins the CPU mode: a GPU-less driver whose GPU nodes are all lost must not restart on CPU)
ChildEnv = Callable[[argparse.Namespace], Tuple[Dict[str, str], Optional[str]]]
CHILD_ENV: Dict[str, ChildEnv] = {}


def register_child_env(name: str, fn: ChildEnv) -> ChildEnv:
    return register_unique(CHILD_ENV, "auto-resume child environment", name, fn)


def child_env(args: argparse.Namespace, log: Callable[[str], None]) -> Dict[str, str]:
    """The registered decisions (:data:`CHILD_ENV`) for every attempt of this run, each logged."""
    env: Dict[str, str] = {}
    for name in sorted(CHILD_ENV):
        values, line = CHILD_ENV[name](args)
        env.update(values)
        if line:
            log(line)
    return env


def is_supervised() -> bool:
    """True in a child this supervisor started (it trains; it never supervises)."""
    return bool(os.environ.get(SUPERVISED_ENV))


def failure_cause(returncode: int, tail: Sequence[str]) -> str:
    """A one-line cause of a child's death: the signal that killed it, else its last exception line."""
    if returncode < 0 or (128 < returncode < 128 + 65 and returncode - 128 in _signal_numbers()):
        num = -returncode if returncode < 0 else returncode - 128
        return f"killed by {signal.Signals(num).name}"
    last = None
    for line in tail:
        m = _EXCEPTION_LINE.match(line.strip())
        if m:
            last = (m.group(1) + (m.group(2) or "")).strip()
    where = f"exit {returncode}"
    return f"{where}: {last[:300]}" if last else f"{where} (no exception in the last {len(tail)} lines of output)"


def _signal_numbers():
    return {int(s) for s in signal.Signals}


@dataclass
class Attempt:
    number: int
    returncode: int
    cause: str
    resumed_from: Optional[str]   # the checkpoint it loaded (None: step 0)
    reached: Optional[str]        # the last complete checkpoint after it ended


def _pump(stream, sink: TextIO, tail: Deque[str], lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        text = raw.decode("utf-8", errors="replace")
        with lock:
            tail.append(text.rstrip("\n"))
        try:
            sink.write(text)
            sink.flush()
        except (OSError, ValueError):
            pass
    stream.close()


def _die_with_parent() -> None:
    """In the child, before exec: the kernel SIGKILLs it when the supervisor dies (Linux; a no-op elsewhere),
    so a supervisor killed outright (a cancelled job) leaves no orphaned training behind."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Supervisor:
    """Runs ``command`` (the training) until it succeeds, restarting it after a failure (module docstring)."""

    def __init__(self, command: List[str], args: argparse.Namespace, env: Optional[dict] = None,
                 out: TextIO = None, err: TextIO = None):
        self.command = list(command)
        self.args = args
        self.max_restarts = int(args.ckpt.auto_resume)
        self.delay = float(args.ckpt.auto_resume_delay)
        self.env = dict(os.environ if env is None else env)
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.attempts: List[Attempt] = []
        self._child: Optional[subprocess.Popen] = None
        self._stopping: Optional[int] = None

    def log(self, text: str) -> None:
        print(f"{PREFIX} {text}", file=self.err, flush=True)

    def _resume_point(self):
        from openrlhf_lpo.cli.preflight.checkpoint import resume_point

        return resume_point(self.args, repair=True)

    def _run_once(self, number: int, argv: List[str]) -> tuple:
        env = dict(self.env, **{SUPERVISED_ENV: str(number)})
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, preexec_fn=_die_with_parent)
        self._child = proc
        self.log(f"attempt {number}: pid {proc.pid}")
        tail: Deque[str] = collections.deque(maxlen=TAIL_LINES)
        lock = threading.Lock()
        pumps = [threading.Thread(target=_pump, args=(proc.stdout, self.out, tail, lock), daemon=True),
                 threading.Thread(target=_pump, args=(proc.stderr, self.err, tail, lock), daemon=True)]
        for t in pumps:
            t.start()
        rc = proc.wait()
        _kill_group(proc.pid)  # what the run left behind (its local Ray, engine processes) dies with it
        for t in pumps:
            t.join(timeout=10)
        self._child = None
        with lock:
            return rc, list(tail)

    def _forward(self, signum, _frame) -> None:
        self._stopping = signum
        child = self._child
        if child is not None:
            try:
                os.killpg(child.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def run(self) -> int:
        """Supervise until the run succeeds or stops for good; returns the exit status for ``lpo-train``."""
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s in previous:
            signal.signal(s, self._forward)
        try:
            return self._loop()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _loop(self) -> int:
        fails_here, last_reached = 0, object()
        start = self._resume_point() if self.args.ckpt.load_enable else None
        loaded = start.tag if start is not None else None
        argv = list(self.command)
        number = 0
        while True:
            number += 1
            rc, tail = self._run_once(number, argv)
            if rc == 0:
                restarts = number - 1
                self.log(f"the run finished after {restarts} restart{'s' if restarts != 1 else ''}")
                return 0
            cause = failure_cause(rc, tail)
            if self._stopping is not None:
                self.log(f"stopped by {signal.Signals(self._stopping).name}: not restarted ({cause})")
                return rc if rc > 0 else 128 + self._stopping
            point = self._resume_point()
            self.attempts.append(Attempt(number, rc, cause, loaded, point.tag))
            if rc in FINAL_EXIT:
                self.log(f"attempt {number} stopped with exit {rc}, {FINAL_EXIT[rc]}: not a preemption, "
                         "not restarted")
                return rc
            fails_here = fails_here + 1 if point.tag == last_reached else 1
            last_reached = point.tag
            where = point.tag or "step 0 (no complete checkpoint yet)"
            if fails_here > self.max_restarts:
                self.log(f"giving up: {fails_here} attempts in a row failed from {where} "
                         f"(--ckpt.auto_resume {self.max_restarts} allows {self.max_restarts} restarts from one "
                         f"checkpoint); last cause: {cause}")
                return rc if rc > 0 else 1
            if point.note:
                self.log(point.note)
            self.log(f"attempt {number} died ({cause}); restart {fails_here}/{self.max_restarts} from {where}"
                     + (f" in {self.delay:g} s" if self.delay else ""))
            if self.delay:
                time.sleep(self.delay)
            if "--ckpt.load_enable" not in argv:
                argv.append("--ckpt.load_enable")
            loaded = point.tag


def repair_before_preflight(args: argparse.Namespace) -> Optional[str]:
    """A relaunch with ``--ckpt.auto_resume`` and ``--ckpt.load_enable`` (the recipes' rerun after a lost
    supervisor): point ``latest`` at the last whole checkpoint before the preflight reads it, so a save cut off
    by the kill neither stops the relaunch nor gets loaded. Returns what was repaired, or None."""
    if not (getattr(args.ckpt, "auto_resume", 0) and args.ckpt.load_enable) or is_supervised():
        return None
    from openrlhf_lpo.cli.preflight.checkpoint import resume_point

    return resume_point(args, repair=True).note


def child_command(argv: Sequence[str]) -> List[str]:
    """The training child's command line: this interpreter, the same entry point, the same flags."""
    return [sys.executable, "-m", "openrlhf_lpo.cli.train_ppo_ray", *argv]


def supervise(argv: Sequence[str], args: argparse.Namespace) -> int:
    """``lpo-train``'s supervisor mode (``--ckpt.auto_resume N > 0``): returns the exit status."""
    sup = Supervisor(child_command(argv), args)
    sup.env.update(child_env(args, sup.log))
    sup.log(f"up to {sup.max_restarts} restarts in a row from one checkpoint (--ckpt.auto_resume); checkpoints "
            f"every {args.ckpt.save_steps} steps in {os.path.join(args.ckpt.path, '_actor')}")
    return sup.run()


def plan_line(args: argparse.Namespace) -> Optional[str]:
    """The dry run's line about auto-resume (None when it is off)."""
    n = getattr(args.ckpt, "auto_resume", 0)
    if not n:
        return None
    return (f"auto-resume: a run that dies (lost Ray worker, node or driver) restarts from its last complete "
            f"checkpoint (every {args.ckpt.save_steps} steps, {args.ckpt.max_num} kept), up to {n} times in a row "
            f"from one checkpoint, {args.ckpt.auto_resume_delay:g} s apart; a restart waits up to "
            f"{args.ckpt.auto_resume_wait:g} s for the GPUs of a lost node (not counted as a failure)")
