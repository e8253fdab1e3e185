"""Reward file for the Megatron e2e test: a learnable signal for an untrained tiny model.

reward = 1 when the response's first character is a digit, else 0 (random policies get both,
so LPO/GRPO groups are informative and the weights really move).
"""

from typing import List


def reward_func(queries: List[str], prompts: List[str], labels: List[str]) -> dict:
    import torch

    from openrlhf_lpo.rewards.reward_func import response_of

    responses = [response_of(q, p) for q, p in zip(queries, prompts)]
    r = torch.tensor([1.0 if resp[:1].isdigit() else 0.0 for resp in responses], dtype=torch.float32)
    return {"rewards": r, "scores": r.clone(), "extra_logs": {}}
