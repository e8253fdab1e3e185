"""Hang-safe answer grading, shared by the RL reward and the ``lpo-eval`` package.

One grader for training and evaluation:

* **Math** answers are graded with math-verify (``parse`` + ``verify``). The gold is wrapped as
  ``\\boxed{gold}`` (not ``$gold$``): that way every reference answer of the staged benchmarks grades
  correct against itself (1547/1547, see ``shared/research/eval.md``), including golds with stray ``$``
  or trailing newlines.
* math-verify's own timeout is ``signal.alarm``-based: it raises in non-main threads and Ray workers and
  does not stop pathological inputs (Math-Verify issue #65 runs forever). So the grading runs in
  **worker processes** that the parent kills with SIGKILL once an item exceeds its wall-clock
  ``timeout``; the item is reported with status ``"timeout"`` and a fresh worker replaces the killed
  one. Workers are forked by a per-pool fork server (``python -m openrlhf_lpo.rewards.grading_worker
  --zygote``) that imported and warmed up math-verify once, so a replacement is ready in milliseconds
  and the caller's process (threads, CUDA, Ray) is never forked. The parent side uses only pipes and
  ``selectors``, so it works from any thread, from Ray actors and after ``fork``.
* **Multiple choice** is graded in-process by a small extractor (no sympy, cannot hang): the letter
  in the last ``\\boxed{}`` (``C``, ``(C)``, ``\\text{C}``, ``C) text``), else the last
  ``answer is (X)`` / ``Answer: X``. It never takes "the last capital letter anywhere".
* Responses of reasoning models are graded on the text after the last ``</think>``; an unclosed
  ``<think>`` block has no answer.

Statuses: ``ok`` (graded; ``correct`` says how), ``no_answer`` (nothing to grade), ``timeout`` (killed
after ``timeout`` seconds), ``error`` (the gold could not be parsed, or the worker crashed).

Single calls (:func:`grade_math`) use a lazily started shared pool (``LPO_GRADER_WORKERS`` workers,
default ``min(4, cpu_count)``; ``LPO_GRADER_TIMEOUT`` seconds, default 10). Batches
(:func:`grade_math_batch` or :class:`GraderPool`) stream chunks of items to every worker.
"""

from __future__ import annotations

import atexit
import functools
import json
import math
import os
import re
import selectors
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

__all__ = [
    "STATUSES",
    "GradeResult",
    "GraderPool",
    "extract_choice",
    "final_answer_text",
    "grade_choice",
    "grade_math",
    "grade_math_batch",
    "grade_math_inprocess",
    "last_boxed",
    "shared_pool",
    "shutdown_shared_pool",
]

STATUSES = ("ok", "timeout", "no_answer", "error")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CHOICE_LETTERS = "ABCDEFGHIJ"


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be a number of seconds") from None
    if not value > 0:
        raise ValueError(f"environment variable {name}={raw!r} must be > 0")
    return value


def default_timeout() -> float:
    """Per-item wall-clock limit in seconds (``LPO_GRADER_TIMEOUT``, default 10)."""
    return _env_float("LPO_GRADER_TIMEOUT", 10.0)


def default_workers() -> int:
    """Size of the shared pool (``LPO_GRADER_WORKERS``, default ``min(4, cpu_count)``)."""
    raw = os.environ.get("LPO_GRADER_WORKERS")
    if raw:
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"environment variable LPO_GRADER_WORKERS={raw!r} must be an integer >= 1")
        return int(raw)
    return max(1, min(4, os.cpu_count() or 1))


@dataclass(frozen=True)
class GradeResult:
    """Outcome of grading one response: ``correct`` and ``status`` (one of :data:`STATUSES`).

    ``extracted`` is the answer the grader read from the response (``None`` if there was none).
    """

    correct: bool
    status: str
    extracted: str | None = None


# ----------------------------------------------------------------------------------------------
# Text helpers (pure python, safe anywhere)
# ----------------------------------------------------------------------------------------------


def final_answer_text(response: str) -> str | None:
    """The part of ``response`` that is graded.

    Text after the last ``</think>`` for reasoning models; ``None`` when a ``<think>`` block is opened
    and never closed (truncated reasoning has no answer); otherwise the whole response.
    """
    idx = response.rfind(THINK_CLOSE)
    if idx >= 0:
        return response[idx + len(THINK_CLOSE) :]
    if THINK_OPEN in response:
        return None
    return response


