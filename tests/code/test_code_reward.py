"""grade_code: extraction, the three test formats, comparison rules, statuses, rewards, threads, and the
reward-function file with code labels. Every program runs in the real sandbox."""

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from code_helpers import CORRECT, SUM_TESTS
from openrlhf_lpo.rewards import reward_func as rf
from openrlhf_lpo.rewards.code import (
    CodeResult,
    code_reward,
    extract_code,
    grade_code,
    grade_code_batch,
    outputs_match,
    parse_tests,
    values_match,
)


def fence(code: str, tag: str = "python") -> str:
    return f"```{tag}\n{code.strip()}\n```"


# -- extraction -------------------------------------------------------------------------------------


def test_last_python_block_is_the_program():
    r = "Plan:\n```python\nprint(1)\n```\nbetter:\n```py\nprint(2)\n```\nExample output:\n```text\n2\n```\n"
    assert extract_code(r) == "print(2)\n"  # the last block tagged text is skipped
    assert extract_code("```\nx = 1\n```") == "x = 1\n"  # untagged fence
    assert extract_code("```python\nprint(3)\n") == "print(3)\n"  # unclosed last fence runs to the end
    assert extract_code("no code at all") is None and extract_code("```python\n\n```") is None
    assert extract_code("```cpp\nint main(){}\n```") is None
    # reasoning: only after </think>; an unclosed <think> has no answer
    assert extract_code("<think>```python\nprint(0)\n```</think>\n```python\nprint(5)\n```") == "print(5)\n"
    assert extract_code("<think>```python\nprint(0)\n```") is None
    assert extract_code("  ```Python3  \n  indented = 1\n  ```") == "  indented = 1\n"
    assert extract_code("```python\nprint(4)\n```*junk after the fence\nmore") == "print(4)\n"


# -- the three formats --------------------------------------------------------------------------------


def test_stdin_stdout_tests_and_rewards(box):
    assert grade_code(CORRECT, SUM_TESTS, sandbox=box) == CodeResult(2, 2, "ok")
    half = fence("a, b = map(int, input().split())\nprint(a + b if a < 10 else 0)")
    r = grade_code(half, SUM_TESTS, sandbox=box)
    assert (r.passed, r.total, r.status, r.detail) == (1, 2, "fail", "test 1: wrong answer")
    assert r.reward("fraction") == 0.5 and r.reward("all") == 0.0
    # lists of lines, whitespace-insensitive tokens, float tolerance only on decimal tokens
    tests = {"inputs": [["2", "1 2"]], "outputs": [["0.333333333", "3"]]}
    assert grade_code(fence("input()\nprint('0.3333333333  \\n 3')"), tests, sandbox=box).status == "ok"
    assert grade_code(fence("print('0.3334\\n3')"), tests, sandbox=box).status == "fail"


def test_call_based_tests(box):
    tests = {"fn_name": "add", "inputs": [[1, 2], [40, 2]], "outputs": [[3], [42]]}  # APPS wraps outputs
    assert grade_code(fence("def add(a, b):\n    return a + b"), tests, sandbox=box).status == "ok"
    leet = fence("class Solution:\n    def add(self, a, b):\n        return a + b")
    assert grade_code(leet, tests, sandbox=box).status == "ok"
    pair = {"fn_name": "f", "inputs": [[3]], "outputs": [[[3, 9], 0.5]]}
    assert grade_code(fence("def f(x):\n    return (x, x * x), 1 / 2"), pair, sandbox=box).status == "ok"
    assert grade_code(fence("def f(x):\n    return [x, x * x], 0.5000001"), pair, sandbox=box).status == "ok"
    assert grade_code(fence("def f(x):\n    return (x, 10), 0.5"), pair, sandbox=box).status == "fail"
    assert grade_code(fence("def g(x):\n    return 1"), pair, sandbox=box).detail.startswith("test 0: exit 1 NameError")
    # an object that claims to equal everything is not JSON: it never reaches the comparison as equal
    cheat = fence("class Eq:\n    def __eq__(self, o):\n        return True\ndef add(a, b):\n    return Eq()")
    assert grade_code(cheat, tests, sandbox=box).status == "fail"


