"""How many sandboxes a node runs and how many processes each may have (host side of the code reward).

* **Workers** (concurrent sandboxes per engine process, :func:`sandbox_workers`): every rollout engine
  is a process with its own pool, and each engine's vLLM engine-core process keeps a core busy while it
  generates, so a node with ``C`` usable cores (CPU affinity and the cgroup CPU quota, not the host's
  core count) and ``E`` engines gives each engine ``max(1, (C - E) // E)`` sandboxes; without engines
  (evaluation, tests) all ``C``.
* **Process budgets** (``RLIMIT_NPROC``): the kernel counts it per (user namespace, uid) since Linux
  5.14, but per *host* uid before (RHEL 8, Ubuntu 20.04, Amazon Linux 2) and always without a user
  namespace (``LPO_CODE_SANDBOX=none``). As root, every slot of every pool on the node therefore runs as
  a host uid of its own from ``LPO_CODE_UIDS`` (:class:`UidLeases`: a uid is held by binding the
  abstract UNIX socket ``@lpo-code-uid-<uid>``, unique per network namespace and released when the
  process dies; the start of the search is random, so pods in separate network namespaces rarely
  collide in a large range). Where slots must share a uid (non-root; the range unusable in this
  container), the start-up probe (:data:`HOLDER_PROGRAM`, :data:`COUNT_PROGRAM`) measures whether
  another sandbox's processes eat this sandbox's budget; if so the limit is sized to the node
  (:func:`shared_nproc_limit`) and a fork that still fails is a sandbox error (reward 0, logged).
"""

from __future__ import annotations

import math
import os
import random
import socket
from typing import List, Optional, Tuple

__all__ = [
    "DEFAULT_UIDS",
    "MAX_UID",
    "usable_cores",
    "sandbox_workers",
    "parse_uid_range",
    "UidLeases",
    "tasks_of_uid",
    "shared_nproc_limit",
    "budget_is_isolated",
    "HOLDER_PROGRAM",
    "COUNT_PROGRAM",
    "stop_holder",
]

DEFAULT_UIDS = "2100000000-2100999999"  # above SSSD's default id-mapping range (up to 2000200000)
MAX_UID = 2**31 - 2  # bwrap writes uid maps as signed ints: larger uids fail with EINVAL


def _cgroup_paths(proc_cgroup: str) -> Tuple[List[str], List[str]]:
    """This process's cgroup v2 path and v1 ``cpu`` paths from ``/proc/self/cgroup`` text."""
    v2, v1 = [], []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2.append(parts[2])
        elif "cpu" in parts[1].split(","):
            v1.append(parts[2])
    return v2, v1


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup", proc_cgroup: Optional[str] = None) -> Optional[float]:
    """The tightest CFS CPU quota (in cores) of this process's cgroups, v2 ``cpu.max`` or v1
    ``cpu.cfs_quota_us / cpu.cfs_period_us``; None when unlimited or unreadable."""
    if proc_cgroup is None:
        proc_cgroup = _read("/proc/self/cgroup") or ""
    v2, v1 = _cgroup_paths(proc_cgroup)
    quotas = []
    dirs2 = {root}
    for path in v2:  # the cgroup and its ancestors (a container usually sees its own as the root)
        parts = [p for p in path.split("/") if p]
        dirs2.update(os.path.join(root, *parts[:i]) for i in range(len(parts) + 1))
    for d in dirs2:
        text = _read(os.path.join(d, "cpu.max"))
        if text and not text.startswith("max"):
            q, _, period = text.partition(" ")
            if q.isdigit() and period.strip().isdigit() and int(period) > 0:
                quotas.append(int(q) / int(period))
    for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        for path in ["/"] + v1:
            d = os.path.join(root, mount, *[p for p in path.split("/") if p])
            q, period = _read(os.path.join(d, "cpu.cfs_quota_us")), _read(os.path.join(d, "cpu.cfs_period_us"))
            if q and period and q.lstrip("-").isdigit() and period.isdigit() and int(q) > 0 and int(period) > 0:
                quotas.append(int(q) / int(period))
    return min(quotas) if quotas else None


