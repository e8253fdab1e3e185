"""Code reward: run the response's program against test cases in the sandbox and count passed tests.

Public API (a contract other code and checks rely on)::

    grade_code(response: str, tests: dict, timeout_s: float | None = None) -> CodeResult
    CodeResult(passed: int, total: int, status: str)   # status: ok / fail / timeout / error / no_code

* **The program** is the last fenced code block of the response (```` ```python ````, ```` ```py ````
  or an untagged fence; blocks tagged with another language are skipped; a block ends at the next line
  that starts with three backticks; an unclosed last fence runs to the end). Reasoning models are graded after the last ``</think>``; an unclosed ``<think>`` has no
  code. No block gives ``no_code``.
* **Test formats** (``tests``; a JSON string of one is accepted too):

  - stdin/stdout (PRIME/APPS/TACO/CodeContests): ``{"inputs": [str], "outputs": [str]}``; a list of
    lines is joined with newlines. Outputs are compared token by token (whitespace-insensitive);
    a token of the expected output that is a decimal number with a point or an exponent matches
    within 1e-6 (absolute or relative).
  - call-based (APPS ``fn_name``, also LeetCode-style ``class Solution``): ``{"fn_name": str,
    "inputs": [[args]], "outputs": [value]}``; the return value travels as JSON (tuples and sets become
    lists) and equals the expected value, or its single element (APPS wraps outputs in a list);
    floats within 1e-6.
  - HumanEval/MBPP style: ``{"test": str, "entry_point": str}`` (optional ``"prefix"``: code put
    before the program, e.g. the prompt's imports): the test code and then ``check(entry_point)`` (when
    it defines ``check``) run in a harness process that never executes model code; the program's
    functions are proxies that take and return plain data (:mod:`openrlhf_lpo.rewards.sandbox_runner`);
    the prefix's own helpers are the trusted ones the tests use. One test, passed when that returns.

* **Passing** a test needs a clean exit (status 0, no limit hit) and a matching output. Expected
  outputs never enter the sandbox: the comparison happens here, so a program cannot read them, and
  ``os._exit(0)`` or printing a fake marker does not pass a stdin/stdout or call-based test. In the
  HumanEval style the expected values are in the test code: it runs in the harness process, which the
  program cannot patch, read or impersonate (its verdict goes through a pipe only it holds), and the
  comparisons see only built-in values (an always-equal object arrives as an opaque object that equals
  nothing else and has no truth value).
* **Status**: ``ok`` (every test passed), ``fail`` (ran, some test failed; also a program that does
  not compile), ``timeout`` (some test hit the per-test time limit), ``error`` (the reward could not
  be computed: the sandbox died or could not fork a test's process; reward 0 whatever passed before),
  ``no_code``.
* **Reward** (:func:`code_reward`): ``fraction`` = passed/total (PRIME's continuous code reward, the
  default) or ``all`` = 1.0 only when every test passes (``LPO_CODE_REWARD``). In ``all`` mode
  grading stops at the first failing test, in both modes at the first test that times out (a looping
  program costs one time limit, not one per test; the tests it did not run count as failed).

Every program runs in :mod:`openrlhf_lpo.rewards.sandbox`; nothing here executes model output.
Safe from threads and Ray workers: each call starts its own sandbox process, at most
``LPO_CODE_WORKERS`` (default: sized from the usable cores and ``LPO_CODE_ENGINES_PER_NODE``) at a time
per process.
"""

from __future__ import annotations

import json
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

from openrlhf_lpo.rewards.grading import final_answer_text
from openrlhf_lpo.rewards.sandbox import CodeSandbox, SandboxConfig, TestOutcome, shared_sandbox

__all__ = [
    "STATUSES",
    "REWARD_MODES",
    "CodeResult",
    "CodeTests",
    "extract_code",
    "parse_tests",
    "outputs_match",
    "values_match",
    "grade_code",
    "grade_program",
    "grade_code_batch",
    "code_reward",
    "reward_mode",
    "check_code_sandbox",
]

STATUSES = ("ok", "fail", "timeout", "error", "no_code")
REWARD_MODES = ("fraction", "all")
MAX_PROGRAM_CHARS = 1 << 20
ASSERT_PASSED = "LPO-ASSERT-PASSED"  # the runner's marker (sandbox_runner.ASSERT_PASSED)


