"""Code data: the paper's PRIME prompt, the PRIME / HumanEval / MBPP loaders and `prepare` commands,
and real solutions graded through the labels the loaders write."""

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from openrlhf_lpo.data.code import code_label, load_humaneval, load_mbpp, load_prime_code, read_code_records
from openrlhf_lpo.data.templates import CODE_INSTRUCTION, PRIME_SYSTEM_PROMPT, code_messages, code_prompt, render
from openrlhf_lpo.rewards import reward_func as rf

# Problems in PRIME's schema (Eurus-2-RL-Data as verl parquet): a stdin/stdout problem, a call-based one,
# and a math row that the code loader must skip. The solutions below are written for these tests.
AB = "Given two integers a and b on one line, print their sum."
SORTW = "Read n and then n words, one per line; print the words sorted, space separated."
FNAME = "Complete the function count_vowels(s) that returns the number of vowels in s."
ROWS = [
    {"data_source": "codecontests", "ability": "code",
     "prompt": [{"role": "system", "content": PRIME_SYSTEM_PROMPT}, {"role": "user", "content": AB + CODE_INSTRUCTION}],
     "reward_model": {"style": "rule", "ground_truth": json.dumps({"inputs": ["1 2\n", "-5 5\n", "1000000000 1000000000\n"],
                                                                   "outputs": ["3\n", "0\n", "2000000000\n"]})},
     "extra_info": {"split": "dummy", "index": 0}},
    {"data_source": "numina_amc_aime", "ability": "math",
     "prompt": [{"role": "system", "content": PRIME_SYSTEM_PROMPT}, {"role": "user", "content": "What is 2+2?"}],
     "reward_model": {"style": "rule", "ground_truth": "4"}, "extra_info": {"split": "dummy", "index": 1}},
    {"data_source": "taco", "ability": "code",
     "prompt": [{"role": "system", "content": PRIME_SYSTEM_PROMPT}, {"role": "user", "content": SORTW + CODE_INSTRUCTION}],
     "reward_model": {"style": "rule", "ground_truth": json.dumps({"inputs": ["3\nb\nc\na\n", "1\nz\n"],
                                                                   "outputs": ["a b c\n", "z\n"]})},
     "extra_info": {"split": "dummy", "index": 2}},
    {"data_source": "apps", "ability": "code",
     "prompt": [{"role": "system", "content": PRIME_SYSTEM_PROMPT}, {"role": "user", "content": FNAME + CODE_INSTRUCTION}],
     "reward_model": {"style": "rule", "ground_truth": json.dumps({"fn_name": "count_vowels", "inputs": [["hello"], ["xyz"]],
                                                                   "outputs": [[2], [0]]})},
     "extra_info": {"split": "dummy", "index": 3}},
]
SOLUTIONS = {
    AB: ("print(sum(map(int, input().split())))", "print(int(input().split()[0]))"),
    SORTW: ("import sys\nn = int(sys.stdin.readline())\nprint(' '.join(sorted(sys.stdin.read().split()[:n])))",
            "n = int(input())\nprint(' '.join(input() for _ in range(n)))"),
    FNAME: ("def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)", "def count_vowels(s):\n    return len(s)"),
}


