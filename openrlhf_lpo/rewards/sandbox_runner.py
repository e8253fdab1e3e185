# LPO_SANDBOX_RUNNER: the supervisor that runs one model-written program against its test inputs.
"""In-sandbox supervisor of :mod:`openrlhf_lpo.rewards.sandbox` (stdlib only, Python >= 3.8).

This file is never imported by the trainer: the host reads its source and runs it as
``python -I -S -c <source>`` *inside* the sandbox (bubblewrap), where the project, the data and the
host's files are not mounted. It is the only code that touches the model's program:

1. read the job from stdin in two length-prefixed frames: first the program, the mode (``stdio`` /
   ``call`` / ``assert``), the test inputs (never the expected outputs: those stay with the host) and
   the limits; then, read only after the assert mode's program process exists, the test code;
2. compile the program once (a syntax error ends the job);
3. per test, ``fork`` a child that sets its rlimits (CPU, address space, file size, open files, no
   core), gets a fresh stdin (the test input in a memfd) and stdout/stderr pipes, and executes the
   program as ``__main__``; in ``call`` mode it then calls the named function and writes the JSON of
   the return value to fd 3;
4. ``assert`` mode (HumanEval/MBPP test code) runs two processes: the *program* process executes the
   model's code and answers calls; the *harness* process runs the test code and never executes model
   code. The harness sees the program's functions as proxies: each call sends plain-data arguments
   over a pipe and gets the return value back as plain data (None, bool, int, float, complex, str,
   bytes, and tuples/lists/sets/dicts of them), rebuilt from JSON into genuine built-in objects, so every
   ``==``, ``bool()`` and ``repr()`` in the asserts is Python's own. Anything else comes back as an
   opaque :class:`ProgramObject` that can only be passed back to the program. The program process was
   forked before the test code entered this process, so the expected values are never in its memory;
   the harness (not dumpable: no ptrace, no ``/proc/<pid>/mem``) writes its verdict with a nonce the
   program never saw to a pipe only it holds. Patching builtins, ``sys.exit``/``os._exit``, ``atexit``,
   ``sys.settrace``, printing markers or killing processes changes nothing the harness relies on;
5. the supervisor reads the pipes with a byte budget (over budget: SIGKILL) until the test ends or
   its time limit passes (SIGKILL), reports one JSON line per test on its original stdout, then
   SIGKILLs every other process of the sandbox (``kill(-1)``, inside a PID namespace or as a uid of
   its own) so nothing a test started survives into the next test.

The wall-clock limit counts elapsed time minus the time the program's processes waited for a CPU
(``/proc/<pid>/schedstat``), so an oversubscribed machine does not time out a correct program; an
absolute cap still bounds each test. The host compares outputs with the expected values; this file
never sees them (except the assert format's test code, kept in the harness).
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
CHUNK = 1 << 16
_ACTIVE = set()  # test processes not reaped yet
_LIMITS = {}


class ForkFailed(OSError):
    """The process limit left no room for a test's process (reported as a sandbox error)."""


def _emit(fd, obj):
    data = (json.dumps(obj) + "\n").encode("utf-8", "surrogatepass")
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd, n):
    parts, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("the job ended early")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _read_frame(fd=0):
    """One ``<length>\\n<bytes>`` frame, read exactly (nothing of the next frame enters this process)."""
    head = b""
    while not head.endswith(b"\n"):
        c = os.read(fd, 1)
        if not c or len(head) > 20:
            raise EOFError("no job frame")
        head += c
    return json.loads(_read_exact(fd, int(head)).decode("utf-8", "surrogatepass"))


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


# -- plain data across the assert format's process boundary --------------------------------------------


class NotPlainData(BaseException):
    """The tests used a program object as a value, or the program process sent something that is not
    plain data; a BaseException, so a test's ``except Exception`` (or ``except ValueError``) cannot
    mistake it for an exception the tests expect from the program."""


