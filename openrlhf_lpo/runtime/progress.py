"""Progress bars in log files: plain lines instead of carriage-return frames.

OpenRLHF draws tqdm bars (episodes, generation, training epochs). On a terminal they redraw in place;
written to a file or a Ray worker log they become thousands of ``\\r`` frames on one line. When the
stream is not a TTY, :func:`install` makes every tqdm bar print one ordinary line per
``LPO_PROGRESS_STEP`` percent (default 5; every ``LPO_PROGRESS_SECONDS``, default 30, for bars with no
total) plus one at the end. Terminals keep the normal bars. ``lpo-train`` installs it in the driver
and, through Ray's ``worker_process_setup_hook``, in every worker.

Public names (stable): install(stream=None) -> bool, worker_setup()
"""

from __future__ import annotations

import os
import sys
import time

__all__ = ["install", "worker_setup"]

_STATE = {"installed": False}


def _is_tty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class _Quiet:
    """tqdm's own stream, with its frames dropped (our display writes the lines)."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, _text):
        return 0

    def flush(self):
        pass


def install(stream=None) -> bool:
    """Switch tqdm to plain lines when ``stream`` (default stderr) is not a TTY. Idempotent;
    returns whether the line mode is active."""
    stream = stream if stream is not None else sys.stderr
    if _STATE["installed"]:
        return True
    if _is_tty(stream) or os.environ.get("LPO_PROGRESS", "auto") == "tty":
        return False
    import tqdm.std as std

    step = max(float(os.environ.get("LPO_PROGRESS_STEP", "5")), 0.1)
    seconds = max(float(os.environ.get("LPO_PROGRESS_SECONDS", "30")), 0.0)
    original_init = std.tqdm.__init__

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if getattr(self, "disable", False):
            return
        self._lpo_out = getattr(self.fp, "stream", self.fp)
        self.fp = _Quiet(self._lpo_out)
        self._lpo_mark = None
        self._lpo_time = 0.0

    def display(self, msg=None, pos=None):
        out = getattr(self, "_lpo_out", None)
        if out is None:
            return True
        total, now = self.total, time.time()
        if total:
            mark = min(int(100.0 * self.n / total // step), int(100 // step))
            if mark == self._lpo_mark:
                return True
            self._lpo_mark = mark
        elif self._lpo_mark is not None and now - self._lpo_time < seconds:
            return True
        else:
            self._lpo_mark = self.n
        self._lpo_time = now
        text = self.__str__() if msg is None else msg
        out.write(text.replace("\r", "").strip() + "\n")
        out.flush()
        return True

    std.tqdm.__init__ = __init__
    std.tqdm.display = display
    _STATE["installed"] = True
    return True


def worker_setup() -> None:
    """Ray ``worker_process_setup_hook``: line progress in every worker (their logs are files)."""
    install()
