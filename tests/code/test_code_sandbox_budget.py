"""Process budgets and host uids of the sandbox pool: a host uid per slot as root, ``LPO_CODE_SANDBOX=none``
as root drops privileges, the start-up probe's verdict on a shared process count, "fork failed" as a
sandbox error, and the worker sizing.

Kernels before 5.14 count RLIMIT_NPROC per host uid; this machine runs a 6.x kernel, where bubblewrap's
user namespace counts per sandbox. The old kernels' situation is real here without a user namespace:
``LPO_CODE_SANDBOX=none`` counts per host uid on every kernel, so a pool whose slots share one uid
(``LPO_CODE_UIDS`` = a single uid) shows exactly the shared count the probe must detect.
"""

import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid

import pytest

from code_helpers import REPO, assert_pool_healthy, sandbox_processes, wait_no_sandbox_processes
from openrlhf_lpo.rewards import sandbox_budget as budget
from openrlhf_lpo.rewards.code import grade_code, grade_program
from openrlhf_lpo.rewards.sandbox import CodeSandbox, SandboxConfig

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to other host uids needs root (CI runs as root)")
COUNT = budget.COUNT_PROGRAM.format(limit=300)


def forks(box, program=COUNT) -> int:
    report = box.run(program, "stdio", [""])
    return int(report.outcomes[0].stdout)


def real_uid(pid: int):
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
    except (OSError, StopIteration):
        return None


@pytest.fixture(scope="module")
def none_box():
    """LPO_CODE_SANDBOX=none as root: a host uid per slot, RLIMIT_NPROC per host uid."""
    box = CodeSandbox(SandboxConfig(mode="none", timeout_s=1.0, workers=2))
    box.ensure_ready()
    return box


@root_only
def test_each_slot_runs_as_its_own_host_uid(box):
    """bwrap as root: two concurrent sandboxes run as two different host uids of LPO_CODE_UIDS, so every
    kernel gives each its own RLIMIT_NPROC count (kernels < 5.14 count per host uid)."""
    first, last = budget.parse_uid_range(box.config.uids)
    slot_uids = {s.uid for s in box.slots}
    assert len(slot_uids) == 2 and all(first <= u <= last for u in slot_uids) and all(s.own_uid for s in box.slots)
    seen, stop = set(), threading.Event()

    def watch():
        while not stop.is_set():
            seen.update(real_uid(pid) for pid in sandbox_processes())
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        threads = [threading.Thread(target=box.run, args=("import time\ntime.sleep(1.5)\n", "stdio", [""]))
                   for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        stop.set()
        watcher.join()
    assert seen - {None} == slot_uids  # bwrap and everything in the sandbox, as seen from the host
    assert "isolated" in box.budget_note and not box.shared_budget
    assert_pool_healthy(box)


@root_only
def test_none_mode_as_root_cannot_write_root_files_or_signal_the_grader(none_box):
    root_dir = tempfile.mkdtemp(prefix="lpo-root-owned-")
    os.chmod(root_dir, 0o755)
    owned = os.path.join(root_dir, "checkpoint.pt")
    with open(owned, "w") as f:
        f.write("weights")
    os.chmod(owned, 0o644)
    grader = os.getpid()
    program = textwrap.dedent(f"""
        import errno, os, signal
        print(os.getuid(), os.geteuid(), os.getgid())
        for path in ({owned!r}, {os.path.join(root_dir, 'new')!r}, {str(REPO / ('pwned-' + uuid.uuid4().hex))!r}):
            try:
                open(path, 'a').write('x')
                print('WROTE')
            except OSError as e:
                print(errno.errorcode[e.errno])
        try:
            os.remove({owned!r})
            print('REMOVED')
        except OSError as e:
            print(errno.errorcode[e.errno])
        for pid in ({grader}, {os.getppid()}, 1):
            try:
                os.kill(pid, signal.SIGKILL)
                print('SIGNALLED')
            except OSError as e:
                print(errno.errorcode[e.errno])
    """)
    try:
        out = none_box.run(program, "stdio", [""]).outcomes[0].stdout.split("\n")
        uid, euid, gid = map(int, out[0].split())
        assert uid == euid == gid and uid in {s.uid for s in none_box.slots} and uid != 0
        assert out[1:8] == ["EACCES", "EACCES", "EACCES", "EACCES", "EPERM", "EPERM", "EPERM"], out
        with open(owned) as f:
            assert f.read() == "weights"
        # kill(-1) reaches only the program's own uid: the grader and the runner (root) live on
        result = grade_program("import os, signal\nos.kill(-1, signal.SIGKILL)\nprint(1)\n",
                               {"inputs": [""], "outputs": ["1"]}, sandbox=none_box)
        assert result.status == "ok" and os.getpid() == grader and os.getppid() > 1
    finally:
        import shutil

        shutil.rmtree(root_dir, ignore_errors=True)
    assert_pool_healthy(none_box)


@root_only
def test_none_mode_as_root_bounds_processes_and_reaps_daemons(none_box):
    n = forks(none_box)
    assert 0 < n <= 64 - 1  # RLIMIT_NPROC per host uid: the program + its forks (the runner stays root)
    daemon = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(60)\n"
              "    os._exit(0)\nprint('daemonized')\n")
    assert grade_program(daemon, {"inputs": [""], "outputs": ["daemonized"]}, sandbox=none_box).status == "ok"
    assert wait_no_sandbox_processes() == []  # the runner's kill(-1) as the slot's own uid took the daemon
    assert all(real_uid(p) not in {s.uid for s in none_box.slots} for p in map(int, filter(str.isdigit, os.listdir("/proc"))))
    assert_pool_healthy(none_box)