class ProgramObject:
    """A value of the program that is not plain data: opaque, only usable as an argument of another
    call into the program. It equals only itself; truth value, order, arithmetic, length, iteration,
    indexing and attributes raise :class:`NotPlainData`."""

    __slots__ = ("handle", "type_name", "_channel")

    def __init__(self, handle, type_name, channel):
        self.handle, self.type_name, self._channel = handle, type_name, channel

    def __call__(self, *args, **kwargs):
        return self._channel.call({"h": self.handle}, args, kwargs)

    def __eq__(self, other):
        return self is other

    def __ne__(self, other):
        return self is not other

    def __hash__(self):
        return id(self)

    def __repr__(self):
        return "<program object #%d of type %s>" % (self.handle, self.type_name)

    def __getattr__(self, name):
        raise NotPlainData("a %s object of the program has no attribute %r in the tests (not plain data)"
                           % (self.type_name, name))


def _not_plain(name):
    def refuse(self, *args):
        raise NotPlainData("a %s object of the program cannot be used with %s in the tests (not plain data)"
                           % (self.type_name, name))

    refuse.__name__ = name
    return refuse


for _name in ("__bool__", "__lt__", "__le__", "__gt__", "__ge__", "__len__", "__iter__", "__contains__",
              "__getitem__", "__int__", "__float__", "__index__", "__abs__", "__neg__", "__add__", "__radd__",
              "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__floordiv__", "__mod__"):
    setattr(ProgramObject, _name, _not_plain(_name))


def to_plain(value, other, depth=0):
    """``value`` as tagged JSON data; subclasses of the plain types become their base type's value
    (read with the base type's own methods; the type's real MRO decides, not a spoofed ``__class__``);
    ``other(value)`` encodes anything else."""
    t = type(value)
    if depth > 100:
        raise ValueError("value nested too deeply")
    if value is None or t is bool or t is str or t is int or t is float:  # JSON keeps NaN and infinities
        return value
    sub = lambda base: issubclass(t, base)  # noqa: E731
    if sub(int):
        return int.__int__(value)
    if sub(float):
        return float.__float__(value)
    if sub(str):
        return str.__str__(value)
    if sub(list):
        return [to_plain(v, other, depth + 1) for v in list.__iter__(value)]
    if sub(tuple):
        return {"t": [to_plain(v, other, depth + 1) for v in tuple.__iter__(value)]}
    if sub(dict):
        return {"d": [[to_plain(k, other, depth + 1), to_plain(v, other, depth + 1)] for k, v in dict.items(value)]}
    if sub(frozenset):
        return {"f": [to_plain(v, other, depth + 1) for v in frozenset.__iter__(value)]}
    if sub(set):
        return {"s": [to_plain(v, other, depth + 1) for v in set.__iter__(value)]}
    if sub(bytes):
        return {"b": bytes.hex(value)}
    if sub(complex):
        return {"c": [complex.real.__get__(value), complex.imag.__get__(value)]}
    return other(value)


def from_plain(data, handle, depth=0):
    """Tagged JSON data -> genuine built-in objects (``handle(id, type)`` for program objects); any other
    shape raises ValueError."""
    t = type(data)
    if depth > 100:
        raise ValueError("value nested too deeply")
    if data is None or t is bool or t is int or t is float or t is str:
        return data
    if t is list:
        return [from_plain(v, handle, depth + 1) for v in data]
    if t is dict and (len(data) == 1 or sorted(data) == ["h", "type"]):
        tag = "h" if "h" in data else next(iter(data))
        body = data[tag]
        if tag == "t" and type(body) is list:
            return tuple(from_plain(v, handle, depth + 1) for v in body)
        if tag == "s" and type(body) is list:
            return set(from_plain(v, handle, depth + 1) for v in body)
        if tag == "f" and type(body) is list:
            return frozenset(from_plain(v, handle, depth + 1) for v in body)
        if tag == "d" and type(body) is list and all(type(p) is list and len(p) == 2 for p in body):
            return dict((from_plain(k, handle, depth + 1), from_plain(v, handle, depth + 1)) for k, v in body)
        if tag == "b" and type(body) is str:
            return bytes.fromhex(body)
        if tag == "c" and type(body) is list and len(body) == 2:
            return complex(float(from_plain(body[0], handle)), float(from_plain(body[1], handle)))
        if tag == "h" and type(body) is int:
            return handle(body, str(data.get("type", "?"))[:100])
    raise ValueError("not plain data: %r" % (str(data)[:100],))


