"""The demo's toy task and its OpenRLHF reward file, checked against independent arithmetic."""

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from openrlhf_lpo.demo.task import TASKS, extract_answer, get_task, score, write_prompt_dataset

REWARD_FILE = Path(__file__).resolve().parents[2] / "openrlhf_lpo" / "demo" / "reward_func.py"


def test_addition_problems_are_correct_and_reproducible():
    task = get_task("addition")
    probs = task.problems(500, seed=3)
    assert probs == task.problems(500, seed=3)
    assert probs != task.problems(500, seed=4)
    for q, a in probs:
        m = re.fullmatch(r"(\d\d)\+(\d\d)", q)
        assert m, q
        x, y = int(m.group(1)), int(m.group(2))
        assert 10 <= x <= 99 and 10 <= y <= 99
        assert int(a) == x + y and a == str(x + y)
        assert len(a) <= task.max_answer_chars


@pytest.mark.parametrize(
    "response,label,expected",
    [
        ("123<|im_end|>", "123", 1.0),
        (" 123 <|im_end|>\n", "123", 1.0),
        ("123", "123", 1.0),                       # truncated before end of turn: still exact
        ("123<|im_end|>999", "123", 1.0),          # text after end of turn is ignored
        ("1234<|im_end|>", "123", 0.0),
        ("12<|im_end|>", "123", 0.0),
        ("12 3<|im_end|>", "123", 0.0),
        ("<|im_end|>123", "123", 0.0),
        ("", "123", 0.0),
        ("0123<|im_end|>", "123", 0.0),            # no numeric normalisation: exact string
    ],
)
def test_score_exact_match(response, label, expected):
    assert score(response, label) == expected


def test_extract_answer_strips_special_tokens():
    assert extract_answer("<|endoftext|>57<|im_end|><|endoftext|>") == "57"


def test_unknown_task_names_flag():
    with pytest.raises(ValueError, match="--task"):
        get_task("nope")
    assert "addition" in TASKS


def test_prompt_dataset_rows(tmp_path):
    path = write_prompt_dataset(str(tmp_path / "p.jsonl"), get_task("addition"), 20, seed=1)
    rows = [json.loads(line) for line in open(path)]
    assert len(rows) == 20
    assert [(r["prompt"], r["label"]) for r in rows] == get_task("addition").problems(20, seed=1)
    assert not list(tmp_path.glob("*.tmp-*"))


def _load_reward_file():
    spec = importlib.util.spec_from_file_location("demo_reward_func", REWARD_FILE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.reward_func


def test_reward_file_as_openrlhf_loads_it():
    reward_func = _load_reward_file()
    prompt = "<|im_start|>user\n12+34<|im_end|>\n<|im_start|>assistant\n"
    queries = [prompt + "46<|im_end|>", prompt + "47<|im_end|>", prompt + "46", prompt + "<|im_end|>"]
    out = reward_func(queries, [prompt] * 4, ["46"] * 4)
    assert out["rewards"].dtype == torch.float32
    assert out["rewards"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert torch.equal(out["scores"], out["rewards"])
    assert out["extra_logs"]["answer_length"].tolist() == [2.0, 2.0, 2.0, 0.0]
    # OpenRLHF calls it one sample at a time and wraps the value with torch.tensor([...]).
    single = reward_func(queries[:1], [prompt], ["46"])["rewards"]
    assert torch.tensor([single]).tolist() == [1.0]


def test_reward_file_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="same length"):
        _load_reward_file()(["a"], ["a", "b"], ["1"])