def test_humaneval_style_tests(box):
    tests = {"test": "def check(candidate):\n    assert candidate([3, 1, 2]) == [1, 2, 3]\n", "entry_point": "srt",
             "prefix": "from typing import List\n"}
    ok = grade_code(fence("def srt(xs: List[int]) -> List[int]:\n    return sorted(xs)"), tests, sandbox=box)
    assert ok == CodeResult(1, 1, "ok")
    assert grade_code(fence("def srt(xs):\n    return xs"), tests, sandbox=box).status == "fail"
    exit0 = fence("import os\ndef srt(xs):\n    return xs\nos._exit(0)")
    assert grade_code(exit0, tests, sandbox=box).status == "fail"  # exiting before the asserts is no pass
    mbpp = {"test": "assert sq(3) == 9\nassert sq(-2) == 4\n"}  # plain asserts, no check()
    assert grade_code(fence("def sq(x):\n    return x * x"), mbpp, sandbox=box).status == "ok"
    assert grade_code(fence("def sq(x):\n    return abs(x) * 3"), mbpp, sandbox=box).status == "fail"


def test_statuses_and_stop_on_fail(box):
    tests = {"inputs": ["1\n", "2\n", "3\n"], "outputs": ["1\n", "2\n", "3\n"]}
    assert grade_code("I would print the input.", tests, sandbox=box) == CodeResult(0, 3, "no_code", "no fenced code block")
    syntax = grade_code(fence("print(input()"), tests, sandbox=box)  # the model's fault: fail, not error
    assert (syntax.status, syntax.passed) == ("fail", 0) and syntax.detail.startswith("SyntaxError")
    slow = fence("x = int(input())\nwhile x == 2:\n    pass\nprint(x)")
    r = grade_code(slow, tests, timeout_s=1, sandbox=box)  # stops at the timeout: test 2 is not run
    assert (r.passed, r.status, r.detail) == (1, "timeout", "test 1: time limit")
    wrong_first = fence("x = int(input())\nprint(x if x > 1 else 0)")
    assert grade_code(wrong_first, tests, sandbox=box).passed == 2
    stopped = grade_code(wrong_first, tests, sandbox=box, stop_on_fail=True)
    assert (stopped.passed, stopped.total, stopped.status) == (0, 3, "fail")
    crash = grade_code(fence("x = int(input())\nprint(x)\nraise SystemExit(3)"), tests, sandbox=box)
    assert crash.status == "fail" and crash.detail == "test 0: exit 3"  # right output, unclean exit
    exits = grade_code(fence("import sys\nprint(input())\nexit()"), tests, sandbox=box)
    assert exits.status == "ok"  # exit()/quit() exist although site is not imported
    threads = fence("import threading\ndef main():\n    print(input())\nt = threading.Thread(target=main)\nt.start()")
    assert grade_code(threads, tests, sandbox=box).status == "ok"  # non-daemon threads finish, as in python


def test_parse_tests_errors():
    assert parse_tests(json.dumps(SUM_TESTS)).mode == "stdio"  # PRIME's ground truth is a JSON string
    for bad, msg in [
        ({"inputs": ["1"]}, "tests must be"),
        ({"inputs": ["1"], "outputs": []}, "1 inputs but 0 outputs"),
        ({"inputs": [], "outputs": []}, "no test cases"),
        ({"fn_name": "not a name", "inputs": [[1]], "outputs": [1]}, "function name"),
        ({"test": 3}, "string of test code"),
        ("{nope", "not JSON"),
        ({"inputs": [1], "outputs": ["1"]}, r"tests\['inputs'\]\[0\] must be a string"),
    ]:
        with pytest.raises(ValueError, match=msg):
            parse_tests(bad)
    with pytest.raises(ValueError, match="response must be a str"):
        grade_code(None, SUM_TESTS)


