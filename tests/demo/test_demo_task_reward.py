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


# ----------------------------------------------------------------------------- pairsum


def _pairsum_brute(question):
    """Every correct answer, from the question text alone: ordered pairs of two listed digits."""
    listed, target = question.split(":")
    digits = [int(c) for c in listed.split(" ")]
    return sorted(f"{a}+{b}" for a in digits for b in digits if a != b and a + b == int(target))


def test_pairsum_problems_have_exactly_four_answers():
    task = get_task("pairsum")
    probs = task.problems(400, seed=5)
    assert probs == task.problems(400, seed=5) and probs != task.problems(400, seed=6)
    for q, label in probs:
        assert re.fullmatch(r"\d( \d){4}:\d{1,2}", q), q
        digits = q.split(":")[0].split(" ")
        assert len(set(digits)) == 5
        answers = _pairsum_brute(q)
        assert len(answers) == 4 and list(task.solutions(label)) == answers
        assert label == f"pairsum:{''.join(digits)}:{q.split(':')[1]}"


def test_pairsum_checker_against_brute_force():
    task = get_task("pairsum")
    candidates = [f"{a}+{b}" for a in range(10) for b in range(10)] + ["", "3+", "+3", "3+45", "12+3", "3 + 6",
                                                                         "3-6", "36", "a+b"]
    for q, label in task.problems(60, seed=11):
        good = set(_pairsum_brute(q))
        for c in candidates:
            assert task.is_correct(c, label) == (c in good), (q, c)
            assert score(c + "<|im_end|>", label) == float(c in good)


@pytest.mark.parametrize("name", ["pairsum", "tripsum"])
def test_heldout_split_is_disjoint_by_digit_set(name):
    task = get_task(name)
    canon = lambda q: ("".join(sorted(q.split(":")[0].split(" "))), q.split(":")[1])  # noqa: E731
    train = {canon(q) for q, _ in task.problems(3000, seed=1, split="train")}
    held = {canon(q) for q, _ in task.problems(600, seed=2, split="heldout")}
    assert train and held and not (train & held)
    allp = task.problems(4000, seed=3)
    frac = sum(task.split_of(lab) == "heldout" for _, lab in allp) / len(allp)
    assert 0.12 < frac < 0.28  # ~20% of problems (by problem, not uniformly by draw)
    # a permutation of the listed digits stays in the same split
    q, lab = allp[0]
    digits, target = lab.split(":")[1:]
    assert task.split_of(f"{name}:{digits[::-1]}:{target}") == task.split_of(lab)


def test_sft_stream_draws_answers_uniformly_and_keeps_the_problem_stream():
    task = get_task("pairsum")
    stream, plain = task.sft_stream(4), task.stream(4, split="train")
    index_counts = [0, 0, 0, 0]
    for _ in range(2000):
        q, answer = next(stream)
        q2, label = next(plain)
        assert q == q2 and task.is_correct(answer, label)
        index_counts[list(task.solutions(label)).index(answer)] += 1
    assert all(400 < c < 600 for c in index_counts), index_counts  # 500 expected each, sd ~19
    # addition: the warm-up pairs are the historical (question, exact sum) stream
    add = get_task("addition")
    pairs = [p for p, _ in zip(add.sft_stream(0), range(50))]
    assert pairs == add.problems(50, seed=0)
    assert all(int(a) == sum(map(int, q.split("+"))) for q, a in pairs)


def test_label_of_unknown_task_names_it():
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        score("1+2<|im_end|>", "nope:123")
    with pytest.raises(ValueError, match="pairsum label"):
        get_task("pairsum").is_correct("1+2", "pairsum:12:3")


def test_reward_file_scores_pairsum_and_fingerprints_rollouts():
    reward_func = _load_reward_file()
    task = get_task("pairsum")
    q, label = task.problems(1, seed=0)[0]
    prompt = f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
    good = task.solutions(label)[0]
    queries = [prompt + good + "<|im_end|>", prompt + "9+9<|im_end|>", prompt + good + "<|im_end|>"]
    out = reward_func(queries, [prompt] * 3, [label] * 3)
    assert out["rewards"].tolist() == [1.0, 0.0, 1.0]
    fp = out["extra_logs"]["rollout_fingerprint"].tolist()
    assert fp[0] == fp[2] != fp[1] and all(0.0 <= x < 1.0 for x in fp)
    import zlib

    assert fp[1] == zlib.crc32(queries[1].encode()) / 2**32


def test_prompt_dataset_never_writes_heldout_problems(tmp_path):
    task = get_task("pairsum")
    path = write_prompt_dataset(str(tmp_path / "p.jsonl"), task, 300, seed=9)
    rows = [json.loads(line) for line in open(path)]
    assert len(rows) == 300 and all(task.split_of(r["label"]) == "train" for r in rows)
    assert all(task.is_correct(task.solutions(r["label"])[0], r["label"]) for r in rows)
