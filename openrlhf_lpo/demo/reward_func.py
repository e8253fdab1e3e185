"""OpenRLHF 0.11.2 reward-function file for the demo's toy tasks (``--reward.remote_url <this file>``).

OpenRLHF's single-turn rollout executor loads a ``.py`` passed as ``--reward.remote_url`` and calls
``reward_func(queries, prompts, labels)``; ``queries`` are the decoded prompt+response strings
(special tokens kept), ``labels`` the dataset's label column written by
:func:`openrlhf_lpo.demo.task.write_prompt_dataset` (the reference answer for ``addition``,
``"<task>:<problem>"`` for the other tasks).

Reward: 1.0 when the response up to ``<|im_end|>`` is a correct answer, else 0.0
(:func:`openrlhf_lpo.demo.task.score`). Returned as float tensors ``rewards`` and ``scores`` plus
``extra_logs``: ``answer_length`` (characters before the end-of-turn token) and
``rollout_fingerprint``, a number in [0, 1) fixed by the query text (CRC-32 of prompt + response);
its per-step mean, logged by the trainer, is equal for two runs whose rollouts are equal, which is
how the demo checks that paired methods saw the same step-1 rollouts.
"""

from __future__ import annotations

import zlib
from typing import List


def fingerprint(query: str) -> float:
    """A number in [0, 1) determined by ``query`` (CRC-32 / 2^32)."""
    return zlib.crc32(query.encode("utf-8")) / 2.0**32


def reward_func(queries: List[str], prompts: List[str], labels: List[str]) -> dict:
    import torch

    from openrlhf_lpo.demo.task import extract_answer, score
    from openrlhf_lpo.rewards.reward_func import response_of

    if not (len(queries) == len(prompts) == len(labels)):
        raise ValueError(
            f"reward_func got {len(queries)} queries, {len(prompts)} prompts, {len(labels)} labels; "
            "they must have the same length"
        )
    responses = [response_of(q, p) for q, p in zip(queries, prompts)]
    rewards = torch.tensor([score(r, lab) for r, lab in zip(responses, labels)], dtype=torch.float32)
    lengths = torch.tensor([len(extract_answer(r)) for r in responses], dtype=torch.float32)
    prints = torch.tensor([fingerprint(q) for q in queries], dtype=torch.float64)
    return {"rewards": rewards, "scores": rewards.clone(),
            "extra_logs": {"answer_length": lengths, "rollout_fingerprint": prints}}