@dataclass(frozen=True)
class CodeResult:
    """Outcome of grading one response: ``passed`` of ``total`` tests, ``status`` (see module doc).

    ``detail`` says what went wrong first (for logs; not part of the contract).
    """

    passed: int
    total: int
    status: str
    detail: str = ""

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total

    def reward(self, mode: str = "fraction") -> float:
        """``fraction``: passed/total; ``all``: 1.0 when every test passed, else 0.0; 0.0 for ``error``."""
        if mode in REWARD_MODES and self.status == "error":
            return 0.0
        if mode == "fraction":
            return self.passed / self.total if self.total else 0.0
        if mode == "all":
            return 1.0 if self.all_passed else 0.0
        raise ValueError(f"code reward mode {mode!r} is unknown; choose one of {REWARD_MODES}")


# -- extraction -------------------------------------------------------------------------------------

_FENCE = re.compile(r"^\s*```+\s*([^\s`]*)\s*$")
_PYTHON_TAGS = {"", "python", "py", "python3", "py3"}


def extract_code(response: str) -> Optional[str]:
    """The last Python (or untagged) fenced block of ``response``'s answer part, or None."""
    text = final_answer_text(response)
    if text is None:
        return None
    blocks: List[Tuple[str, List[str]]] = []
    current: Optional[Tuple[str, List[str]]] = None
    for line in text.splitlines():
        if current is None:
            m = _FENCE.match(line)
            if m is not None:
                current = (m.group(1).lower(), [])
        elif line.lstrip().startswith("```"):  # a closing fence (text after it is not code)
            blocks.append(current)
            current = None
        else:
            current[1].append(line)
    if current is not None:  # unclosed last fence: the code runs to the end of the response
        blocks.append(current)
    for tag, lines in reversed(blocks):
        if tag in _PYTHON_TAGS:
            code = "\n".join(lines)
            return code + "\n" if code.strip() else None
    return None


# -- test formats -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CodeTests:
    """Normalised tests: ``mode`` stdio / call / assert and what the runner and the comparison need."""

    mode: str
    inputs: tuple
    outputs: tuple = ()
    fn_name: Optional[str] = None
    test_code: Optional[str] = None
    entry_point: Optional[str] = None
    prefix: str = ""

    @property
    def total(self) -> int:
        return len(self.inputs)


def _text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    raise ValueError(f"{where} must be a string (or a list of lines), got {type(value).__name__}")


def parse_tests(tests: Union[dict, str]) -> CodeTests:
    """Validate and normalise one of the three test formats (see the module docstring)."""
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except ValueError as e:
            raise ValueError(f"tests is a string but not JSON ({e})") from None
    if not isinstance(tests, dict):
        raise ValueError(f"tests must be a dict, got {type(tests).__name__}")
    prefix = tests.get("prefix") or ""
    if not isinstance(prefix, str):
        raise ValueError("tests['prefix'] must be a string of code")
    if "test" in tests:
        if not isinstance(tests["test"], str):
            raise ValueError("tests['test'] (HumanEval style) must be a string of test code")
        entry = tests.get("entry_point")
        if entry is not None and not (isinstance(entry, str) and entry.isidentifier()):
            raise ValueError(f"tests['entry_point'] must be a function name, got {entry!r}")
        return CodeTests("assert", (None,), (), None, tests["test"], entry, prefix)
    if "inputs" not in tests or "outputs" not in tests:
        raise ValueError(
            "tests must be {'inputs': [...], 'outputs': [...]} (stdin/stdout), with 'fn_name' (call-based), "
            f"or {{'test': str, 'entry_point': str}} (HumanEval style); got keys {sorted(tests)}"
        )
    inputs, outputs = tests["inputs"], tests["outputs"]
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise ValueError("tests['inputs'] and tests['outputs'] must be lists")
    if len(inputs) != len(outputs):
        raise ValueError(f"tests has {len(inputs)} inputs but {len(outputs)} outputs")
    if not inputs:
        raise ValueError("tests has no test cases")
    fn_name = tests.get("fn_name")
    if fn_name:
        if not (isinstance(fn_name, str) and fn_name.isidentifier()):
            raise ValueError(f"tests['fn_name'] must be a function name, got {fn_name!r}")
        args = tuple(a if isinstance(a, list) else [a] for a in inputs)
        return CodeTests("call", args, tuple(outputs), fn_name, None, None, prefix)
    ins = tuple(_text(x, f"tests['inputs'][{i}]") for i, x in enumerate(inputs))
    outs = tuple(_text(y, f"tests['outputs'][{i}]") for i, y in enumerate(outputs))
    return CodeTests("stdio", ins, outs, None, None, None, prefix)


