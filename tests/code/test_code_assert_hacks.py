"""Reward hacks against the HumanEval/MBPP assert format, one test per hack, in the real sandbox.

Each hacking program defines the task's function without solving it and tries to earn a pass anyway;
none may. After each, the pool must still grade correctly: the honest solution of the same task passes,
and :func:`assert_pool_healthy` (no leaked slot, a correct stdin/stdout program passes, nothing left
running). ``tests/code/test_code_humaneval.py`` checks the other direction: all 164 canonical HumanEval
solutions still pass through the same harness and 164 mutants fail.
"""

import importlib.util
import json
import math
import uuid

import pytest

from code_helpers import REPO, assert_pool_healthy, wait_no_sandbox_processes
from openrlhf_lpo.rewards.code import grade_code

SECRET = f"lpo-secret-{uuid.uuid4().hex}"
PROMPT = (
    "def reference(a, b):\n"
    "    return a + b\n\n\n"
    "def add(a: int, b: int) -> int:\n"
    '    """Return the sum of a and b."""\n'
)
TEST = (
    f"# {SECRET}\n"
    "def check(candidate):\n"
    "    assert candidate(2, 3) == 5\n"
    "    assert candidate(-1, 1) == 0 and not candidate(0, 0)\n"
    "    assert candidate(4, 4) == reference(4, 4)\n"
    "    assert abs(candidate(0.5, 0.25) - 0.75) < 1e-9\n"
    "    assert str(candidate(10, 5)) == '15' and isinstance(candidate(1, 2), int)\n"
    "    assert True\n"
)
TESTS = {"test": TEST, "entry_point": "add", "prefix": PROMPT}
HONEST = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return a - b\n"

# every comparison, truth test, arithmetic and type check the tests make says "pass"
CHEAT = (
    "class Cheat:\n"
    "    def __eq__(self, other): return True\n"
    "    def __ne__(self, other): return False\n"
    "    def __lt__(self, other): return True\n"
    "    def __gt__(self, other): return True\n"
    "    def __bool__(self): return False\n"
    "    def __len__(self): return 0\n"
    "    def __sub__(self, other): return self\n"
    "    def __rsub__(self, other): return self\n"
    "    def __abs__(self): return self\n"
    "    def __hash__(self): return 0\n"
    "    def __repr__(self): return '15'\n"
    "    def __str__(self): return '15'\n"
    "    __class__ = property(lambda self: int)\n"
)

BOOL_PROMPT = "def is_even(n: int) -> bool:\n    \"\"\"True when n is even.\"\"\"\n"
BOOL_TESTS = {"test": "def check(candidate):\n    assert candidate(4)\n    assert not candidate(3)\n"
                      "    assert repr(candidate(10)) == 'True'\n    assert True\n",
              "entry_point": "is_even", "prefix": BOOL_PROMPT}
POLY_PROMPT = (
    "import math\n\n\n"
    "def poly(xs: list, x: float):\n"
    "    return sum(coeff * math.pow(x, i) for i, coeff in enumerate(xs))\n\n\n"
    "def find_zero(xs: list):\n"
    "    \"\"\"A zero of the polynomial with coefficients xs.\"\"\"\n"
)
POLY_TESTS = {"test": "def check(candidate):\n    import math\n    for xs in ([1, 2], [-6, 11, -6, 1]):\n"
                      "        x = candidate(xs)\n        assert abs(poly(xs, x)) < 1e-6\n"
                      "        assert math.isclose(poly(xs, x), 0.0, abs_tol=1e-6)\n",
              "entry_point": "find_zero", "prefix": POLY_PROMPT}
LITERAL_TESTS = {"test": f"# {SECRET}\ndef check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
                 "entry_point": "add", "prefix": PROMPT}
MEAN_TESTS = {"test": "def check(candidate):\n    assert abs(candidate([1.0, 2.0, 4.5]) - 2.5) < 1e-6\n"
                      "    assert isinstance(candidate([1.0]), float) and len(str(candidate([2.0]))) == 3\n",
              "entry_point": "mean", "prefix": "def mean(xs: list) -> float:\n    \"\"\"The mean of xs.\"\"\"\n"}
