# LPO_SANDBOX_RUNNER: the supervisor that runs one model-written program against its test inputs.
"""In-sandbox supervisor of :mod:`openrlhf_lpo.rewards.sandbox` (stdlib only, Python >= 3.8).

This file is never imported by the trainer: the host reads its source and runs it as
``python -I -S -c <source>`` *inside* the sandbox (bubblewrap), where the project, the data and the
host's files are not mounted. It is the only code that touches the model's program:

1. read one JSON job line from stdin: the program, the mode (``stdio`` / ``call`` / ``assert``), the
   test inputs (never the expected outputs: those stay with the host) and the limits;
2. compile the program once (a syntax error ends the job);
3. per test, ``fork`` a child that sets its rlimits (CPU, address space, file size, open files, no
   core), gets a fresh stdin (the test input in a memfd) and stdout/stderr pipes, and executes the
   program as ``__main__``; in ``call`` mode it then calls the named function and writes the JSON of
   the return value to fd 3; in ``assert`` mode it runs the test code and ``check(entry_point)`` and
   writes a marker to fd 3 when they returned;
4. the supervisor reads the pipes with a byte budget (over budget: SIGKILL) until the child exits or
   its wall-clock deadline passes (SIGKILL), reports one JSON line per test on its original stdout,
   then SIGKILLs every other process of the sandbox (``kill(-1)``, only inside a PID namespace) so
   nothing a test started survives into the next test.

The host compares outputs with the expected values; this file never sees them.
"""

import builtins
import io
import json
import os
import resource
import select
import signal
import sys
import time

MARKER = "LPO_SANDBOX_RUNNER"
RESULT_FD = 3
ASSERT_PASSED = "LPO-ASSERT-PASSED"


def _emit(fd, obj):
    data = (json.dumps(obj) + "\n").encode("utf-8", "surrogatepass")
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_job():
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = os.read(0, 1 << 20)
        if not chunk:
            break
        buf += chunk
    return json.loads(buf.decode("utf-8", "surrogatepass"))


def _set_limits(lim):
    cpu = max(1, int(lim["cpu_s"] + 0.999))  # whole seconds
    pairs = [
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),  # soft: SIGXCPU, hard: SIGKILL a second later
        (resource.RLIMIT_AS, (lim["as_bytes"], lim["as_bytes"])),
        (resource.RLIMIT_FSIZE, (lim["fsize_bytes"], lim["fsize_bytes"])),
        (resource.RLIMIT_NOFILE, (lim["nofile"], lim["nofile"])),
        (resource.RLIMIT_CORE, (0, 0)),
    ]
    for what, value in pairs:
        resource.setrlimit(what, value)


def _fresh_stdio():
    """New sys.std* objects over fds 0/1/2 (the supervisor's buffers must not leak into the child)."""
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(
        io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8", errors="replace"
    )
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8", errors="backslashreplace"
    )
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(2, "w", closefd=False)), encoding="utf-8", errors="backslashreplace",
        write_through=True,
    )
    sys.argv = ["solution.py"]


def _jsonable(value, depth=0):
    """The return value as JSON data: tuples/sets become lists; anything else is reported by repr."""
    if depth > 100:
        raise ValueError("return value nested too deeply")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, depth + 1) for v in value]
    if isinstance(value, (set, frozenset)):
        items = [_jsonable(v, depth + 1) for v in value]
        try:
            return sorted(items)
        except TypeError:
            return items
    if isinstance(value, dict):
        return {str(k): _jsonable(v, depth + 1) for k, v in value.items()}
    return {"__unserializable__": type(value).__name__}


def _exit_code(exc):
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write(str(code) + "\n")
    except Exception:
        pass
    return 1


def _finish_like_python():
    """What interpreter exit does: join non-daemon threads, run atexit handlers, flush."""
    threading = sys.modules.get("threading")
    if threading is not None and hasattr(threading, "_shutdown"):
        threading._shutdown()
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()


