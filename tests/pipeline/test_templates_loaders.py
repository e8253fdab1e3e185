"""Prompt templates (exact strings) and the MATH / Countdown loaders."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from openrlhf_lpo.data.loaders import last_boxed, load_countdown, load_math, read_records, write_jsonl
from openrlhf_lpo.data.templates import countdown_prompt, math_prompt, render

REPO = Path(__file__).resolve().parents[2]
BENCH = Path(os.environ.get("LPO_BENCHMARKS_DIR", REPO.parent / "shared" / "benchmarks"))

COUNTDOWN_EXPECTED = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with "
    "the answer.\nUser: Using the numbers [2, 54, 17], create an equation that equals 35. You can use basic "
    "arithmetic operations (+, -, *, /) and each number can only be used once. Show your work in <think> "
    "</think> tags. And return the final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 "
    "</answer>.\nAssistant: Let me solve this step by step.\n<think>"
)


def test_countdown_template_exact():
    assert countdown_prompt([2, 54, 17], 35) == COUNTDOWN_EXPECTED
    assert render("countdown", nums=(2, 54, 17), target="35") == COUNTDOWN_EXPECTED


def test_math_template_exact():
    assert math_prompt("What is $1+1$?") == (
        "What is $1+1$? Let's think step by step and output the final answer within \\boxed{}."
    )
    with pytest.raises(ValueError, match="countdown"):
        render("poetry", problem="x")


@pytest.mark.parametrize(
    "text,expected",
    [
        ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{3} then \\boxed{x^{2}}", "x^{2}"),
        ("\\fbox{7}", "7"),
        ("no box", None),
        ("\\boxed{unclosed", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_load_math_answer_or_solution(tmp_path):
    rows = [
        {"problem": "P1", "answer": "4"},
        {"problem": "P2", "solution": "We get \\boxed{\\dfrac{3}{4}}."},
        {"problem": "P3", "answer": ["1", "2"]},
    ]
    src = write_jsonl(rows, str(tmp_path / "m.jsonl"))
    out = load_math(src)
    assert [json.loads(r["label"]) for r in out] == [
        {"task": "math", "answer": "4"},
        {"task": "math", "answer": "\\dfrac{3}{4}"},
        {"task": "math", "answer": "1, 2"},
    ]
    assert out[0]["prompt"] == math_prompt("P1")
    write_jsonl([{"problem": "P", "solution": "none"}], str(tmp_path / "bad.jsonl"))
    with pytest.raises(ValueError, match="boxed"):
        load_math(str(tmp_path / "bad.jsonl"))
    with pytest.raises(ValueError, match="question"):
        load_math(src, problem_key="question")


def test_load_math_real_benchmarks():
    math500 = BENCH / "math500" / "test.jsonl"
    minerva = BENCH / "minerva_math" / "test.jsonl"
    if not math500.exists():
        pytest.fail(f"benchmark data missing at {BENCH}; set LPO_BENCHMARKS_DIR")
    raw = read_records(str(math500))
    rows = load_math(str(math500))
    assert len(rows) == len(raw) == 500
    assert all(json.loads(r["label"])["answer"] == str(x["answer"]).strip() for r, x in zip(rows, raw))
    mrows = load_math(str(minerva), answer_key=None)  # Minerva: gold is the last box of the solution
    assert len(mrows) == 272
    assert json.loads(mrows[0]["label"])["answer"] == last_boxed(read_records(str(minerva))[0]["solution"])


def test_load_countdown_jsonl_and_parquet(tmp_path):
    import pandas as pd

    recs = [{"nums": [2, 54, 17], "target": 35}, {"nums": [1, 2, 3, 4], "target": 24}]
    write_jsonl(recs, str(tmp_path / "c.jsonl"))
    pd.DataFrame(recs).to_parquet(tmp_path / "c.parquet")
    a = load_countdown(str(tmp_path / "c.jsonl"))
    b = load_countdown(str(tmp_path / "c.parquet"))
    assert a == b and a[0]["prompt"] == COUNTDOWN_EXPECTED
    write_jsonl([{"numbers": [1]}], str(tmp_path / "bad.jsonl"))
    with pytest.raises(ValueError, match="nums"):
        load_countdown(str(tmp_path / "bad.jsonl"))


def test_write_jsonl_is_atomic_and_prepare_cli(tmp_path):
    out = tmp_path / "d" / "cd.jsonl"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run(
        [sys.executable, "-m", "openrlhf_lpo.data.prepare", "countdown", "--n", "12", "--seed", "3", "--out", str(out)],
        check=True, env=env, capture_output=True,
    )
    lines = out.read_text().splitlines()
    assert len(lines) == 12 and not [p for p in out.parent.iterdir() if p.name.startswith(".tmp-")]
    row = json.loads(lines[0])
    assert set(row) >= {"prompt", "label", "nums", "target", "solution"}
    bad = subprocess.run(
        [sys.executable, "-m", "openrlhf_lpo.data.prepare", "countdown", "--num-counts", "x", "--out", str(out)],
        env=env, capture_output=True, text=True,
    )
    assert bad.returncode != 0 and "--num-counts" in bad.stderr