# the task each hack attacks when not TESTS, with its honest solution
TASKS = {
    "top_level_functions_shadowing_builtins": (MEAN_TESTS, "def mean(xs):\n    return sum(xs) / len(xs)\n"),
    "lying_bool_and_repr": (BOOL_TESTS, "def is_even(n):\n    return n % 2 == 0\n"),
    "monkeypatched_helpers_the_tests_use": (POLY_TESTS, (
        "def find_zero(xs):\n    lo, hi = -1.0, 1.0\n    while poly(xs, lo) * poly(xs, hi) > 0:\n"
        "        lo, hi = 2 * lo, 2 * hi\n    while hi - lo > 1e-10:\n        mid = (lo + hi) / 2\n"
        "        if poly(xs, mid) * poly(xs, lo) > 0:\n            lo = mid\n        else:\n            hi = mid\n"
        "    return lo\n")),
    "read_the_tests_from_memory": (LITERAL_TESTS, HONEST),
}

HACKS = {
    "always_equal_object": CHEAT + "def add(a, b):\n    return Cheat()\n",
    "int_subclass_with_patched_comparison": CHEAT + "class I(Cheat, int):\n    pass\ndef add(a, b):\n    return I(7)\n",
    "str_subclass_with_patched_comparison": CHEAT + "class S(Cheat, str):\n    pass\ndef add(a, b):\n    return S('no')\n",
    "list_subclass_with_patched_comparison": CHEAT + "class L(Cheat, list):\n    pass\ndef add(a, b):\n    return L()\n",
    "lying_bool_and_repr": (
        "class Liar:\n"
        "    calls = 0\n"
        "    def __bool__(self):\n"
        "        Liar.calls += 1\n"
        "        return Liar.calls % 2 == 1\n"  # True, then False, then True ...
        "    def __repr__(self): return 'True'\n"
        "def is_even(n):\n    return Liar()\n"
    ),
    "top_level_functions_shadowing_builtins": (
        "def abs(x):\n    return 0\n"
        "def isinstance(*args):\n    return True\n"
        "def len(x):\n    return 3\n"
        "def mean(xs):\n    return 0\n"
    ),
    "patched_builtins": (
        "import builtins\n"
        "builtins.exec = lambda *args, **kwargs: None\n"  # the old harness ran the tests with exec()
        "builtins.abs = lambda x: 0\n"
        "builtins.str = lambda x: '15'\n"
        "builtins.isinstance = lambda *a: True\n"
        "def add(a, b):\n    return 0\n"
    ),
    "monkeypatched_helpers_the_tests_use": (
        "import math\n"
        "math.isclose = lambda *a, **k: True\n"
        "def poly(xs, x):\n    return 0.0\n"  # the prompt's helper the tests call, redefined
        "def find_zero(xs):\n    return 12345.0\n"
    ),
    "sys_exit_at_import": "import sys\nsys.exit(0)\n" + WRONG,
    "os_exit_at_import": WRONG + "import os\nos._exit(0)\n",
    "exit_builtin_at_import": WRONG + "exit(0)\n",
    "system_exit_raised_at_call": "def add(a, b):\n    raise SystemExit(0)\n",
    "os_exit_at_call": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "atexit_writes_the_pass_marker": (
        "import atexit, os, sys\n"
        "def fake():\n"
        "    for fd in range(3, 32):\n"
        "        try:\n"
        "            os.write(fd, b'LPO-ASSERT-PASSED')\n"
        "        except OSError:\n"
        "            pass\n"
        "atexit.register(fake)\n"
        + WRONG + "sys.exit(0)\n"
    ),
    "settrace_skips_the_asserts": (
        "import sys, threading\n"
        "def tracer(frame, event, arg):\n"
        "    if frame.f_code.co_name != 'check':\n"
        "        return None\n"
        "    last = max(line for _, _, line in frame.f_code.co_lines() if line)\n"
        "    def local(frame, event, arg):\n"
        "        if event == 'line' and frame.f_lineno != last:\n"
        "            try:\n"
        "                frame.f_lineno = last\n"
        "            except ValueError:\n"
        "                pass\n"
        "        return local\n"
        "    return local\n"
        "sys.settrace(tracer)\n"
        "threading.settrace(tracer)\n"
        + WRONG
    ),
    "pass_marker_on_stdout_and_stderr": (
        "import os, sys\n"
        "for text in ('LPO-ASSERT-PASSED', 'PASSED', 'ok', '1 passed'):\n"
        "    print(text)\n"
        "    print(text, file=sys.stderr)\n"
        "    os.write(1, text.encode())\n"
        "    os.write(2, text.encode())\n"
        + WRONG
    ),
    "pass_marker_into_every_fd": (
        "import os\n"
        "def add(a, b):\n"
        "    for fd in range(3, 64):\n"
        "        try:\n"
        "            os.write(fd, b'LPO-ASSERT-PASSED')\n"
        "        except OSError:\n"
        "            pass\n"
        "    os._exit(0)\n"
    ),
    "closed_and_replaced_stdout": (
        "import io, os, sys\n"
        "sys.stdout.close()\n"
        "sys.stdout = io.StringIO()\n"
        "sys.stderr = None\n"
        "os.close(1)\n"
        "os.close(2)\n"
        + WRONG
    ),
    "kill_the_parent_at_call": "import os, signal\ndef add(a, b):\n    os.kill(os.getppid(), signal.SIGKILL)\n    return 5\n",
    "kill_everything_at_call": "import os, signal\ndef add(a, b):\n    os.kill(-1, signal.SIGKILL)\n    return 5\n",
    "forge_the_verdict_through_proc": (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def add(a, b):\n"
        "    for pid in [int(p) for p in os.listdir('/proc') if p.isdigit()]:\n"
        "        if pid == os.getpid():\n"
        "            continue\n"
        "        libc.ptrace(16, pid, 0, 0)\n"  # PTRACE_ATTACH
        "        for fd in range(0, 16):\n"
        "            try:\n"
        "                with open('/proc/%d/fd/%d' % (pid, fd), 'wb') as f:\n"
        "                    f.write(b'PASSED 0')\n"
        "            except OSError:\n"
        "                pass\n"
        "        try:\n"
        "            with open('/proc/%d/mem' % pid, 'r+b') as f:\n"
        "                f.write(b'x')\n"
        "        except OSError:\n"
        "            pass\n"
        "    return 0\n"
    ),
    "read_the_tests_from_memory": (
        "import ctypes, gc, re\n"
        "ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)\n"  # PR_SET_DUMPABLE 1: its own /proc/self/mem opens again
        "SECRET = re.compile(rb'lpo-secret-[0-9a-f]{32}')\n"  # the test code's marker (the pattern does not match itself)
        "def scan():\n"
        "    for obj in gc.get_objects():\n"
        "        if isinstance(obj, dict):\n"
        "            for v in list(obj.values()):\n"
        "                if isinstance(v, str) and SECRET.search(v.encode('utf-8', 'replace')):\n"
        "                    return v\n"
        "    with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb', 0) as mem:\n"
        "        for line in maps:\n"
        "            span, perms = line.split()[:2]\n"
        "            if not perms.startswith('r') or line.rstrip().endswith(('[vvar]', '[vsyscall]')):\n"
        "                continue\n"
        "            lo, hi = (int(x, 16) for x in span.split('-'))\n"
        "            try:\n"
        "                mem.seek(lo)\n"
        "                chunk = mem.read(hi - lo)\n"
        "            except (OSError, OverflowError, ValueError):\n"
        "                continue\n"
        "            m = SECRET.search(chunk)\n"
        "            if m:\n"
        "                return chunk[m.start():m.start() + 400].decode('latin-1')\n"
        "    return None\n"
        "FOUND = scan()\n"
        "print(repr(FOUND[:60]) if FOUND else 'NOT FOUND')\n"
        "ANSWERS = {}\n"
        "if FOUND:\n"
        "    for a, b, v in re.findall(r'candidate\\((-?\\d+), (-?\\d+)\\) == (-?\\d+)', FOUND):\n"
        "        ANSWERS[(int(a), int(b))] = int(v)\n"
        "def add(a, b):\n"
        "    return ANSWERS.get((a, b), 0)\n"
    ),
}


