"""The vowel-fraction reward of toy_reward.py, which also appends every scored query to the jsonl file
named by ``$LPO_E2E_REWARD_LOG`` (prompt, query, reward): the research e2e recomputes each rollout
batch's group temperatures from it, independently of the trainer."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # loaded by path (OpenRLHF's remote_url)
from toy_reward import vowel_fraction  # noqa: E402


def reward_func(queries, prompts, labels, **_):
    import torch

    rewards = [vowel_fraction(q, p) for q, p in zip(queries, prompts)]
    path = os.environ.get("LPO_E2E_REWARD_LOG")
    if path:
        with open(path, "a") as f:
            f.write("".join(json.dumps({"prompt": p, "query": q, "reward": r}) + "\n"
                            for q, p, r in zip(queries, prompts, rewards)))
    r = torch.tensor(rewards, dtype=torch.float32)
    return {"rewards": r, "scores": r.clone(), "extra_logs": {}}