class _Channel:
    """Newline-delimited JSON over a pair of pipes, with a byte budget per message."""

    def __init__(self, read_fd, write_fd, cap):
        self.read_fd, self.write_fd, self.cap, self.buf = read_fd, write_fd, cap, b""

    def send(self, obj):
        data = (json.dumps(obj, ensure_ascii=True) + "\n").encode("ascii")
        view = memoryview(data)
        while view:
            view = view[os.write(self.write_fd, view):]

    def recv(self):
        """The next message, or None at end of file."""
        while b"\n" not in self.buf:
            if len(self.buf) > self.cap:
                raise NotPlainData("a message of more than %d bytes" % self.cap)
            chunk = os.read(self.read_fd, CHUNK)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            return json.loads(line.decode("ascii"))
        except ValueError:
            raise NotPlainData("an unreadable message") from None


class ProgramExited(BaseException):
    """The program's process ended (exit, crash or limit) while the tests needed it; a BaseException,
    so a test's ``except Exception`` does not swallow it."""


class ProgramError(Exception):
    """An exception raised in the program that is not a built-in exception type."""


def _exception(name, message):
    cls = getattr(builtins, name, None) if isinstance(name, str) else None
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except Exception:
            pass
    return ProgramError("%s: %s" % (str(name)[:100], message))


class _HarnessChannel(_Channel):
    """The harness's side: calls into the program process."""

    def call(self, target, args, kwargs):
        def no_object(v):
            if isinstance(v, ProgramObject):
                return {"h": v.handle}
            raise TypeError("the tests pass a %s to the program: the assert format sends plain data only"
                            % type(v).__name__)

        message = {"call": target, "args": to_plain(list(args), no_object), "kw": to_plain(dict(kwargs), no_object)}
        try:
            self.send(message)
        except OSError:
            raise ProgramExited("the program's process has ended") from None
        return self._answer(self.recv())

    def _answer(self, msg):
        if msg is None:
            raise ProgramExited("the program's process ended during a call")
        if type(msg) is not dict:
            raise ProgramExited("unreadable answer from the program")
        if "v" in msg:
            try:
                return from_plain(msg["v"], lambda h, name: ProgramObject(h, name, self))
            except (ValueError, TypeError, RecursionError, OverflowError):
                raise NotPlainData("the program sent something that is not plain data") from None
        if "raise" in msg:
            raise _exception(msg["raise"], str(msg.get("msg", ""))[:2000])
        raise ProgramExited("the program exited (%s)" % str(msg.get("exit", "?"))[:100])


class _Proxy:
    """A function of the program, as the tests see it."""

    __slots__ = ("_channel", "_name")

    def __init__(self, channel, name):
        self._channel, self._name = channel, name

    def __call__(self, *args, **kwargs):
        return self._channel.call(self._name, args, kwargs)

    def __repr__(self):
        return "<program function %s>" % self._name


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


def _program_globals():
    if not hasattr(builtins, "exit"):  # ``-S`` skips site, which defines exit()/quit()
        builtins.exit = builtins.quit = _quit
    return {"__name__": "__main__", "__builtins__": builtins, "__file__": "solution.py"}


def _run_child(code, job, test):
    """Runs in the forked child (stdio / call mode); returns the exit status."""
    g = _program_globals()
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
            _finish_like_python()
            return 0
        except SystemExit as exc:
            rc = _exit_code(exc)
            _finish_like_python()
            return rc
    except BaseException:
        _print_traceback()
        return 1


def _print_traceback():
    try:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
    except BaseException:
        pass


def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass


