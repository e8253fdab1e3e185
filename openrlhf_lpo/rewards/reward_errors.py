"""Rewards that could not be computed: counted, explained, and fatal only when they persist.

A sample whose reward raised (the sandbox's ``Popen`` hit EAGAIN/EMFILE, the grader pool did not
start, the label names an unknown task, a task's reward raised) or whose task reported status
``error`` (the code sandbox died or exited early) gets reward 0 and status ``error``; the reward file
logs it per sample as ``reward/error_frac`` (0 or 1; OpenRLHF averages it into the step's metrics).
One such sample never ends a run. The trainer, which sees every sample of every rollout batch from
all engines, keeps a window of the last ``--reward.error_window`` samples (default 256) and stops
the run, naming the causes, once more than ``--reward.error_stop_frac`` of them (default 0.5) are
errors. The reward processes see only their own share of the samples, so they report causes and
the trainer decides.

Causes travel as text from the reward processes (vLLM engine actors) to the trainer through a small
named Ray actor, the ledger; without a Ray runtime (unit tests, ``lpo-eval``) they are only printed.

Public names (stable):
    ERROR_KEY = "reward/error_frac"   the per-sample extra_logs key and the step metric
    ErrorWindow(window, stop_frac)    add(flags) -> this batch's error fraction; raises
                                      RewardErrorsPersist when the full window holds too many errors
    RewardErrorsPersist               the stop, with the message naming the causes
    note_error(task, cause)           called by the reward file for every error sample
    cause_text(exc)                   "OSError: [Errno 11] Resource temporarily unavailable"
    open_ledger() -> actor handle     the trainer's ledger (created if missing; None without Ray)
    ledger_summary(handle, top=3) -> list of (count, task, cause)
    DEFAULT_WINDOW, DEFAULT_STOP_FRAC, LEDGER_NAME
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter, deque
from typing import Iterable, List, Optional, Sequence, Tuple

__all__ = ["ERROR_KEY", "DEFAULT_WINDOW", "DEFAULT_STOP_FRAC", "LEDGER_NAME", "ErrorWindow", "RewardErrorsPersist",
           "note_error", "cause_text", "open_ledger", "ledger_summary", "stop_message"]

ERROR_KEY = "reward/error_frac"
DEFAULT_WINDOW = 256
DEFAULT_STOP_FRAC = 0.5
LEDGER_NAME = "openrlhf_lpo_reward_errors"
_MAX_CAUSE = 300  # characters of an exception message kept per cause
_NOTE_TIMEOUT_S = 30.0  # a reward process waits this long for the ledger to record an error


class RewardErrorsPersist(RuntimeError):
    """More than the allowed fraction of the last window's rewards failed: the run stops."""


class ErrorWindow:
    """The last ``window`` samples' error flags. ``add`` returns the batch's error fraction and raises
    :class:`RewardErrorsPersist` once the window is full and holds more than ``stop_frac`` errors
    (``window`` 0 never stops). A few failed samples never trip it; a persistent fault does."""

    def __init__(self, window: int = DEFAULT_WINDOW, stop_frac: float = DEFAULT_STOP_FRAC):
        if window < 0:
            raise ValueError(f"error window must be >= 0, got {window}")
        if not 0.0 < stop_frac <= 1.0:
            raise ValueError(f"error stop fraction must be in (0, 1], got {stop_frac}")
        self.window, self.stop_frac = int(window), float(stop_frac)
        self._flags: deque = deque(maxlen=max(self.window, 1))
        self.errors = 0  # errors inside the window
        self.seen = 0  # samples seen in total
        self.total_errors = 0

    def add(self, flags: Sequence[bool], describe=None) -> float:
        """Add one batch's flags (True = error). ``describe()`` gives the causes for the message."""
        flags = [bool(f) for f in flags]
        for f in flags:
            if self.window and len(self._flags) == self.window:
                self.errors -= self._flags[0]
            if self.window:
                self._flags.append(f)
                self.errors += f
        self.seen += len(flags)
        self.total_errors += sum(flags)
        if self.tripped():
            raise RewardErrorsPersist(stop_message(self.errors, self.window, self.stop_frac,
                                                   describe() if describe is not None else []))
        return sum(flags) / len(flags) if flags else 0.0

    def tripped(self) -> bool:
        return bool(self.window) and len(self._flags) == self.window and self.errors > self.stop_frac * self.window