def usable_cores(root: str = "/sys/fs/cgroup", proc_cgroup: Optional[str] = None) -> int:
    """Cores this process may use: its CPU affinity, capped by the cgroup CPU quota (a container on a
    192-core host with a 32-CPU limit gets 32; ``os.cpu_count()`` would say 192)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = cgroup_cpu_quota(root, proc_cgroup)
    if quota is not None:
        n = min(n, max(1, math.ceil(quota - 1e-9)))
    return max(1, n)


def sandbox_workers(cores: int, engines_per_node: int) -> int:
    """Concurrent sandboxes per engine process: ``max(1, (cores - E) // E)`` for ``E`` engines per node
    (one core per engine stays with its vLLM engine-core process), or all cores when ``E`` is 0."""
    if engines_per_node <= 0:
        return max(1, cores)
    return max(1, (cores - engines_per_node) // engines_per_node)


def parse_uid_range(text: str) -> Tuple[int, int]:
    """``"FIRST-LAST"`` (inclusive) or ``"UID"`` -> ``(first, last)``; ValueError says what is wrong."""
    raw = text.strip()
    first_s, sep, last_s = raw.partition("-")
    try:
        first = int(first_s)
        last = int(last_s) if sep else first
    except ValueError:
        raise ValueError(f"LPO_CODE_UIDS={text!r} must be FIRST-LAST (host uids) or one uid") from None
    if not 0 < first <= last <= MAX_UID:
        raise ValueError(f"LPO_CODE_UIDS={text!r}: need 0 < FIRST <= LAST <= {MAX_UID}")
    return first, last


class UidLeases:
    """Host uids held by this process, each unique among the processes of this network namespace."""

    def __init__(self, first: int, last: int, avoid=()):
        self.first, self.last = first, last
        self.avoid = set(avoid) | {0}
        self._held = {}  # uid -> bound socket

    @staticmethod
    def _name(uid: int) -> str:
        return f"\0lpo-code-uid-{uid}"

    def lease(self, n: int, max_tries: int = 4096) -> List[int]:
        """``n`` more uids (fewer when the range is exhausted)."""
        size = self.last - self.first + 1
        start = random.SystemRandom().randrange(size)
        got = []
        for k in range(min(size, max_tries)):
            if len(got) == n:
                break
            uid = self.first + (start + k) % size
            if uid in self.avoid or uid in self._held:
                continue
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.bind(self._name(uid))
            except OSError:
                s.close()
                continue
            s.set_inheritable(False)
            self._held[uid] = s
            got.append(uid)
        return got

    def release(self, uid: int) -> None:
        s = self._held.pop(uid, None)
        if s is not None:
            s.close()

    def close(self) -> None:
        for uid in list(self._held):
            self.release(uid)

    @property
    def held(self) -> List[int]:
        return sorted(self._held)


def tasks_of_uid(uid: int) -> int:
    """Tasks (threads) whose real uid is ``uid`` on this machine, as RLIMIT_NPROC counts them per host uid."""
    total = 0
    try:
        entries = os.listdir("/proc")
    except OSError:
        return 0
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", "rb") as f:
                text = f.read()
        except OSError:
            continue
        real = threads = None
        for line in text.splitlines():
            if line.startswith(b"Uid:"):
                real = int(line.split()[1])
            elif line.startswith(b"Threads:"):
                threads = int(line.split()[1])
        if real == uid:
            total += threads or 1
    return total


def shared_nproc_limit(uid: int, nproc: int, node_slots: int) -> int:
    """RLIMIT_NPROC where sandboxes share one count: what the uid runs now plus ``nproc`` for every
    sandbox the node may run at once."""
    return tasks_of_uid(uid) + nproc * max(1, node_slots)


def budget_is_isolated(forks: Optional[int], nproc: int, held: int) -> bool:
    """The probe's verdict: a sandbox limited to ``nproc`` processes forked ``forks`` children while
    another sandbox's uid held ``held``. Isolated budgets leave it ``nproc`` minus its own few
    processes (bwrap's init, the runner, the program); a shared count takes ``held`` away."""
    return forks is not None and forks >= nproc - 4 - held // 2


# holds argv[1] processes as the uid of another sandbox until its stdin closes (prints how many), then
# ends and reaps them: a zombie left to an init that does not reap would count against the uid for good
HOLDER_PROGRAM = (
    "import os, sys\n"
    "r, w = os.pipe()\n"
    "held = 0\n"
    "for _ in range(int(sys.argv[1])):\n"
    "    try:\n"
    "        pid = os.fork()\n"
    "    except OSError:\n"
    "        break\n"
    "    if pid == 0:\n"
    "        os.close(w)\n"
    "        os.read(r, 1)\n"
    "        os._exit(0)\n"
    "    held += 1\n"
    "print(held, flush=True)\n"
    "sys.stdin.read()\n"
    "os.close(w)\n"
    "while True:\n"
    "    try:\n"
    "        os.wait()\n"
    "    except ChildProcessError:\n"
    "        break\n"
)


def stop_holder(holder) -> None:
    """Close a :data:`HOLDER_PROGRAM`'s stdin and wait for it (SIGKILL its group after 10 s)."""
    import signal
    import subprocess

    try:
        holder.stdin.close()
        holder.wait(timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        try:
            os.killpg(holder.pid, signal.SIGKILL)
        except OSError:
            pass
        holder.wait()
    if holder.stdout is not None:
        holder.stdout.close()

# inside a sandbox: how many children it can fork (at most nproc + 8)
COUNT_PROGRAM = (
    "import os\n"
    "r, w = os.pipe()\n"
    "n = 0\n"
    "try:\n"
    "    for _ in range({limit}):\n"
    "        if os.fork() == 0:\n"
    "            os.close(w)\n"
    "            os.read(r, 1)\n"
    "            os._exit(0)\n"
    "        n += 1\n"
    "except OSError:\n"
    "    pass\n"
    "print(n)\n"
)