_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    """Content of the last closed ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``; braces balanced."""
    starts = [m.end() for m in _BOX_RE.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for pos in range(start, len(text)):
            ch = text[pos]
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    return text[start:pos]
    return None


_TEXT_WRAP_RE = re.compile(r"\\(?:text|textbf|mathrm|mathbf|textrm|mbox)\s*\{([^{}]*)\}")
# A single option token, optionally in parentheses, then end / ")" / "." / ":" (e.g. "C", "(C)", "C) Planets").
_BOX_CHOICE_RE = re.compile(r"^\(?\s*([A-Za-z]|[1-9])\s*(?:\)|\.|:|$)")


def _choice_from_box(inner: str, allowed: str) -> str | None:
    s = inner
    for _ in range(3):  # \text{\textbf{C}} nests at most a couple of times
        s2 = _TEXT_WRAP_RE.sub(r"\1", s)
        if s2 == s:
            break
        s = s2
    s = s.replace("$", "").replace("\\,", " ").replace("~", " ").strip()
    m = _BOX_CHOICE_RE.match(s)
    if not m:
        return None
    tok = m.group(1).upper()
    return tok if tok in allowed else None


@functools.lru_cache(maxsize=64)
def _fallback_patterns(allowed: str) -> tuple[re.Pattern, ...]:
    cls = "[" + re.escape(allowed) + "]"
    return (
        # "the answer is (C)", "The correct answer is: **C**", "answer is $\text{C}$"
        re.compile(r"(?i:answer)\s+is\s*:?\s*[*_]*\s*\$?\s*(?:\\text\{\s*)?\(?\s*(" + cls + r")\b(?![-'])"),
        # "Answer: C", "**Answer:** (C)"
        re.compile(r"Answer\s*[*_]*\s*:\s*[*_]*\s*\$?\s*\(?\s*(" + cls + r")\b(?![-'])"),
    )


def _allowed_choices(gold: str, choices: str | None) -> str:
    if choices is not None:
        return choices.upper()
    if gold.isdigit():
        return "123456789"
    letters = CHOICE_LETTERS
    if gold.isalpha() and gold not in letters:  # options beyond J
        letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    return letters


def extract_choice(response: str, choices: str = CHOICE_LETTERS) -> str | None:
    """The option a response picks, or ``None``.

    Order: the last ``\\boxed{}`` holding a single option (``C``, ``(C)``, ``\\text{C}``, ``C) ...``);
    else the last ``answer is X`` (also "The answer is (X)"); else the last ``Answer: X``.
    Grading looks only after ``</think>``.
    """
    text = final_answer_text(response)
    if text is None:
        return None
    allowed = choices.upper()
    box = last_boxed(text)
    if box is not None:
        tok = _choice_from_box(box, allowed)
        if tok is not None:
            return tok
    for pattern in _fallback_patterns(allowed):
        hits = pattern.findall(text)
        if hits:
            return hits[-1].upper()
    return None


def _check_text(name: str, value) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a str, got {type(value).__name__}: {value!r:.80}")
    return value


def grade_choice(response: str, gold: str, choices: str | None = None) -> GradeResult:
    """Grade a multiple-choice response against ``gold`` (a letter A-J, or a digit 1-9).

    ``choices`` restricts the accepted options (default: A-J for letter golds, 1-9 for digit golds).
    Pure python and cheap, so it runs in the caller's process.
    """
    _check_text("response", response)
    gold_s = _check_text("gold", gold).strip().upper()
    if len(gold_s) != 1 or not gold_s.isalnum():
        raise ValueError(f"gold must be a single option letter or digit, got {gold!r}")
    allowed = _allowed_choices(gold_s, choices)
    if gold_s not in allowed:
        raise ValueError(f"gold {gold!r} is not one of the allowed choices {allowed!r}")
    picked = extract_choice(response, allowed)
    if picked is None:
        return GradeResult(False, "no_answer", None)
    return GradeResult(picked == gold_s, "ok", picked)


# ----------------------------------------------------------------------------------------------
# math-verify core (runs inside worker processes; hang-unsafe if called directly)
# ----------------------------------------------------------------------------------------------


def _parse_gold(gold: str):
    """The gold wrapped as ``\\boxed{gold}`` (a response that is exactly that shares the cache entry)."""
    return _parse_pred("\\boxed{" + gold + "}")


@functools.lru_cache(maxsize=2048)
def _parse_pred(text: str):
    """Parsed response text; cached because groups of samples often repeat the same short answer."""
    from math_verify import parse

    return parse(text, parsing_timeout=None)


def _answer_repr(parsed) -> str | None:
    if not parsed:
        return None
    return str(parsed[-1])


def _exact_single_box(text: str, gold: str) -> str | None:
    """The box content when ``text`` has exactly one ``\\boxed{}`` whose content *is* the gold string."""
    if text.count("\\boxed") + text.count("\\fbox") != 1:
        return None
    box = last_boxed(text)
    if box is not None and box.strip() == gold.strip():
        return box.strip()
    return None


def grade_math_inprocess(response: str, gold: str, fast_path: bool = True) -> GradeResult:
    """Grade in the calling process with math-verify and **no timeout at all**.

    This is the core the worker processes run; call it directly only for trusted input (it can hang
    forever on inputs like Math-Verify #65). Use :func:`grade_math` / :func:`grade_math_batch` instead.

    ``fast_path``: a response whose only ``\\boxed{}`` holds exactly the gold string is correct without
    calling sympy (identical strings; with one box math-verify reads that box too). Everything else,
    including every wrong answer, goes through math-verify.
    """
    text = final_answer_text(response)
    if text is None:
        return GradeResult(False, "no_answer", None)
    if fast_path:
        box = _exact_single_box(text, gold)
        if box is not None:
            return GradeResult(True, "ok", box)
    from math_verify import verify

    try:
        gold_parsed = _parse_gold(gold)
    except Exception:
        return GradeResult(False, "error", None)
    if not gold_parsed:
        return GradeResult(False, "error", None)
    try:
        pred = _parse_pred(text)
    except Exception:
        return GradeResult(False, "error", None)
    if not pred:
        return GradeResult(False, "no_answer", None)
    try:
        ok = verify(gold_parsed, pred, timeout_seconds=None)
    except Exception:
        return GradeResult(False, "error", _answer_repr(pred))
    return GradeResult(bool(ok), "ok", _answer_repr(pred))


_KINDS = {
    "math": grade_math_inprocess,
    "math_full": functools.partial(grade_math_inprocess, fast_path=False),
    "choice": grade_choice,
}


# Inputs that load sympy's lazily imported parts (simplify, sets, trig, relations) before a worker reports
# ready, so a fresh worker's first real item is not charged for imports against its timeout.
_WARMUP = (
    ("\\boxed{1}", "1"),
    ("so \\boxed{(x+1)^2}", "x^2+2x+1"),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\sin(\\pi/4)"),
    ("\\boxed{[1, 2)}", "[1,2)"),
    ("\\boxed{x=3}", "3"),
    ("\\boxed{1,2}", "\\{2, 1\\}"),
    ("\\boxed{10\\%}", "0.1"),
)


def _warm_up() -> None:
    import logging

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    for response, gold in _WARMUP:
        grade_math_inprocess(response, gold, fast_path=False)
    _parse_pred.cache_clear()


def _start_watchdog() -> None:
    """Exit when the parent process dies, even in the middle of a long item."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def _serve(requests, proto) -> None:
    """Worker loop: JSON lines of ``[[kind, response, gold], ...]`` in, one result line per item out."""
    proto.write(json.dumps({"ready": os.getpid()}) + "\n")
    for line in requests:
        for kind, response, gold in json.loads(line):
            try:
                r = _KINDS[kind](response, gold)
                out = [r.correct, r.status, r.extracted]
            except Exception:
                out = [False, "error", None]
            proto.write(json.dumps(out) + "\n")


def _worker_main() -> None:  # pragma: no cover - a standalone worker on stdin/stdout (for debugging)
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)  # anything printed by libraries goes to stderr, never into the protocol
    _start_watchdog()
    _warm_up()
    _serve(sys.stdin, proto)


def _zygote_main(sock_fd: int) -> None:  # pragma: no cover - runs in the zygote process
    """Fork server: import + warm up math-verify once, then fork a ready worker per request.

    The parent sends two pipe ends (the worker's stdin and stdout) over a Unix socket; the zygote forks,
    replies with the child's pid and closes its copies. Forking from a single-threaded, warmed-up process
    makes replacing a killed worker take milliseconds. The zygote exits when the parent closes the socket.
    """
    import signal
    import socket
    import traceback

    sock = socket.socket(fileno=sock_fd)
    os.dup2(2, 1)
    try:
        _warm_up()
    except BaseException:
        sock.sendall((json.dumps({"fatal": traceback.format_exc()}) + "\n").encode())
        return
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped automatically
    sock.sendall((json.dumps({"ready": os.getpid()}) + "\n").encode())
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 16, 4)
        except OSError:
            os._exit(0)
        if not msg:
            os._exit(0)  # the parent closed the pool or died: nothing to flush, skip interpreter teardown
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            continue
        pid = os.fork()
        if pid == 0:
            try:
                sock.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _start_watchdog()
                _serve(os.fdopen(fds[0], "r", encoding="utf-8"), os.fdopen(fds[1], "w", buffering=1, encoding="utf-8"))
            finally:
                os._exit(0)
        for fd in fds:
            os.close(fd)
        sock.sendall(f"{pid}\n".encode())


# ----------------------------------------------------------------------------------------------
# Worker pool
# ----------------------------------------------------------------------------------------------

_PKG_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = _PKG_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


class _Zygote:
    """Parent side of the fork server (``python -m openrlhf_lpo.rewards.grading_worker --zygote FD``)."""

    def __init__(self, env: dict, quiet: bool, startup_timeout: float):
        import socket

        parent_sock, child_sock = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "openrlhf_lpo.rewards.grading_worker", "--zygote", str(child_sock.fileno())],
                pass_fds=(child_sock.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL if quiet else None,
                env=env,
                close_fds=True,
            )
        finally:
            child_sock.close()
        self.sock = parent_sock
        self.lock = threading.Lock()
        self._buf = b""
        line = self._readline(startup_timeout, "start")
        msg = json.loads(line)
        if "fatal" in msg:
            self.close()
            raise RuntimeError("grader worker failed to start:\n" + msg["fatal"])

    def _readline(self, timeout: float, what: str) -> bytes:
        self.sock.settimeout(timeout)
        try:
            while b"\n" not in self._buf:
                chunk = self.sock.recv(4096)
                if not chunk:
                    raise RuntimeError(
                        f"grader zygote exited during {what} (rc={self.proc.poll()}); run "
                        f"`{sys.executable} -m openrlhf_lpo.rewards.grading_worker` to see why"
                    )
                self._buf += chunk
        except OSError as e:  # socket.timeout included
            raise RuntimeError(f"grader zygote did not {what} within {timeout:.0f} s ({e!r})") from None
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def spawn(self) -> tuple[int, int, int]:
        """Fork a worker; returns (pid, fd to write requests, fd to read results)."""
        import socket

        r_in, w_in = os.pipe()
        r_out, w_out = os.pipe()
        try:
            with self.lock:
                socket.send_fds(self.sock, [b"F"], [r_in, w_out])
                pid = int(self._readline(60.0, "fork a worker"))
        except BaseException:
            for fd in (w_in, r_out):
                os.close(fd)
            raise
        finally:
            os.close(r_in)
            os.close(w_out)
        return pid, w_in, r_out

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
        try:  # the zygote holds no state worth a graceful exit
            self.proc.kill()
            self.proc.wait(timeout=5)
        except Exception:
            pass


class _Worker:
    """One forked grading process and its pipe state (owned by one thread at a time)."""

    def __init__(self, zygote: _Zygote):
        self.pid, self.wfd, self.fd = zygote.spawn()
        os.set_blocking(self.fd, False)
        self.closed = False
        self.buf = b""
        self.ready = False
        self.started = time.monotonic()
        self.served = 0
        self.inflight: deque[int] = deque()
        self.t_item = 0.0

    def read_lines(self) -> tuple[list[bytes], bool]:
        """Complete lines available now, and whether the child closed its end (died)."""
        eof = False
        while True:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            except OSError:
                eof = True
                break
            if not chunk:
                eof = True
                break
            self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        return lines, eof

    def send(self, payload: bytes) -> None:
        view = memoryview(payload)
        while view:
            view = view[os.write(self.wfd, view) :]

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def kill(self) -> None:
        try:
            os.kill(self.pid, 9)  # SIGKILL; the zygote reaps it
        except (ProcessLookupError, PermissionError):
            pass
        self._close_pipes()

    def stop(self) -> None:
        self._close_pipes()  # EOF on its stdin: the worker exits by itself

    def _close_pipes(self) -> None:
        if not self.closed:
            self.closed = True
            for fd in (self.wfd, self.fd):
                try:
                    os.close(fd)
                except OSError:
                    pass


class GraderPool:
    """A pool of math-verify worker processes with a hard per-item wall-clock kill.

    ``workers``: maximum number of child processes (started on demand). ``timeout``: default seconds an
    item may run before its worker is killed. ``chunk_size``: items sent to a worker per round trip
    (each item still has its own deadline: the clock restarts when the previous result arrives).
    ``max_items_per_worker``: recycle a worker after this many items (bounds sympy cache growth).
    Thread-safe: concurrent :meth:`grade` calls share the workers. Not inherited across ``fork``.
    """

    def __init__(
        self,
        workers: int | None = None,
        timeout: float | None = None,
        chunk_size: int = 16,
        max_items_per_worker: int = 20000,
        startup_timeout: float = 180.0,
        quiet: bool = True,
    ):
        self.workers = default_workers() if workers is None else int(workers)
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers!r}")
        self.timeout = default_timeout() if timeout is None else _check_timeout(timeout)
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size!r}")
        self.chunk_size = int(chunk_size)
        self.max_items_per_worker = int(max_items_per_worker)
        self.startup_timeout = float(startup_timeout)
        self.quiet = quiet
        self._pid = os.getpid()
        self._cond = threading.Condition(threading.Lock())
        self._idle: list[_Worker] = []
        self._slots = 0  # workers alive or starting, idle or checked out
        self._closed = False
        self._env = _worker_env()
        self._live: "weakref.WeakSet[_Worker]" = weakref.WeakSet()
        self._zygote: _Zygote | None = None
        self._zygote_lock = threading.Lock()
        self.stats = {"timeouts": 0, "crashes": 0, "restarts": 0}
        _POOLS.add(self)

    # -- worker bookkeeping ---------------------------------------------------------------------
    def _new_worker(self) -> _Worker:
        with self._zygote_lock:
            if self._closed:
                raise RuntimeError("GraderPool is closed")
            if self._zygote is None or not self._zygote.alive():
                if self._zygote is not None:
                    self._zygote.close()
                self._zygote = _Zygote(self._env, self.quiet, self.startup_timeout)
            zygote = self._zygote
        try:
            w = _Worker(zygote)
        except (OSError, RuntimeError):  # the zygote died between the check and the fork: once more
            with self._zygote_lock:
                if self._zygote is zygote:
                    zygote.close()
                    self._zygote = _Zygote(self._env, self.quiet, self.startup_timeout)
                zygote = self._zygote
            w = _Worker(zygote)
        self._live.add(w)
        return w

    def _checkout(self, want: int) -> list[_Worker]:
        if os.getpid() != self._pid:
            raise RuntimeError("this GraderPool belongs to the parent process; create a new one after fork")
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("GraderPool is closed")
                take = self._idle[:want]
                del self._idle[:want]
                n_new = min(want - len(take), self.workers - self._slots)
                if take or n_new > 0:
                    self._slots += n_new
                    break
                self._cond.wait()
        try:
            return take + [self._new_worker() for _ in range(n_new)]
        except BaseException:
            with self._cond:
                self._slots -= n_new
                self._idle.extend(take)
                self._cond.notify_all()
            raise

    def _checkin(self, ws: Iterable[_Worker | None]) -> None:
        with self._cond:
            for w in ws:
                if w is None:
                    self._slots -= 1
                elif self._closed:
                    w.kill()
                    self._slots -= 1
                else:
                    self._idle.append(w)
            self._cond.notify_all()

    # -- grading --------------------------------------------------------------------------------
    def grade(
        self,
        items: Sequence[tuple[str, str, str]],
        timeout: float | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> list[GradeResult]:
        """Grade ``(kind, response, gold)`` items (kind ``"math"`` or ``"choice"``), in input order.

        ``progress(k)`` is called with the number of items finished since the last call.
        """
        timeout = self.timeout if timeout is None else _check_timeout(timeout)
        n = len(items)
        for i, item in enumerate(items):
            if len(item) != 3 or item[0] not in _KINDS:
                raise ValueError(f"items[{i}] must be (kind, response, gold) with kind in {sorted(_KINDS)}")
            _check_text(f"items[{i}] response", item[1])
            _check_text(f"items[{i}] gold", item[2])
        results: list[GradeResult | None] = [None] * n
        if n == 0:
            return []
        pending: deque[int] = deque(range(n))
        ws: list[_Worker | None] = self._checkout(min(n, self.workers))
        sel = selectors.DefaultSelector()
        for w in ws:
            sel.register(w.fd, selectors.EVENT_READ, w)
        done = 0

        def finish(i: int, r: GradeResult) -> None:
            nonlocal done
            results[i] = r
            done += 1

        def replace(slot: int) -> None:
            old = ws[slot]
            sel.unregister(old.fd)
            old.kill()
            ws[slot] = None
            self.stats["restarts"] += 1
            new = self._new_worker()
            ws[slot] = new
            sel.register(new.fd, selectors.EVENT_READ, new)

        try:
            while done < n:
                # hand a chunk to every ready, idle worker
                for slot, w in enumerate(ws):
                    if not pending:
                        break
                    if not w.ready or w.inflight:
                        continue
                    if w.served >= self.max_items_per_worker or not w.alive():
                        replace(slot)  # recycle (bounded cache growth) or replace a worker that died idle
                        continue
                    size = max(1, min(self.chunk_size, math.ceil(len(pending) / len(ws))))
                    idx = [pending.popleft() for _ in range(min(size, len(pending)))]
                    payload = (json.dumps([list(items[i]) for i in idx]) + "\n").encode("utf-8", "surrogatepass")
                    try:
                        w.send(payload)
                    except OSError:  # died while idle: retry the chunk on a fresh worker
                        pending.extendleft(reversed(idx))
                        self.stats["crashes"] += 1
                        replace(slot)
                        continue
                    w.inflight.extend(idx)
                    w.t_item = time.monotonic()
                # wait for results, readiness, or the nearest deadline
                now = time.monotonic()
                deadlines = [
                    (w.t_item + timeout) if w.inflight else (w.started + self.startup_timeout)
                    for w in ws
                    if w.inflight or not w.ready
                ]
                wait = max(0.0, min(deadlines) - now) if deadlines else None
                for key, _ in sel.select(wait):
                    w = key.data
                    if w not in ws:
                        continue
                    lines, eof = w.read_lines()
                    for line in lines:
                        msg = json.loads(line)
                        if not w.ready:
                            if isinstance(msg, dict) and "fatal" in msg:
                                raise RuntimeError("grader worker failed to start:\n" + msg["fatal"])
                            w.ready = True
                            continue
                        i = w.inflight.popleft()
                        finish(i, GradeResult(bool(msg[0]), msg[1], msg[2]))
                        w.served += 1
                        w.t_item = time.monotonic()
                        if progress is not None:
                            progress(1)
                    if eof:
                        slot = ws.index(w)
                        if not w.ready:
                            raise RuntimeError("a grader worker exited right after its fork (out of memory?)")
                        if w.inflight:  # crashed on its current item (e.g. killed by the OOM killer)
                            finish(w.inflight.popleft(), GradeResult(False, "error", None))
                            if progress is not None:
                                progress(1)
                            pending.extendleft(reversed(w.inflight))
                            w.inflight.clear()
                        self.stats["crashes"] += 1
                        replace(slot)
                # enforce deadlines
                now = time.monotonic()
                for slot, w in enumerate(ws):
                    if w.inflight and now - w.t_item >= timeout:
                        finish(w.inflight.popleft(), GradeResult(False, "timeout", None))
                        if progress is not None:
                            progress(1)
                        pending.extendleft(reversed(w.inflight))
                        w.inflight.clear()
                        self.stats["timeouts"] += 1
                        replace(slot)
                    elif not w.ready and now - w.started >= self.startup_timeout:
                        raise RuntimeError(
                            f"grader worker did not start within {self.startup_timeout:.0f} s "
                            "(machine overloaded? raise startup_timeout)"
                        )
        except BaseException:
            for slot, w in enumerate(ws):
                if w is not None and (w.inflight or w.buf):
                    w.kill()
                    ws[slot] = None
            raise
        finally:
            sel.close()
            self._checkin(ws)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        """Stop every worker of this pool (only in the process that created it)."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        if os.getpid() != self._pid:
            return
        for w in idle:
            w.stop()
        for w in list(self._live):
            if w not in idle:
                w.kill()
        with self._zygote_lock:
            zygote, self._zygote = self._zygote, None
        if zygote is not None:
            zygote.close()

    def _forget_after_fork(self) -> None:
        """In a forked child: drop the parent's pipes without touching the parent's workers."""
        for w in list(self._live):
            w._close_pipes()
        if self._zygote is not None:
            try:
                self._zygote.sock.close()
            except OSError:
                pass
            self._zygote = None
        self._idle = []
        self._closed = True

    def __enter__(self) -> "GraderPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_timeout(timeout) -> float:
    try:
        t = float(timeout)
    except (TypeError, ValueError):
        raise ValueError(f"timeout must be a number of seconds, got {timeout!r}") from None
    if not t > 0 or math.isinf(t):
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    return t


# ----------------------------------------------------------------------------------------------
# Shared pool and the public functions
# ----------------------------------------------------------------------------------------------

_POOLS: "weakref.WeakSet[GraderPool]" = weakref.WeakSet()
_SHARED: GraderPool | None = None
_SHARED_LOCK = threading.Lock()


def shared_pool() -> GraderPool:
    """The process-wide pool, started lazily (a forked child gets its own)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None or _SHARED._pid != os.getpid() or _SHARED._closed:
            _SHARED = GraderPool()
        return _SHARED


def shutdown_shared_pool() -> None:
    """Stop the shared pool's workers (a later call starts a new pool)."""
    global _SHARED
    with _SHARED_LOCK:
        pool, _SHARED = _SHARED, None
    if pool is not None:
        pool.close()


def _after_fork_in_child() -> None:
    global _SHARED, _SHARED_LOCK
    _SHARED_LOCK = threading.Lock()
    _SHARED = None
    for pool in list(_POOLS):
        pool._forget_after_fork()


def _close_all_at_exit() -> None:
    for pool in list(_POOLS):
        if pool._pid == os.getpid():
            pool.close()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_close_all_at_exit)


def grade_math(response: str, gold: str, timeout: float | None = None, fast_path: bool = True) -> GradeResult:
    """Grade one math response against ``gold`` (the reference answer, without ``\\boxed``).

    Runs in the shared worker pool with a hard ``timeout`` (seconds, default ``LPO_GRADER_TIMEOUT``);
    safe to call from threads and Ray workers.
    """
    _check_text("response", response)
    _check_text("gold", gold)
    kind = "math" if fast_path else "math_full"
    return shared_pool().grade([(kind, response, gold)], timeout=timeout)[0]


def grade_math_batch(
    responses: Sequence[str],
    golds: Sequence[str],
    timeout: float | None = None,
    pool: GraderPool | None = None,
    progress: Callable[[int], None] | None = None,
    fast_path: bool = True,
) -> list[GradeResult]:
    """Grade many math responses (``responses[i]`` against ``golds[i]``) in parallel, in order.

    ``pool``: a :class:`GraderPool` (default: the shared one). ``fast_path=False`` sends every item
    through math-verify (see :func:`grade_math_inprocess`).
    """
    if len(responses) != len(golds):
        raise ValueError(f"responses and golds must have the same length ({len(responses)} != {len(golds)})")
    pool = shared_pool() if pool is None else pool
    kind = "math" if fast_path else "math_full"
    return pool.grade([(kind, r, g) for r, g in zip(responses, golds)], timeout=timeout, progress=progress)