@root_only
def test_concurrent_sandboxes_have_their_own_budget(none_box):
    """While one sandbox holds every process its budget allows, a concurrent one still gets its whole
    budget (per-slot host uids, counted per host uid as on kernels < 5.14)."""
    holder = ("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(4)\n"
              "            os._exit(0)\n        n += 1\nexcept OSError:\n    pass\nprint(n)\ntime.sleep(2)\n")
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("holder", none_box.run(holder, "stdio", [""])))
    t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # wait until the holder's uid has its budget full
        counts = {}
        for p in sandbox_processes():
            counts[real_uid(p)] = counts.get(real_uid(p), 0) + 1
        if max(counts.values(), default=0) >= 60:
            break
        time.sleep(0.05)
    second = forks(none_box)
    t.join()
    held = int(got["holder"].outcomes[0].stdout)
    assert held >= 60 and second >= 60, (held, second)
    assert_pool_healthy(none_box)


@root_only
def test_probe_detects_a_shared_count_and_sizes_the_limit(capfd):
    """Slots forced onto one host uid without a user namespace: the probe sees another sandbox's processes
    eat the budget, says so at start, and sizes RLIMIT_NPROC to the node's sandboxes."""
    box = CodeSandbox(SandboxConfig(mode="none", timeout_s=1.0, workers=2, uids="2100000777"))
    box.ensure_ready()
    err = capfd.readouterr().err
    assert box.shared_budget and {s.uid for s in box.slots} == {2100000777}
    note = box.budget_note
    probe_forks = int(note.split("probe: ")[1].split(" ")[0])
    probe_held = int(note.split("held ")[1].split(";")[0])
    assert probe_held == 32 and probe_forks <= 64 - probe_held  # the holder's 32 came off this sandbox's 64
    assert "process budget: SHARED between sandboxes" in err and "sized to the node" in err
    n = forks(box)
    assert 64 < n <= 64 * box.node_slots() + 4  # the node-sized limit: honest programs are not starved
    assert_pool_healthy(box)


@root_only
def test_bwrap_counts_per_sandbox_even_on_one_shared_uid():
    """The same forced sharing under bubblewrap: kernels >= 5.14 count per user namespace (isolated)."""
    box = CodeSandbox(SandboxConfig(timeout_s=1.0, workers=2, uids="2100000778"))
    box.ensure_ready()
    assert not box.shared_budget and "isolated" in box.budget_note
    assert {s.uid for s in box.slots} == {2100000778} and not any(s.own_uid for s in box.slots)
    assert forks(box) <= 64 - 3
    assert_pool_healthy(box)


# a user-namespaced container (Kubernetes hostUsers: false, rootless Podman): root inside, 65536 uids mapped
IN_USERNS = textwrap.dedent(
    """
    import ctypes, os, sys
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(ready_w, b"1" if ctypes.CDLL(None, use_errno=True).unshare(0x10000000) == 0 else b"0")
        os.read(go_r, 1)
        os.execv(sys.executable, [sys.executable, "-c", sys.argv[1]])
    assert os.read(ready_r, 1) == b"1", "unshare(CLONE_NEWUSER) failed"
    for name in ("uid_map", "gid_map"):
        with open("/proc/%d/%s" % (pid, name), "w") as f:
            f.write("0 0 65536\\n")
    os.write(go_w, b"1")
    sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    """
)
USERNS_CHECK = textwrap.dedent(
    """
    from openrlhf_lpo.rewards.code import grade_code
    from openrlhf_lpo.rewards.sandbox import CodeSandbox, SandboxConfig
    box = CodeSandbox(SandboxConfig(timeout_s=1.0, workers=2))
    box.ensure_ready()
    print("UIDS", box.uid_note)
    print("BUDGET", box.budget_note)
    print("GRADED", grade_code("```python\\nprint(sum(map(int, input().split())))\\n```",
                               {"inputs": ["1 2\\n"], "outputs": ["3"]}, sandbox=box).status)
    """
)