def _quit(code=None):
    raise SystemExit(code)


def _run_child(code, job, test):
    """Runs in the forked child; returns the exit status."""
    if not hasattr(builtins, "exit"):  # ``-S`` skips site, which defines exit()/quit()
        builtins.exit = builtins.quit = _quit
    g = {"__name__": "__main__", "__builtins__": builtins, "__file__": "solution.py"}
    mode = job["mode"]
    try:
        try:
            exec(code, g)
            if mode == "call":
                name = job["fn_name"]
                solution_cls = g.get("Solution")
                if isinstance(solution_cls, type) and hasattr(solution_cls, name):
                    fn = getattr(solution_cls(), name)
                elif callable(g.get(name)):
                    fn = g[name]
                else:
                    raise NameError("no function %r (nor a Solution class with that method) in the program" % name)
                args = test if isinstance(test, list) else [test]
                payload = json.dumps({"value": _jsonable(fn(*args))})
                os.write(RESULT_FD, payload.encode("utf-8", "surrogatepass"))
            elif mode == "assert":
                exec(compile(job["test_code"], "<tests>", "exec"), g)
                entry = job.get("entry_point")
                if entry and callable(g.get("check")):
                    if entry not in g:
                        raise NameError("the program defines no %r" % entry)
                    g["check"](g[entry])
                os.write(RESULT_FD, ASSERT_PASSED.encode())
            _finish_like_python()
            return 0
        except SystemExit as exc:
            rc = _exit_code(exc)
            _finish_like_python()
            return rc
    except BaseException:
        try:
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
        except BaseException:
            pass
        return 1


def _spawn(code, job, i, lim):
    mode = job["mode"]
    test = job["inputs"][i]
    if mode == "stdio":
        data = test.encode("utf-8", "surrogatepass")
        if hasattr(os, "memfd_create"):
            in_fd = os.memfd_create("stdin")
        else:  # pragma: no cover - kernels < 3.17
            in_fd = os.open("/tmp", os.O_TMPFILE | os.O_RDWR, 0o600)
        view = memoryview(data)
        while view:
            view = view[os.write(in_fd, view):]
        os.lseek(in_fd, 0, os.SEEK_SET)
    else:
        in_fd = os.open("/dev/null", os.O_RDONLY)
    r_out, w_out = os.pipe()
    r_err, w_err = os.pipe()
    r_res, w_res = os.pipe()
    for attempt in range(50):  # EAGAIN while the previous test's processes are still being reaped
        try:
            pid = os.fork()
            break
        except BlockingIOError:
            time.sleep(0.02)
    else:
        raise OSError("fork failed repeatedly (process limit reached)")
    if pid == 0:
        rc = 121
        try:
            os.setsid()
            os.dup2(in_fd, 0)
            os.dup2(w_out, 1)
            os.dup2(w_err, 2)
            os.dup2(w_res, RESULT_FD)
            os.closerange(RESULT_FD + 1, 65536)
            _set_limits(lim)
            _fresh_stdio()
            rc = _run_child(code, job, test)
        finally:
            os._exit(rc)
    for fd in (in_fd, w_out, w_err, w_res):
        os.close(fd)
    return pid, r_out, r_err, r_res


def _kill_rest(pid, pid_ns):
    """SIGKILL what the test left behind: every other process of the sandbox, or the child's session."""
    if pid_ns and os.getpid() == 2:  # we are bwrap's command inside a new PID namespace (init is 1)
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
    else:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass


def _run_test(code, job, i, lim):
    t0 = time.monotonic()
    deadline = t0 + lim["wall_s"]
    pid, r_out, r_err, r_res = _spawn(code, job, i, lim)
    caps = {r_out: lim["out_bytes"], r_err: lim["out_bytes"], r_res: lim["out_bytes"]}
    bufs = {r_out: bytearray(), r_err: bytearray(), r_res: bytearray()}
    sizes = {r_out: 0, r_err: 0, r_res: 0}
    open_fds = set(bufs)
    pidfd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None
    timed_out = out_limited = exited = False
    status = None
    while True:
        now = time.monotonic()
        if now >= deadline:
            timed_out = True
            break
        watch = list(open_fds) + ([pidfd] if pidfd is not None else [])
        wait = deadline - now if pidfd is not None else min(0.05, deadline - now)
        ready, _, _ = select.select(watch, [], [], wait)
        for fd in ready:
            if fd == pidfd:
                exited = True
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                open_fds.discard(fd)
                continue
            sizes[fd] += len(chunk)
            if fd == r_err:
                bufs[fd] += chunk
                del bufs[fd][: max(0, len(bufs[fd]) - lim["err_bytes"])]  # keep the tail
            elif len(bufs[fd]) < caps[fd]:
                bufs[fd] += chunk[: caps[fd] - len(bufs[fd])]
            if sizes[fd] > caps[fd]:
                out_limited = True
        if out_limited:
            break
        if pidfd is None:
            done, status = os.waitpid(pid, os.WNOHANG)
            exited = done == pid
        if exited:
            break
    if timed_out or out_limited:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    else:  # exited: collect what is already in the pipes (a grandchild may still hold them open)
        for fd in list(open_fds):
            os.set_blocking(fd, False)
            try:
                while sizes[fd] <= caps[fd]:
                    chunk = os.read(fd, 1 << 16)
                    if not chunk:
                        break
                    sizes[fd] += len(chunk)
                    if fd != r_err and len(bufs[fd]) < caps[fd]:
                        bufs[fd] += chunk[: caps[fd] - len(bufs[fd])]
                    elif fd == r_err:
                        bufs[fd] += chunk
                        del bufs[fd][: max(0, len(bufs[fd]) - lim["err_bytes"])]
            except BlockingIOError:
                pass
    _, status, usage = os.wait4(pid, 0)
    wall = time.monotonic() - t0
    _kill_rest(pid, job.get("pid_ns", False))
    for fd in (r_out, r_err, r_res) + ((pidfd,) if pidfd is not None else ()):
        os.close(fd)
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    cpu = usage.ru_utime + usage.ru_stime
    soft = max(1, int(lim["cpu_s"] + 0.999))
    if not out_limited and (sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= 0.9 * soft)):
        timed_out = True  # the CPU-time limit fired (soft: SIGXCPU, hard: SIGKILL)
    return {
        "i": i,
        "rc": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "sig": sig,
        "timeout": timed_out,
        "olimit": out_limited and not timed_out,
        "out": bytes(bufs[r_out]).decode("utf-8", "replace"),
        "err": bytes(bufs[r_err]).decode("utf-8", "replace"),
        "res": bytes(bufs[r_res]).decode("utf-8", "replace") if sizes[r_res] else None,
        "cpu": round(cpu, 4),
        "wall": round(wall, 4),
    }


def _not_dumpable():
    """PR_SET_DUMPABLE 0: programs (same uid) cannot ptrace this process or open its /proc/PID/fd."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)
    except Exception:
        pass


def main():
    _not_dumpable()
    job = _read_job()
    out_fd = os.dup(1)  # the report channel to the host
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    lim = job["limits"]
    if job.get("pid_ns") and lim.get("nproc"):
        # counted per (user namespace, uid): every process of this sandbox, the supervisor included
        resource.setrlimit(resource.RLIMIT_NPROC, (lim["nproc"], lim["nproc"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:
        code = compile(job["program"], "solution.py", "exec")
    except (SyntaxError, ValueError, OverflowError, MemoryError, RecursionError) as exc:
        _emit(out_fd, {"compile_error": "%s: %s" % (type(exc).__name__, exc)})
        return
    for i in range(len(job["inputs"])):
        _emit(out_fd, _run_test(code, job, i, lim))
    _emit(out_fd, {"done": True})


if __name__ == "__main__":
    main()
