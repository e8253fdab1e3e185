"""Reward file of the VLM end-to-end test: the project's reward (geometry answers graded by the math
grader) plus a small deterministic shaping term, 0.01 x the number of distinct characters in the
response, so that a random tiny model's groups are not all-equal and the LPO gradient is not zero."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from openrlhf_lpo.rewards.reward_func import response_of  # noqa: E402
from openrlhf_lpo.rewards.reward_func import reward_func as project_reward_func  # noqa: E402


def reward_func(queries, prompts, labels):
    out = project_reward_func(queries, prompts, labels)
    shaping = torch.tensor([0.01 * len(set(response_of(q, p))) for q, p in zip(queries, prompts)])
    out["rewards"] = out["rewards"] + shaping
    out["scores"] = out["rewards"].clone()
    return out