@root_only
def test_unmapped_uids_fall_back_to_one_shared_uid(repo_env):
    """Inside a user namespace that maps only uids 0-65535 the default LPO_CODE_UIDS cannot be used: the
    pool falls back to uid 65534 for every slot, the probe finds the count still isolated (kernel >= 5.14),
    and programs are graded."""
    out = subprocess.run([sys.executable, "-c", IN_USERNS, USERNS_CHECK], capture_output=True, text=True,
                         env=repo_env, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.split(" ", 1)[0] in ("UIDS", "BUDGET", "GRADED"))
    assert lines["UIDS"].startswith("65534, shared by every slot (LPO_CODE_UIDS=2100000000-2100999999 failed here)")
    assert lines["BUDGET"].startswith("64 processes per sandbox, isolated") and lines["GRADED"] == "ok"
    assert "do not work here" in out.stderr  # logged


def test_fork_failure_is_a_sandbox_error_with_reward_zero(box, monkeypatch):
    """The runner cannot fork a test's process (as when other sandboxes exhaust a shared count on an old
    kernel; here its RLIMIT_NPROC is set to the 2 processes the sandbox already has): status ``error``,
    reward 0 in both modes, the reason in the detail, and the pool unharmed."""
    monkeypatch.setattr(box, "_nproc_for", lambda slot: 2)  # bwrap's init + the runner
    result = grade_code("```python\nprint(input())\n```", {"inputs": ["1\n", "2\n"], "outputs": ["1", "2"]}, sandbox=box)
    assert result.status == "error" and "fork failed" in result.detail, result
    assert result.reward("fraction") == 0.0 and result.reward("all") == 0.0
    assert box.stats["errors"] >= 1
    monkeypatch.undo()
    assert_pool_healthy(box)


def test_uid_leases_are_unique_per_node():
    first = 2100000900
    a, b = budget.UidLeases(first, first + 3), budget.UidLeases(first, first + 3)
    try:
        got_a = a.lease(3)
        got_b = b.lease(3)  # only one uid of the range is left
        assert len(got_a) == 3 and len(got_b) == 1 and not set(got_a) & set(got_b)
        assert set(got_a) | set(got_b) == set(range(first, first + 4))
        a.close()
        assert len(b.lease(3)) == 3 and sorted(b.held) == list(range(first, first + 4))
    finally:
        a.close()
        b.close()
    with pytest.raises(ValueError, match="LPO_CODE_UIDS='0-5': need 0 < FIRST"):
        budget.parse_uid_range("0-5")
    with pytest.raises(ValueError, match="must be FIRST-LAST"):
        budget.parse_uid_range("many")
    assert budget.parse_uid_range(" 65534 ") == (65534, 65534)
    with pytest.raises(ValueError, match="LPO_CODE_UIDS"):
        SandboxConfig(uids="3000000000-3000000010")  # beyond bwrap's signed uid maps


def test_workers_are_sized_from_cores_and_engines(tmp_path, monkeypatch):
    assert budget.sandbox_workers(96, 8) == 11  # (96 - 8) // 8: 88 sandboxes + 8 engine cores = 96
    assert budget.sandbox_workers(64, 8) == 7 and budget.sandbox_workers(4, 8) == 1
    assert budget.sandbox_workers(2, 0) == 2 and budget.sandbox_workers(2, 1) == 1
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # cgroup v2: 1.5 CPUs
    assert budget.cgroup_cpu_quota(str(tmp_path), "0::/\n") == pytest.approx(1.5)
    assert budget.usable_cores(str(tmp_path), "0::/\n") == min(2, len(os.sched_getaffinity(0)))
    nested = tmp_path / "kubepods" / "pod1"
    nested.mkdir(parents=True)
    (nested / "cpu.max").write_text("max 100000\n")  # unlimited itself, limited by the ancestor
    (tmp_path / "kubepods" / "cpu.max").write_text("50000 100000\n")
    assert budget.cgroup_cpu_quota(str(tmp_path), "0::/kubepods/pod1\n") == pytest.approx(0.5)
    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct").mkdir(parents=True)
    (v1 / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("300000\n")
    (v1 / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")
    assert budget.cgroup_cpu_quota(str(v1), "4:cpu,cpuacct:/\n") == pytest.approx(3.0)
    (v1 / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")
    assert budget.cgroup_cpu_quota(str(v1), "4:cpu,cpuacct:/\n") is None
    monkeypatch.setenv("LPO_CODE_WORKERS", "auto")
    monkeypatch.setenv("LPO_CODE_ENGINES_PER_NODE", "8")
    cfg = SandboxConfig.from_env()
    cores = budget.usable_cores()
    assert cfg.n_workers() == max(1, (cores - 8) // 8) and "engines per node" in cfg.workers_reason()
    monkeypatch.setenv("LPO_CODE_WORKERS", "5")
    assert SandboxConfig.from_env().n_workers() == 5
    monkeypatch.setenv("LPO_CODE_ENGINES_PER_NODE", "x")
    with pytest.raises(ValueError, match="LPO_CODE_ENGINES_PER_NODE='x' must be an integer >= 0"):
        SandboxConfig.from_env()
