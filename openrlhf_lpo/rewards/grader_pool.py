"""The hang-safe grading pool: math-verify in worker processes with a hard per-item wall-clock kill.

math-verify's own timeout is ``signal.alarm``-based: it raises in non-main threads and Ray workers and
does not stop pathological inputs (Math-Verify issue #65 runs forever). So items run in **worker
processes** that the parent kills with SIGKILL once an item exceeds its ``timeout``; the item is
reported with status ``"timeout"`` and a fresh worker replaces the killed one. Workers are forked by a
per-pool fork server (``python -m openrlhf_lpo.rewards.grading_worker --zygote``) that imported and
warmed up math-verify once, so a replacement is ready in milliseconds and the caller's process
(threads, CUDA, Ray) is never forked. The parent side uses only pipes and ``selectors``, so it works
from any thread, from Ray actors and after ``fork``.

Items are ``(kind, response, gold)``; :data:`ITEM_KINDS` names what a worker does with them (the math
rules of :mod:`openrlhf_lpo.rewards.math_grading` with or without the fast path, with the last-box or the
all-boxes rule, with or without a required box, and multiple choice). Single calls (:func:`grade_math`) use a lazily started shared
pool (``LPO_GRADER_WORKERS`` workers, default ``min(4, cpu_count)``; ``LPO_GRADER_TIMEOUT`` seconds,
default 10). Batches (:func:`grade_math_batch` or :class:`GraderPool`) stream chunks to every worker.
"""

from __future__ import annotations

import atexit
import functools
import json
import math
import os
import selectors
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from typing import Callable, Iterable, Sequence

from .choice_grading import grade_choice
from .grade_result import GradeResult, check_text
from .math_grading import BOX_RULES, grade_math_inprocess, warm_up

__all__ = [
    "GraderPool",
    "ITEM_KINDS",
    "default_timeout",
    "default_workers",
    "grade_math",
    "grade_math_batch",
    "math_kind",
    "shared_pool",
    "shutdown_shared_pool",
]

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


def math_kind(fast_path: bool = True, boxes: str = "last", require_box: bool = False) -> str:
    """The item kind for math grading with these options (see :mod:`openrlhf_lpo.rewards.math_grading`)."""
    if boxes not in BOX_RULES:
        raise ValueError(f"boxes must be one of {BOX_RULES}, got {boxes!r}")
    return ("math" if fast_path else "math_full") + ("" if boxes == "last" else "_allboxes") + ("_boxed" if require_box else "")


# What a worker does with an item, by kind name (the names travel over the pipe): every math option
# combination (``math``, ``math_full``, ``math_allboxes``, ``math_boxed``, ...) and multiple choice.
ITEM_KINDS: dict[str, Callable[[str, str], GradeResult]] = {
    math_kind(fast, boxes, req): functools.partial(grade_math_inprocess, fast_path=fast, boxes=boxes, require_box=req)
    for fast in (True, False) for boxes in BOX_RULES for req in (False, True)
}
ITEM_KINDS["choice"] = grade_choice


# ----------------------------------------------------------------------------------------------
# Worker side (runs in the fork server and its children)
# ----------------------------------------------------------------------------------------------

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
                r = ITEM_KINDS[kind](response, gold)
                out = [r.correct, r.status, r.extracted]
            except Exception:
                out = [False, "error", None]
            proto.write(json.dumps(out) + "\n")


def _worker_main() -> None:  # pragma: no cover - a standalone worker on stdin/stdout (for debugging)
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)  # anything printed by libraries goes to stderr, never into the protocol
    _start_watchdog()
    warm_up()
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
        warm_up()
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
            if len(item) != 3 or item[0] not in ITEM_KINDS:
                raise ValueError(f"items[{i}] must be (kind, response, gold) with kind in {sorted(ITEM_KINDS)}")
            check_text(f"items[{i}] response", item[1])
            check_text(f"items[{i}] gold", item[2])
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

        def fail_current(slot: int, w, status: str, stat: str) -> None:
            """The item ``w`` is on ends with ``status``; the rest of its chunk is requeued; the worker replaced."""
            finish(w.inflight.popleft(), GradeResult(False, status, None))
            if progress is not None:
                progress(1)
            pending.extendleft(reversed(w.inflight))
            w.inflight.clear()
            self.stats[stat] += 1
            replace(slot)

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
                            fail_current(slot, w, "error", "crashes")
                        else:
                            self.stats["crashes"] += 1
                            replace(slot)
                # enforce deadlines
                now = time.monotonic()
                for slot, w in enumerate(ws):
                    if w.inflight and now - w.t_item >= timeout:
                        fail_current(slot, w, "timeout", "timeouts")
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

def grade_math(response: str, gold: str, timeout: float | None = None, fast_path: bool = True,
               boxes: str = "last") -> GradeResult:
    """Grade one math response against ``gold`` (the reference answer, without ``\\boxed``).

    Runs in the shared worker pool with a hard ``timeout`` (seconds, default ``LPO_GRADER_TIMEOUT``);
    safe to call from threads and Ray workers. ``boxes``: ``"last"`` (grade the last box, default) or
    ``"all"`` (math-verify reads every box; several boxes form a set).
    """
    check_text("response", response)
    check_text("gold", gold)
    return shared_pool().grade([(math_kind(fast_path, boxes), response, gold)], timeout=timeout)[0]


def grade_math_batch(
    responses: Sequence[str],
    golds: Sequence[str],
    timeout: float | None = None,
    pool: GraderPool | None = None,
    progress: Callable[[int], None] | None = None,
    fast_path: bool = True,
    boxes: str = "last",
) -> list[GradeResult]:
    """Grade many math responses (``responses[i]`` against ``golds[i]``) in parallel, in order.

    ``pool``: a :class:`GraderPool` (default: the shared one). ``fast_path=False`` sends every item
    through math-verify's ``verify`` (same verdicts, slower).
    """
    if len(responses) != len(golds):
        raise ValueError(f"responses and golds must have the same length ({len(responses)} != {len(golds)})")
    kind = math_kind(fast_path, boxes)
    pool = shared_pool() if pool is None else pool
    return pool.grade([(kind, r, g) for r, g in zip(responses, golds)], timeout=timeout, progress=progress)