def stop_message(errors: int, window: int, stop_frac: float, causes: Iterable[Tuple[int, str, str]]) -> str:
    lines = [f"rewards could not be computed for {errors} of the last {window} samples "
             f"({100.0 * errors / window:.0f}% > --reward.error_stop_frac {stop_frac:g}); stopping the run."]
    causes = list(causes)
    if causes:
        lines.append("Causes reported by the reward processes (count, task, error):")
        lines += [f"  {n} x task {task}: {cause}" for n, task, cause in causes]
    else:
        lines.append("No cause was reported: the reward function itself failed (OpenRLHF logs its exception "
                     "at INFO as '[SingleTurnExecutor] Failed to fetch reward'), see the rollout engines' logs.")
    lines.append("Fix the cause and resume with --ckpt.load_enable; to train on anyway raise "
                 "--reward.error_stop_frac (1 never stops) or set --reward.error_window 0.")
    return "\n".join(lines)


def cause_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _MAX_CAUSE else text[:_MAX_CAUSE] + "..."


# ----------------------------------------------------------------------------- the ledger (Ray)


class _Ledger:
    """Counts of (task, cause) reported by the reward processes (a named Ray actor)."""

    def __init__(self):
        self.counts: Counter = Counter()

    def note(self, task: str, cause: str) -> None:
        self.counts[(task, cause)] += 1

    def summary(self, top: int = 3) -> List[Tuple[int, str, str]]:
        return [(n, task, cause) for (task, cause), n in self.counts.most_common(top)]


def open_ledger():
    """The ledger of this Ray job (created when missing), or None when Ray is not running here."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    remote = ray.remote(num_cpus=0)(_Ledger)
    return remote.options(name=LEDGER_NAME, get_if_exists=True).remote()


def ledger_summary(handle, top: int = 3, timeout_s: float = 30.0) -> List[Tuple[int, str, str]]:
    if handle is None:
        return []
    import ray

    try:
        return ray.get(handle.summary.remote(top), timeout=timeout_s)
    except Exception as e:  # noqa: BLE001  (the stop message must still be written)
        return [(0, "?", f"the cause ledger could not be read ({cause_text(e)})")]


_REPORT = {"handle": None, "looked": 0.0, "printed": Counter(), "lock": threading.Lock()}
_LOOKUP_EVERY_S = 30.0


def _ledger_handle():
    """The ledger from a reward process (looked up by name, at most every 30 s while missing)."""
    with _REPORT["lock"]:
        if _REPORT["handle"] is not None:
            return _REPORT["handle"]
        now = time.monotonic()
        if now - _REPORT["looked"] < _LOOKUP_EVERY_S:
            return None
        _REPORT["looked"] = now
        try:
            import ray

            if ray.is_initialized():
                _REPORT["handle"] = ray.get_actor(LEDGER_NAME)
        except Exception:  # noqa: BLE001  (no trainer ledger in this job: print only)
            _REPORT["handle"] = None
        return _REPORT["handle"]


def note_error(task: str, cause: str) -> None:
    """Report one error sample: printed (first time per cause, then every 100th) and sent to the ledger."""
    key = (task, cause)
    with _REPORT["lock"]:
        _REPORT["printed"][key] += 1
        n = _REPORT["printed"][key]
    if n == 1 or n % 100 == 0:
        print(f"[openrlhf_lpo] reward error #{n} (task {task}), scored 0 with status error: {cause}",
              file=sys.stderr, flush=True)
    handle = _ledger_handle()
    if handle is not None:
        try:
            import ray

            # recorded before this reward returns, so the trainer's stop message, written after it has seen
            # the reward, finds it (two callers' calls are not ordered: a ledger actor still starting on a
            # busy cluster could otherwise answer the trainer's question first)
            ray.get(handle.note.remote(task, cause), timeout=_NOTE_TIMEOUT_S)
        except Exception:  # noqa: BLE001  (the ledger is gone: the sample is still counted by the trainer)
            _REPORT["handle"] = None