def _serve_program(code, channel):
    """The assert format's program process: run the program when the harness asks, then answer calls."""
    if channel.recv() is None:
        return 0
    g = _program_globals()
    objects = {}

    def keep(value):
        objects[len(objects) + 1] = value
        try:
            name = str(type(value).__name__)[:100]
        except BaseException:
            name = "?"
        return {"h": len(objects), "type": name}

    def answer(fn):
        try:
            value = fn()
            _flush()  # the program's output reaches its pipes before the harness may end the test
            channel.send({"v": to_plain(value, keep)})
        except SystemExit as exc:
            channel.send({"exit": _exit_code(exc)})
            raise
        except BaseException as exc:
            _print_traceback()
            try:
                channel.send({"raise": type(exc).__name__, "msg": str(exc)[:2000]})
            except BaseException:
                channel.send({"raise": "Exception", "msg": "unprintable exception"})

    try:
        answer(lambda: exec(code, g))
        channel.send({"v": to_plain(sorted(n for n, v in g.items() if not n.startswith("__") and callable(v)), keep)})
        while True:
            msg = channel.recv()
            if msg is None:
                return 0

            def call(msg=msg):
                target = msg["call"]
                fn = objects[target["h"]] if isinstance(target, dict) else g[target]
                resolve = lambda h, name: objects[h]  # noqa: E731
                args = from_plain(msg["args"], resolve)
                kwargs = from_plain(msg["kw"], resolve)
                return fn(*args, **kwargs)

            answer(call)
    except SystemExit as exc:
        return _exit_code(exc)


def _run_harness(job, secret, channel, nonce):
    """The assert format's harness process (never runs model code): the test code against proxies."""
    channel.send({"start": True})
    channel._answer(channel.recv())  # the program ran (its exception, exit or crash fails the test here)
    names = channel._answer(channel.recv())  # its top-level functions and classes
    if type(names) is not list or not all(type(n) is str and n.isidentifier() for n in names):
        raise ProgramExited("unreadable answer from the program")
    g = {"__name__": "__main__", "__builtins__": builtins}
    for name in names:
        if not hasattr(builtins, name):  # a program's `abs` or `isinstance` must not replace the tests' own
            g[name] = _Proxy(channel, name)
    if job.get("prefix"):  # the prompt's own helpers and imports (trusted), not the program's versions
        exec(compile(job["prefix"], "<prompt>", "exec"), g)
    entry = job.get("entry_point")
    if entry:
        if entry not in names:
            raise NameError("the program defines no %r" % entry)
        g[entry] = _Proxy(channel, entry)
    exec(compile(secret["test_code"], "<tests>", "exec"), g)
    if entry and callable(g.get("check")):
        g["check"](g[entry])
    os.write(RESULT_FD, ("PASSED " + nonce).encode())
    return 0


def _fork():
    for attempt in range(50):  # EAGAIN while another sandbox sharing our count has its processes reaped
        try:
            pid = os.fork()
        except BlockingIOError:
            time.sleep(0.02)
            continue
        if pid:
            _ACTIVE.add(pid)
        return pid
    raise ForkFailed("fork failed repeatedly (process limit reached)")


def _child(fds, lim, body):
    """In a forked child: new session, ``fds[i]`` becomes fd ``i``, everything else closed, limits set;
    ``body()`` returns the exit status."""
    rc = 121
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.setsid()
        # move the sources above every target first, so that no dup2 overwrites a source still needed
        high = [os.dup(fd) for fd in fds]
        for target, fd in enumerate(high):
            os.dup2(fd, target)
        os.closerange(len(fds), 65536)
        _set_limits(lim)
        _drop(lim)
        _fresh_stdio()
        rc = body()
    except BaseException:
        _print_traceback()
        rc = 1
    finally:
        os._exit(rc)


def _drop(lim):
    """Without a sandbox the runner may be root: test processes run as the slot's unprivileged uid."""
    uid = lim.get("drop_uid")
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        if os.getuid() != uid or os.geteuid() != uid:
            raise SystemExit("could not drop privileges")