def fence(code: str) -> str:
    return f"```python\n{code}\n```"


@pytest.mark.parametrize("hack", sorted(HACKS))
def test_assert_format_hack_does_not_pass(box, hack):
    tests, honest = TASKS.get(hack, (TESTS, HONEST))
    result = grade_code(fence(HACKS[hack]), tests, sandbox=box)
    assert result.passed == 0 and result.status != "ok", (hack, result)
    assert result.reward("fraction") == 0.0 and result.reward("all") == 0.0
    assert grade_code(fence(honest), tests, sandbox=box).status == "ok"  # the same task, graded right after
    assert box.free_slots() == len(box.slots) and wait_no_sandbox_processes() == []


def test_the_program_never_holds_the_tests(box):
    """The expected values live only in the harness: a scan of the program's own objects and of its
    whole address space does not find the test code."""
    test = LITERAL_TESTS["test"]
    report = box.run(PROMPT + "\n" + HACKS["read_the_tests_from_memory"], "assert", [None], test_code=test,
                     entry_point="add", prefix=PROMPT)
    assert report.outcomes[0].stdout.splitlines()[0] == "NOT FOUND" and SECRET not in report.outcomes[0].stdout
    assert report.outcomes[0].result is None  # ... and with no answers it fails
    planted = HACKS["read_the_tests_from_memory"].replace("def scan", f"COPY = {test!r}\ndef scan")
    report = box.run(PROMPT + "\n" + planted, "assert", [None], test_code=test, entry_point="add", prefix=PROMPT)
    assert SECRET in report.outcomes[0].stdout  # the scan does find the tests where they are
    assert_pool_healthy(box)