@pytest.fixture
def prime_parquet(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    return str(path)


def test_prime_prompt_is_the_papers():
    msgs = code_messages("Print a+b.")
    assert msgs[0] == {"role": "system", "content": PRIME_SYSTEM_PROMPT}
    assert msgs[1]["content"] == "Print a+b.\n\nWrite Python code to solve the problem. Present the code in \n```python\nYour code\n```\nat the end."
    assert PRIME_SYSTEM_PROMPT.startswith("\nWhen tackling complex reasoning tasks, you have access to the following actions.")
    for action in ("[ASSESS]", "[ADVANCE]", "[VERIFY]", "[SIMPLIFY]", "[SYNTHESIZE]", "[PIVOT]", "[OUTPUT]"):
        assert f"\n\n{action}\n\n" in PRIME_SYSTEM_PROMPT
    assert PRIME_SYSTEM_PROMPT.endswith("Next action: [NEXT ACTION NAME]\n\n")
    assert code_prompt(msgs[1]["content"]) == msgs[1]["content"] == render("code", problem="Print a+b.")


def test_prime_loader_and_real_solutions(prime_parquet, tiny_tokenizer):
    rows = load_prime_code(prime_parquet, "train")
    assert [r["data_source"] for r in rows] == ["codecontests", "taco", "apps"]  # the math row is skipped
    for row, problem in zip(rows, [AB, SORTW, FNAME]):
        assert row["prompt"] == code_messages(problem)
        label = json.loads(row["label"])
        assert label["task"] == "code"
        # the chat template the recipe applies (--data.apply_chat_template)
        text = tiny_tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        assert text.startswith("<|im_start|>system\n" + PRIME_SYSTEM_PROMPT) and text.endswith("<|im_start|>assistant\n")
        good, bad = SOLUTIONS[problem]
        responses = [f"[ASSESS]\n...\n```python\n{good}\n```", f"```python\n{bad}\n```", "Next action: [OUTPUT]"]
        out = rf.reward_func([text + r for r in responses], [text] * 3, [row["label"]] * 3)
        n_tests = len(label["tests"]["inputs"])
        bad_reward = out["rewards"][1].item()
        assert out["rewards"][0].item() == 1.0 and out["rewards"][2].item() == 0.0
        assert 0.0 <= bad_reward < 1.0 and (bad_reward * n_tests).is_integer()
    # the wrong a+b passes exactly the tests where a+b == a, i.e. b == 0: none of the three
    assert rf.reward_func(["```python\n" + SOLUTIONS[AB][1] + "\n```"], [""], [rows[0]["label"]])["rewards"].item() == 0.0
    capped = load_prime_code(prime_parquet, "train", max_tests=1, limit=2)
    assert len(capped) == 2 and all(len(json.loads(r["label"])["tests"]["inputs"]) == 1 for r in capped)


def test_loader_errors_name_the_row(tmp_path, monkeypatch):
    bad = [dict(ROWS[0], reward_model={"style": "rule", "ground_truth": json.dumps({"inputs": ["1"]})})]
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(bad), path)
    with pytest.raises(ValueError, match=r"bad.parquet \(train\) row 0: tests must be"):
        load_prime_code(str(path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ValueError, match="huggingface-cli download --repo-type dataset PRIME-RL/Eurus-2-RL-Data"):
        read_code_records("PRIME-RL/Eurus-2-RL-Data", "train")


def test_humaneval_and_mbpp_loaders(tmp_path):
    rows = load_humaneval()
    assert len(rows) == 164 and rows[0]["task_id"] == "HumanEval/0"
    tests = json.loads(rows[0]["label"])["tests"]
    assert set(tests) == {"test", "entry_point", "prefix"} and tests["entry_point"] == "has_close_elements"
    assert rows[0]["prompt"][1]["content"].startswith("Complete the following Python function:\n```python\nfrom typing import List")
    mbpp = [{"task_id": 1, "text": "Write a function to return the square of a number.", "code": "def square(x):\n    return x * x",
             "test_list": ["assert square(3) == 9", "assert square(-2) == 4"], "test_setup_code": ""},
            {"task_id": 2, "text": "Write a function that returns the maximum of a list.", "code": "def big(xs):\n    return max(xs)",
             "test_list": ["assert big(ys) == 3"], "test_setup_code": "ys = [1, 3, 2]"}]
    path = tmp_path / "mbpp.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in mbpp))
    loaded = load_mbpp(str(path))
    assert "Your code should pass these tests:\n\nassert square(3) == 9" in loaded[0]["prompt"][1]["content"]
    for row, src in zip(loaded, mbpp):
        out = rf.reward_func(["```python\n" + src["code"] + "\n```", "```python\ndef square(x):\n    return 0\n```"],
                             ["", ""], [row["label"]] * 2)
        assert out["rewards"].tolist() == [1.0, 0.0]


def test_prepare_commands(tmp_path, prime_parquet, repo_env):
    out = tmp_path / "he.jsonl"
    for cmd in (["humaneval", "--limit", "5", "--out", str(out)],
                ["prime-code", "--src", prime_parquet, "--max-tests", "2", "--out", str(tmp_path / "pc.jsonl")]):
        proc = subprocess.run([sys.executable, "-m", "openrlhf_lpo.data.prepare", *cmd], capture_output=True, text=True,
                              env=repo_env, timeout=120)
        assert proc.returncode == 0, proc.stderr
    assert len(out.read_text().splitlines()) == 5
    pc = [json.loads(line) for line in (tmp_path / "pc.jsonl").read_text().splitlines()]
    assert len(pc) == 3 and json.loads(pc[0]["label"]) == {"task": "code", "tests": {
        "inputs": ["1 2\n", "-5 5\n"], "outputs": ["3\n", "0\n"]}}
    assert code_label({"inputs": ["1"], "outputs": ["1"]}) == '{"task": "code", "tests": {"inputs": ["1"], "outputs": ["1"]}}'


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from openrlhf_lpo.testing.tiny import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"))
