"""The trainer's side of reward errors (openrlhf_lpo.rewards.reward_errors): every rollout sample counted,
samples without a reward repaired, the run stopped only when errors persist.

Public names (stable):
    RewardErrorGuard     trainer mixin (sync ``PPOTrainer`` and async ``TrainingActor`` subclasses):
                         ``train_step`` counts the batch's errors into the window of
                         ``--reward.error_window`` samples (raising ``RewardErrorsPersist`` with the
                         causes from the ledger when more than ``--reward.error_stop_frac`` fail) and
                         logs ``reward/error_frac`` over all of the batch's samples
    repair_samples(samples) -> list of bool (error per sample)

Why in the trainer: it is the one process that sees every sample of every rollout batch, from all
engines, before anything is dropped (a partial batch's remainder) or trained; each reward process
sees only its own engine's share. Samples arrive here before the experience maker, so the check
costs no GPU time and a stop happens before a batch of zeros is trained on.

A sample whose reward function raised outright (a reward file other than ours, or ours failing
before its per-sample catch) reaches the trainer from OpenRLHF's executor with ``reward=None`` and
no extra_logs; upstream would crash later in padding code. It is scored 0 and counted as an error
here, and its info gets the keys the other samples carry, so the batch concatenates.
"""

from __future__ import annotations

from typing import List

import torch

from openrlhf_lpo.rewards.reward_errors import (DEFAULT_STOP_FRAC, DEFAULT_WINDOW, ERROR_KEY, ErrorWindow, ledger_summary,
                                        open_ledger)

__all__ = ["RewardErrorGuard", "repair_samples"]


def repair_samples(samples) -> List[bool]:
    """Error flag per rollout sample (no reward, or ``reward/error_frac`` > 0); samples without a reward
    get reward 0 and the info keys the others carry (zeros), every sample gets ``reward/error_frac``."""
    errors = []
    for s in samples:
        missing = s.rewards is None
        if missing:
            zero = torch.zeros(1)
            s.rewards, s.scores = zero.clone(), zero.clone()
            s.info["reward"], s.info["score"] = zero.clone(), zero.clone()
        flag = missing or bool((torch.as_tensor(s.info.get(ERROR_KEY, 0.0)).float() > 0).any())
        s.info[ERROR_KEY] = torch.tensor([1.0 if flag else 0.0])
        errors.append(flag)
    keys = {}
    for s in samples:
        for k, v in s.info.items():
            if isinstance(v, torch.Tensor):
                keys.setdefault(k, v)
    for s in samples:
        for k, like in keys.items():
            if k not in s.info:
                s.info[k] = torch.zeros_like(like)
    return errors


class RewardErrorGuard:
    """Trainer mixin: the reward-error window around ``train_step`` (see module doc)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        reward_args = self.args.reward
        self._reward_errors = ErrorWindow(int(getattr(reward_args, "error_window", DEFAULT_WINDOW)),
                                          float(getattr(reward_args, "error_stop_frac", DEFAULT_STOP_FRAC)))
        self._reward_ledger = open_ledger()  # before the first generation: the reward processes report here

    def train_step(self, rollout_samples, global_step):
        flags = repair_samples(rollout_samples)
        frac = self._reward_errors.add(flags, describe=lambda: ledger_summary(self._reward_ledger))
        status, global_step = super().train_step(rollout_samples, global_step)
        status[ERROR_KEY] = frac  # all of the batch's samples (the actors' mean covers the trained ones)
        return status, global_step