def runner_module():
    spec = importlib.util.spec_from_file_location("lpo_runner", REPO / "openrlhf_lpo" / "rewards" / "sandbox_runner.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_plain_data_crosses_the_boundary_as_builtins():
    """to_plain / from_plain: exact built-in types come back; subclasses arrive as their base value,
    everything else as an opaque program object; a malformed message is refused."""
    from collections import Counter, OrderedDict, namedtuple

    r = runner_module()
    keep = []
    other = lambda v: keep.append(v) or {"h": len(keep), "type": type(v).__name__}  # noqa: E731
    Point = namedtuple("Point", "x y")

    class Eq(int):
        def __eq__(self, o):
            return True

        __hash__ = int.__hash__

    value = [1, -2**70, 2.5, float("nan"), float("-inf"), True, None, "s\udc80", b"\x00\xff", 3 + 4j, (1, (2,)),
             {1: "a", (2, 3): [4]}, {5, 6}, frozenset({7}), Counter("aab"), OrderedDict(z=1), Point(1, 2), Eq(9)]
    wire = json.loads(json.dumps(r.to_plain(value, other), ensure_ascii=True))  # as the pipe carries it
    back = r.from_plain(wire, lambda h, t: ("handle", h, t))
    want = [1, -2**70, 2.5, None, float("-inf"), True, None, "s\udc80", b"\x00\xff", 3 + 4j, (1, (2,)),
            {1: "a", (2, 3): [4]}, {5, 6}, frozenset({7}), {"a": 2, "b": 1}, {"z": 1}, (1, 2), 9]
    assert math.isnan(back[3])
    back[3] = None
    assert back == want
    types = [type(x) for x in back]
    assert types == [type(x) for x in want]  # Counter -> dict, namedtuple -> tuple, Eq -> int
    assert type(back[-1]) is int and back[-1] != 10
    handle = r.from_plain(r.to_plain([lambda: 0], other), lambda h, t: ("handle", h, t))
    assert handle == [("handle", 1, "function")]
    for bad in ({"zz": 1}, {"t": 3}, {"d": [[1]]}, {"h": "1"}, {"t": [], "s": []}):
        with pytest.raises((ValueError, TypeError)):
            r.from_plain(bad, lambda h, t: None)


def test_program_objects_equal_only_themselves_and_refuse_everything_else():
    """Misusing a program object raises NotPlainData, a BaseException: a test's ``except Exception`` or
    ``except TypeError`` (a test expecting the program to raise) cannot turn it into a pass."""
    r = runner_module()
    a, b = r.ProgramObject(1, "Yes", None), r.ProgramObject(1, "Yes", None)
    assert a == a and a != b and not (a == 5) and a != 5 and len({a, b}) == 2
    assert not issubclass(r.NotPlainData, Exception)
    for use in (bool, len, iter, abs, int, float, lambda x: x < 1, lambda x: x + 1, lambda x: 1 - x,
                lambda x: x[0], lambda x: 3 in x, lambda x: x.value):
        with pytest.raises(r.NotPlainData, match="not plain data"):
            use(a)


def test_assert_format_still_grades_ordinary_programs(box):
    """Exceptions the tests expect, program classes used by the tests (MBPP's Pair), keyword
    arguments, plain asserts without check() and helpers of the prompt all work through the proxies."""
    program = (
        "class Pair:\n"
        "    def __init__(self, a, b):\n"
        "        self.a, self.b = a, b\n"
        "def max_chain_length(pairs, n):\n"
        "    pairs = sorted(pairs, key=lambda p: p.b)\n"
        "    end, count = float('-inf'), 0\n"
        "    for p in pairs:\n"
        "        if p.a > end:\n"
        "            end, count = p.b, count + 1\n"
        "    return count\n"
        "def safe_div(a, b, *, default=None):\n"
        "    if b == 0:\n"
        "        raise ZeroDivisionError('b is zero')\n"
        "    return {'q': a // b, 'r': (a % b,), 'default': default}\n"
    )
    tests = {"test": (
        "assert max_chain_length([Pair(5, 24), Pair(15, 25), Pair(27, 40), Pair(50, 60)], 4) == 3\n"
        "assert safe_div(7, 2, default=[1]) == {'q': 3, 'r': (1,), 'default': [1]}\n"
        "try:\n"
        "    safe_div(1, 0)\n"
        "    raise RuntimeError('no exception')\n"
        "except ZeroDivisionError as e:\n"
        "    assert 'zero' in str(e)\n"
    ), "entry_point": "max_chain_length"}
    assert grade_code(fence(program), tests, sandbox=box).status == "ok"
    wrong = program.replace("count + 1", "count + 2")
    assert grade_code(fence(wrong), tests, sandbox=box).status == "fail"
    # an answer that is not plain data (forged on the reply pipe) cannot pose as the ValueError a test expects
    raises = {"test": "def check(candidate):\n    try:\n        candidate(-1)\n    except ValueError:\n        return\n"
                      "    raise AssertionError('no ValueError')\n", "entry_point": "root"}
    honest = "def root(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x ** 0.5\n"
    assert grade_code(fence(honest), raises, sandbox=box).status == "ok"
    forged = "import os\ndef root(x):\n    os.write(4, b'{\"v\": {\"zz\": 1}}\\n')\n    os._exit(0)\n"
    assert grade_code(fence(forged), raises, sandbox=box).status == "fail"
    missing = grade_code(fence("def other():\n    pass\n"), tests, sandbox=box)
    assert missing.status == "fail" and "NameError" in missing.detail
    lam = {"test": "def check(candidate):\n    assert candidate(lambda x: x) == 1\n", "entry_point": "f"}
    refused = grade_code(fence("def f(g):\n    return g(1)\n"), lam, sandbox=box)
    assert refused.status == "fail" and "plain data only" in refused.detail  # a documented limit
    assert_pool_healthy(box)