def _stdin_fd(test):
    data = test.encode("utf-8", "surrogatepass")
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("stdin")
    else:  # pragma: no cover - kernels < 3.17
        fd = os.open("/tmp", os.O_TMPFILE | os.O_RDWR, 0o600)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _run_delay(pid):
    """Seconds ``pid`` has spent runnable but waiting for a CPU (None when unknown)."""
    try:
        with open("/proc/%d/schedstat" % pid, "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


class _Watch:
    """Supervise the processes of one test: pipes with byte budgets, CPU and wall-clock limits."""

    def __init__(self, lim, pids, main, streams):
        self.lim, self.pids, self.main = lim, list(pids), main
        self.streams = streams  # fd -> (bytes before the test is killed, bytes kept, keep the tail)
        self.bufs = {fd: bytearray() for fd in streams}
        self.sizes = {fd: 0 for fd in streams}
        self.pidfds = {}
        if hasattr(os, "pidfd_open"):
            for pid in self.pids:
                try:
                    self.pidfds[pid] = os.pidfd_open(pid)
                except OSError:
                    pass
        self.delay0 = {pid: _run_delay(pid) for pid in self.pids}
        self.waited = {pid: 0.0 for pid in self.pids}
        self.status, self.usage, self.killed = {}, {}, set()
        self.timed_out = self.out_limited = False

    def _take(self, fd, chunk):
        """Keep ``chunk``; True when the stream is over its limit."""
        limit, keep, tail = self.streams[fd]
        self.sizes[fd] += len(chunk)
        buf = self.bufs[fd]
        if tail:
            buf += chunk
            del buf[: max(0, len(buf) - keep)]
        elif len(buf) < keep:
            buf += chunk[: keep - len(buf)]
        return self.sizes[fd] > limit

    def _effective_elapsed(self, elapsed):
        """Elapsed time minus the CPU wait of the test's processes (``unqueued`` wall clock)."""
        if self.lim.get("wall_mode") != "unqueued":
            return elapsed
        for pid in self.pids:
            if pid in self.status or self.delay0.get(pid) is None:
                continue
            now = _run_delay(pid)
            if now is not None:
                self.waited[pid] = now - self.delay0[pid]
        return elapsed - sum(self.waited.values())

    def run(self):
        t0 = time.monotonic()
        wall, cap = self.lim["wall_s"], max(self.lim["wall_s"], self.lim.get("wall_cap_s", self.lim["wall_s"]))
        check = t0 + wall
        open_fds = set(self.streams)
        while self.main not in self.status:
            now = time.monotonic()
            if now >= check:
                elapsed = now - t0
                effective = self._effective_elapsed(elapsed)
                if effective >= wall or elapsed >= cap:
                    self.timed_out = True
                    break
                check = min(now + max(0.05, wall - effective), t0 + cap)
            live = [fd for pid, fd in self.pidfds.items() if pid not in self.status]
            wait = check - now if self.pidfds else min(0.05, check - now)
            ready, _, _ = select.select(list(open_fds) + live, [], [], max(0.0, wait))
            for fd in ready:
                if fd in self.streams:
                    chunk = os.read(fd, CHUNK)
                    if not chunk:
                        open_fds.discard(fd)
                    elif self._take(fd, chunk):
                        self.out_limited = True
            if self.out_limited:
                break
            self._reap(block=False)
        for pid in self.pids:  # the test is over: nothing of it keeps running
            if pid not in self.status:
                self.killed.add(pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        if not (self.timed_out or self.out_limited):  # collect what is already in the pipes
            for fd in list(open_fds):
                os.set_blocking(fd, False)
                try:
                    while self.sizes[fd] <= self.streams[fd][0]:
                        chunk = os.read(fd, CHUNK)
                        if not chunk or self._take(fd, chunk):
                            break
                except BlockingIOError:
                    pass
        self._reap(block=True)
        for fd in self.pidfds.values():
            os.close(fd)
        return time.monotonic() - t0

    def _reap(self, block):
        for pid in self.pids:
            if pid in self.status:
                continue
            got, status, usage = os.wait4(pid, 0 if block else os.WNOHANG)
            if got == pid:
                self.status[pid], self.usage[pid] = status, usage
                _ACTIVE.discard(pid)

    def cpu(self, pid=None):
        pids = [pid] if pid is not None else self.pids
        return sum(self.usage[p].ru_utime + self.usage[p].ru_stime for p in pids if p in self.usage)

    def cpu_limited(self, pid):
        """The CPU-time limit ended ``pid`` (soft: SIGXCPU, hard: SIGKILL)."""
        status = self.status.get(pid)
        if status is None or not os.WIFSIGNALED(status) or (pid in self.killed and not self.timed_out):
            return False
        sig = os.WTERMSIG(status)
        soft = max(1, int(self.lim["cpu_s"] + 0.999))
        return sig == signal.SIGXCPU or (sig == signal.SIGKILL and self.cpu(pid) >= 0.9 * soft)

    def text(self, fd):
        return bytes(self.bufs[fd]).decode("utf-8", "replace")


def _outcome(i, watch, pid, wall, out, err, res):
    status = watch.status[pid]
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    timed_out = watch.timed_out or any(watch.cpu_limited(p) for p in watch.pids)
    timed_out = timed_out and not watch.out_limited
    return {
        "i": i,
        "rc": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "sig": sig,
        "timeout": timed_out,
        "olimit": watch.out_limited and not timed_out,
        "out": out,
        "err": err,
        "res": res,
        "cpu": round(watch.cpu(), 4),
        "wall": round(wall, 4),
    }


def _run_test(code, job, i, lim):
    """stdio / call mode: one child runs the program on input ``i``."""
    test = job["inputs"][i]
    in_fd = _stdin_fd(test) if job["mode"] == "stdio" else os.open("/dev/null", os.O_RDONLY)
    r_out, w_out = os.pipe()
    r_err, w_err = os.pipe()
    r_res, w_res = os.pipe()
    try:
        pid = _fork()
    except ForkFailed:
        for fd in (in_fd, r_out, w_out, r_err, w_err, r_res, w_res):
            os.close(fd)
        raise
    if pid == 0:
        _child([in_fd, w_out, w_err, w_res], lim, lambda: _run_child(code, job, test))
    for fd in (in_fd, w_out, w_err, w_res):
        os.close(fd)
    out, err = lim["out_bytes"], lim["err_bytes"]
    watch = _Watch(lim, [pid], pid, {r_out: (out, out, False), r_err: (out, err, True), r_res: (out, out, False)})
    wall = watch.run()
    _kill_rest([pid], lim)
    for fd in (r_out, r_err, r_res):
        os.close(fd)
    res = watch.text(r_res) if watch.sizes[r_res] else None
    return _outcome(i, watch, pid, wall, watch.text(r_out), watch.text(r_err), res)


def _run_assert(code, job, lim):
    """assert mode: the program process, then (after reading the test code) the harness process."""
    req_r, req_w = os.pipe()  # harness -> program
    rep_r, rep_w = os.pipe()  # program -> harness
    r_out, w_out = os.pipe()
    r_err, w_err = os.pipe()
    null = os.open("/dev/null", os.O_RDONLY)
    cap = 8 * lim["out_bytes"]
    prog = _fork()
    if prog == 0:  # before the test code is read: it never enters this process's memory
        _child([null, w_out, w_err, req_r, rep_w], lim, lambda: _serve_program(code, _Channel(3, 4, cap)))
    for fd in (w_out, w_err, req_r, rep_w):
        os.close(fd)
    secret = _read_frame(0)
    nonce = os.urandom(16).hex()
    r_h, w_h = os.pipe()  # the harness's stdout and stderr
    r_v, w_v = os.pipe()  # its verdict
    try:
        harness = _fork()
    except ForkFailed:
        os.kill(prog, signal.SIGKILL)
        os.waitpid(prog, 0)
        raise
    if harness == 0:
        _child([null, w_h, w_h, w_v, req_w, rep_r], lim,
               lambda: _run_harness(job, secret, _HarnessChannel(5, 4, cap), nonce))
    secret = None
    for fd in (null, w_h, w_v, req_w, rep_r):
        os.close(fd)
    out, err = lim["out_bytes"], lim["err_bytes"]
    streams = {r_out: (out, out, False), r_err: (out, err, True), r_h: (out, err, True), r_v: (64, 64, False)}
    watch = _Watch(lim, [prog, harness], harness, streams)
    wall = watch.run()
    _kill_rest([harness, prog], lim)
    for fd in streams:
        os.close(fd)
    verdict = watch.text(r_v) == "PASSED " + nonce
    message = (watch.text(r_err) + watch.text(r_h))[-err:]
    return _outcome(0, watch, harness, wall, watch.text(r_out), message, ASSERT_PASSED if verdict else None)


def _kill_rest(pids, lim):
    """SIGKILL what the test left behind: every other process of the sandbox (in a PID namespace, or
    as a uid no other sandbox uses), else the test processes' sessions; then reap them."""
    everything = lim.get("kill_all") and (not lim.get("pid_ns") or os.getpid() == 2)
    if everything and lim.get("drop_uid") is not None:  # never kill(-1) as root: as the slot's uid
        try:
            killer = os.fork()
        except OSError:
            killer = None
        if killer == 0:
            try:
                _drop(lim)
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
        if killer:
            os.waitpid(killer, 0)
    elif everything:
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
    else:
        for p in pids:
            for kill in (os.killpg, os.kill):
                try:
                    kill(p, signal.SIGKILL)
                except OSError:
                    pass
    _reap_orphans(2.0 if everything else 0.0)


def _reap_orphans(wait_s):
    """Reap the killed processes (this is their subreaper): RLIMIT_NPROC counts a process until it is
    reaped, so the next test's fork must not wait for some init to get round to it."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        _ACTIVE.discard(pid)
        if pid == 0:
            if time.monotonic() >= deadline:
                return
            time.sleep(0.002)


def _prctl_setup():
    """PR_SET_DUMPABLE 0: programs (same uid) cannot ptrace this process or open its /proc/PID/fd;
    PR_SET_CHILD_SUBREAPER 1: orphaned program processes are reparented here, to be reaped."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(4, 0, 0, 0, 0)
        libc.prctl(36, 1, 0, 0, 0)
    except Exception:
        pass


def _on_term(signum, frame):
    """The host ends this sandbox early (no PID namespace to tear down): take every test process along."""
    _kill_rest(list(_ACTIVE), _LIMITS)
    os._exit(143)


def main():
    _prctl_setup()
    job = _read_frame(0)
    out_fd = os.dup(1)  # the report channel to the host
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 1)
    lim = job["limits"]
    _LIMITS.update(lim)
    signal.signal(signal.SIGTERM, _on_term)
    if lim.get("nproc"):
        # bwrap: counted per (user namespace, uid) on kernels >= 5.14, else per host uid (one per slot as root)
        resource.setrlimit(resource.RLIMIT_NPROC, (lim["nproc"], lim["nproc"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:
        code = compile(job["program"], "solution.py", "exec")
    except (SyntaxError, ValueError, OverflowError, MemoryError, RecursionError) as exc:
        _emit(out_fd, {"compile_error": "%s: %s" % (type(exc).__name__, exc)})
        return
    try:
        if job["mode"] == "assert":
            _emit(out_fd, _run_assert(code, job, lim))  # reads the test-code frame itself
        else:
            _read_frame(0)
            os.dup2(null, 0)
            for i in range(len(job["inputs"])):
                _emit(out_fd, _run_test(code, job, i, lim))
    except ForkFailed as exc:
        _emit(out_fd, {"error": str(exc)})
        return
    _emit(out_fd, {"done": True})


if __name__ == "__main__":
    main()
