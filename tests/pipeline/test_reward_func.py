"""The OpenRLHF reward-function file: task dispatch, prompt stripping, math via the shared grader,
and the contract with OpenRLHF 0.11.2's single-turn executor (which loads the file by path)."""

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from openrlhf_lpo.data.countdown import countdown_label
from openrlhf_lpo.data.loaders import math_label
from openrlhf_lpo.data.templates import countdown_prompt, math_prompt
from openrlhf_lpo.rewards import reward_func as rf
from openrlhf_lpo.rewards.grading import grade_math
from openrlhf_lpo.rewards.math_reward import math_reward

REWARD_FILE = Path(rf.__file__)


def test_countdown_rewards_ignore_the_prompt_example():
    prompt = countdown_prompt([2, 54, 17], 35)
    label = countdown_label([2, 54, 17], 35)
    queries = [
        prompt + " 54-17=37, 37-2=35 </think> <answer>54 - 17 - 2</answer><|im_end|>",
        prompt + " no idea </think><|im_end|>",  # the prompt's own <answer> example must not count
        prompt + " </think> <answer>54 + 17 + 2</answer>",
    ]
    out = rf.reward_func(queries, [prompt] * 3, [label] * 3)
    assert out["rewards"].tolist() == [1.0, 0.0, 0.0]
    assert out["scores"].tolist() == [1.0, 0.0, 0.0]
    assert out["extra_logs"]["answer_found"].tolist() == [1.0, 0.0, 1.0]
    assert set(out["extra_logs"]) == {"answer_found", "grader_timeout", "reward/error_frac"}


def test_math_rewards_match_the_shared_grader():
    prompt = math_prompt("What is 1/2 + 1/4?")
    cases = [
        ("Adding, we get \\boxed{\\frac{3}{4}}.", "\\frac34"),
        ("So the answer is \\boxed{0.75}", "3/4"),
        ("I think \\boxed{1}", "\\frac{3}{4}"),
        ("no boxed answer", "3/4"),
    ]
    for response, gold in cases:
        expected = 1.0 if grade_math(response, gold).correct else 0.0
        for label in (math_label(gold), gold):  # JSON label or a bare gold answer
            out = rf.reward_func([prompt + response], [prompt], [label])
            assert out["rewards"].tolist() == [expected]
    assert [math_reward(r, g)[0] for r, g in cases] == [1.0, 1.0, 0.0, 0.0]
    assert math_reward("no boxed answer", "3/4")[1] == "no_answer"


def test_math_reward_from_a_thread():
    # OpenRLHF calls reward_func through asyncio.to_thread: math-verify's signal timeout would fail there
    async def go():
        return await asyncio.to_thread(math_reward, "\\boxed{2}", "2")

    assert asyncio.run(go()) == (1.0, "ok")


def test_bad_labels_and_lengths():
    with pytest.raises(ValueError, match="unknown"):
        rf.parse_label(json.dumps({"task": "chess"}))
    # in the reward hook an unknown task costs its sample only (test_reward_errors.py)
    assert rf.reward_func(["x"], ["x"], [json.dumps({"task": "chess"})])["extra_logs"]["reward/error_frac"].tolist() == [1.0]
    with pytest.raises(ValueError, match="same length"):
        rf.reward_func(["a", "b"], ["a"], ["1", "2"])
    assert rf.parse_label("42") == {"task": "math", "answer": "42"}
    assert rf.parse_label("[1, 2]") == {"task": "math", "answer": "[1, 2]"}


def test_openrlhf_single_turn_executor_contract(tiny_model_dir):
    """The stock executor loads our file by path, decodes prompt+response and stores the reward."""
    from openrlhf.utils.agent import SingleTurnAgentExecutor
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = countdown_prompt([2, 54, 17], 35)
    response_ids = tok("</think> <answer>54 - 17 - 2</answer>", add_special_tokens=False)["input_ids"]

    class Engine:
        async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
            completion = SimpleNamespace(token_ids=list(response_ids), finish_reason="stop", logprobs=None)
            return SimpleNamespace(outputs=[completion])

    executor = SingleTurnAgentExecutor([str(REWARD_FILE)])
    params = SimpleNamespace(max_tokens=64, logprobs=None)
    out = asyncio.run(executor.execute(prompt, countdown_label([2, 54, 17], 35), params, 1024, tok, Engine()))
    assert out["reward"] is not None and torch.tensor([out["reward"]]).flatten().tolist() == [1.0]
    assert out["action_ranges"] == [(len(tok(prompt, add_special_tokens=False)["input_ids"]), len(out["observation_tokens"]))]