def test_output_and_value_comparison_rules():
    assert outputs_match("1 2\n3\n", "1 2 3") and outputs_match("  yes\n\n", "yes")
    assert not outputs_match("YES", "yes") and not outputs_match("1 2", "1 2 3")
    assert outputs_match("0.1000004", "0.1") and not outputs_match("0.10001", "0.1")
    assert outputs_match("1e-7", "0.0") and not outputs_match("3.0000001", "3")  # tolerance only for decimals
    assert not outputs_match("nan", "0.5") and outputs_match("1.0E3", "1000.0")
    assert values_match(3, [3]) and values_match([3], [3]) and values_match([1, 2], [[1, 2]])
    assert not values_match(True, 1) and not values_match(1, True) and not values_match("1", 1)
    assert values_match({"a": [1.0]}, {"a": [1]}) and not values_match({"a": 1}, {"b": 1})
    assert values_match(0.30000000000000004, 0.3) and not values_match(0.31, 0.3)


# -- concurrency --------------------------------------------------------------------------------------


def test_threads_share_the_pool(box):
    responses = [CORRECT if i % 3 else fence("print(0)") for i in range(12)]
    with ThreadPoolExecutor(6) as ex:
        results = list(ex.map(lambda r: grade_code(r, SUM_TESTS, sandbox=box), responses))
    assert [r.passed for r in results] == [2 if i % 3 else 0 for i in range(12)]
    batch = grade_code_batch(responses, [SUM_TESTS] * 12, sandbox=box, workers=4)
    assert batch == results
    assert box.stats["in_flight"] == 0
    with pytest.raises(ValueError, match="same length"):
        grade_code_batch(responses, [SUM_TESTS], sandbox=box)


# -- the reward function file (OpenRLHF's --reward.remote_url) ------------------------------------------


def test_reward_func_code_labels(monkeypatch):
    from openrlhf_lpo.data.code import code_label

    prompt = "Add the two numbers.\n"
    label = code_label(SUM_TESTS)
    half = fence("a, b = map(int, input().split())\nprint(a + b if a < 10 else 0)")
    queries = [prompt + CORRECT, prompt + half, prompt + "no idea", prompt + fence("while True: pass")]
    monkeypatch.setenv("LPO_CODE_TIMEOUT_S", "1")
    out = rf.reward_func(queries, [prompt] * 4, [label] * 4)
    assert out["rewards"].tolist() == [1.0, 0.5, 0.0, 0.0]  # fraction of tests (the default)
    assert out["extra_logs"]["answer_found"].tolist() == [1.0, 1.0, 0.0, 1.0]
    assert out["extra_logs"]["grader_timeout"].tolist() == [0.0, 0.0, 0.0, 1.0]
    monkeypatch.setenv("LPO_CODE_REWARD", "all")
    assert rf.reward_func(queries[:2], [prompt] * 2, [label] * 2)["rewards"].tolist() == [1.0, 0.0]
    monkeypatch.setenv("LPO_CODE_REWARD", "most")
    with pytest.raises(ValueError, match="LPO_CODE_REWARD='most' must be one of"):
        rf.reward_func(queries[:1], [prompt], [label])
    assert code_reward(CORRECT, SUM_TESTS, mode="all") == (1.0, "ok")


def test_reward_func_from_openrlhf_threads():
    """OpenRLHF calls reward_func through asyncio.to_thread, one sample per call, many at once."""
    import asyncio

    from openrlhf_lpo.data.code import code_label

    label = code_label(SUM_TESTS)

    async def go():
        calls = [asyncio.to_thread(rf.reward_func, [q], [""], [label]) for q in [CORRECT, "x", CORRECT, CORRECT]]
        return await asyncio.gather(*calls)

    got = [float(o["rewards"][0]) for o in asyncio.run(go())]
    assert got == [1.0, 0.0, 1.0, 1.0] and threading.active_count() >= 1
    assert isinstance(rf.reward_func([CORRECT], [""], [label])["rewards"], torch.Tensor)