# -- comparison (host side) -------------------------------------------------------------------------

_DECIMAL = re.compile(r"[+-]?(?:\d+\.\d*|\.\d+|\d+(?=[eE]))(?:[eE][+-]?\d+)?")
FLOAT_TOL = 1e-6


def _close(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=FLOAT_TOL, abs_tol=FLOAT_TOL)


def outputs_match(got: str, expected: str) -> bool:
    """stdin/stdout comparison: whitespace-insensitive tokens; decimal tokens of ``expected`` within 1e-6."""
    if got == expected:
        return True
    g, e = got.split(), expected.split()
    if len(g) != len(e):
        return False
    for a, b in zip(g, e):
        if a == b:
            continue
        if not _DECIMAL.fullmatch(b):
            return False
        try:
            if not _close(float(a), float(b)):
                return False
        except ValueError:
            return False
    return True


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if isinstance(a, int) and isinstance(b, int):
            return a == b
        return _close(float(a), float(b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def values_match(got: Any, expected: Any) -> bool:
    """Call-based comparison of JSON values; an expected ``[x]`` also accepts ``x`` (APPS convention)."""
    if isinstance(expected, tuple):
        expected = list(expected)
    if _equal(got, expected):
        return True
    return isinstance(expected, list) and len(expected) == 1 and _equal(got, expected[0])


def _test_passed(t: CodeTests, i: int, o: TestOutcome) -> bool:
    if not o.clean_exit:
        return False
    if t.mode == "stdio":
        return outputs_match(o.stdout, t.outputs[i])
    if t.mode == "assert":
        return o.result == ASSERT_PASSED
    try:
        value = json.loads(o.result or "")["value"]
    except (ValueError, TypeError, KeyError):
        return False
    return values_match(value, t.outputs[i])


def _why(t: CodeTests, i: int, o: TestOutcome) -> str:
    if o.timed_out:
        return f"test {i}: time limit"
    if o.output_limited:
        return f"test {i}: output limit"
    if o.rc != 0:
        last = o.stderr.strip().splitlines()[-1:] or [""]
        status = f"signal {o.sig}" if o.sig is not None else f"exit {o.rc}"
        return f"test {i}: {status} {last[0][:200]}".rstrip()
    return f"test {i}: wrong answer"


# -- grading ----------------------------------------------------------------------------------------


def grade_program(
    program: str,
    tests: Union[dict, str, CodeTests],
    timeout_s: Optional[float] = None,
    *,
    sandbox: Optional[CodeSandbox] = None,
    stop_on_fail: bool = False,
    stop_on_timeout: bool = True,
) -> CodeResult:
    """Run an already-extracted ``program`` against ``tests`` in the sandbox (``stop_on_fail``: stop at
    the first failing test; ``stop_on_timeout``: at the first that times out)."""
    t = tests if isinstance(tests, CodeTests) else parse_tests(tests)
    if not isinstance(program, str):
        raise ValueError(f"program must be a str, got {type(program).__name__}")
    if len(program) > MAX_PROGRAM_CHARS:
        return CodeResult(0, t.total, "fail", f"program longer than {MAX_PROGRAM_CHARS} characters")
    box = sandbox or shared_sandbox()
    source = (t.prefix + "\n" + program) if t.prefix else program
    passed = []

    def stop(i: int, outcome: TestOutcome) -> bool:
        ok = _test_passed(t, i, outcome)
        passed.append(ok)
        return (stop_on_fail and not ok) or (stop_on_timeout and outcome.timed_out)

    report = box.run(source, t.mode, t.inputs, fn_name=t.fn_name, test_code=t.test_code,
                     entry_point=t.entry_point, prefix=t.prefix, timeout_s=timeout_s, stop=stop)
    if report.compile_error is not None:
        return CodeResult(0, t.total, "fail", report.compile_error)
    if len(passed) < len(report.outcomes):  # the last outcome (no stop call for it)
        passed.append(_test_passed(t, len(passed), report.outcomes[-1]))
    n_passed = sum(passed)
    if n_passed == t.total:
        return CodeResult(n_passed, t.total, "ok")
    if report.error is not None:
        return CodeResult(n_passed, t.total, "error", report.failure or report.error)
    failed = [(i, o) for i, o in enumerate(report.outcomes) if not passed[i]]
    detail = _why(t, *failed[0]) if failed else (report.failure or "")
    if any(o.timed_out for o in report.outcomes) or (report.failure or "").startswith("the sandbox hit its deadline"):
        return CodeResult(n_passed, t.total, "timeout", detail)
    if report.failure is not None and not report.stopped:
        return CodeResult(n_passed, t.total, "error", detail or report.failure)
    return CodeResult(n_passed, t.total, "fail", detail)


def grade_code(
    response: str,
    tests: Union[dict, str],
    timeout_s: Optional[float] = None,
    *,
    sandbox: Optional[CodeSandbox] = None,
    stop_on_fail: bool = False,
    stop_on_timeout: bool = True,
) -> CodeResult:
    """Grade one response: its last fenced code block against ``tests`` (module docstring).

    ``timeout_s``: CPU seconds per test (default ``LPO_CODE_TIMEOUT_S``, 5; wall clock 2x + 1 s).
    ``sandbox``: a :class:`CodeSandbox` (default: the process-wide one from ``LPO_CODE_*``).
    ``stop_on_fail``: stop at the first failing test; ``stop_on_timeout``: at the first timeout.
    """
    if not isinstance(response, str):
        raise ValueError(f"response must be a str, got {type(response).__name__}")
    t = parse_tests(tests)
    code = extract_code(response)
    if code is None:
        return CodeResult(0, t.total, "no_code", "no fenced code block")
    return grade_program(code, t, timeout_s, sandbox=sandbox, stop_on_fail=stop_on_fail,
                         stop_on_timeout=stop_on_timeout)


def grade_code_batch(
    responses: Sequence[str],
    tests: Sequence[Union[dict, str]],
    timeout_s: Optional[float] = None,
    *,
    workers: Optional[int] = None,
    sandbox: Optional[CodeSandbox] = None,
    stop_on_fail: bool = False,
    stop_on_timeout: bool = True,
    progress=None,
) -> List[CodeResult]:
    """Grade ``responses[i]`` against ``tests[i]`` in parallel (threads; each program in its sandbox)."""
    if len(responses) != len(tests):
        raise ValueError(f"responses and tests must have the same length ({len(responses)} != {len(tests)})")
    box = sandbox or shared_sandbox()
    box.ensure_ready()  # refuse before starting any thread
    n = workers or box.config.n_workers()

    def one(i: int) -> CodeResult:
        result = grade_code(responses[i], tests[i], timeout_s, sandbox=box, stop_on_fail=stop_on_fail,
                            stop_on_timeout=stop_on_timeout)
        if progress is not None:
            progress(1)
        return result

    with ThreadPoolExecutor(max_workers=max(1, n)) as ex:
        return list(ex.map(one, range(len(responses))))


def reward_mode() -> str:
    """``LPO_CODE_REWARD``: ``fraction`` (default) or ``all``."""
    mode = os.environ.get("LPO_CODE_REWARD", "").strip() or "fraction"
    if mode not in REWARD_MODES:
        raise ValueError(f"environment variable LPO_CODE_REWARD={mode!r} must be one of {REWARD_MODES}")
    return mode


def code_reward(response: str, tests: Union[dict, str], mode: Optional[str] = None) -> Tuple[float, str]:
    """``(reward, status)`` for the RL reward (``mode``: ``fraction`` / ``all``, default ``LPO_CODE_REWARD``)."""
    mode = mode or reward_mode()
    if mode not in REWARD_MODES:
        raise ValueError(f"code reward mode {mode!r} is unknown; choose one of {REWARD_MODES}")
    result = grade_code(response, tests, stop_on_fail=(mode == "all"))
    return result.reward(mode), result.status


def check_code_sandbox(config: Optional[SandboxConfig] = None) -> str:
    """Probe the sandbox now (raises :class:`~openrlhf_lpo.rewards.sandbox.SandboxUnavailableError` with
    the reason and the fix); returns a description of the working setup."""
    return shared_sandbox(config).ensure_ready().description
