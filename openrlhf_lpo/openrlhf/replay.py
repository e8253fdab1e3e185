"""Listwise replay buffer (``--lpo.replay_batches``): the last N rollout batches' prompt groups, each
with its responses, rewards and behaviour log-probs, for re-use under the listwise off-policy target.

Why it is exact to re-use a group: the simplex normalisation is a self-normalised importance
estimator (App. C.2). A replayed group k = 1..K sampled from an old behaviour policy mu_b enters the
update like an async batch: s_t,k = delta_k = mean_t log pi_t - log mu_b (offpolicy.py) at the
start-of-update policy pi_t, w* = softmax(R/tau + s_t), s_k(theta) = mean_t clip(log pi_theta -
log pi_t) + delta_k. The experience maker recomputes pi_t's log-probs of the replayed sequences
with the fresh rollout's forward pass; ``--lpo.replay_max_abs_s`` drops a group whose |delta| is too
large (a stale list: one member would dominate P).

Public names (stable):
    ReplayBuffer(batches, seed)
        .add(groups, step)             a rollout batch's groups (lists of K single-sample Experiences
                                       whose ``rollout_log_probs`` hold the behaviour log-probs)
        .draw(n, step) -> groups       n whole groups, uniformly without replacement (seeded by the seed
                                       and the step: a resumed run draws what the uninterrupted one would),
                                       as fresh Experience copies marked ``info["lpo_replayed"] = 1`` and
                                       ``info["lpo_replay_age"]`` = steps since they were sampled
        .num_groups
        .state_dict() / .load_state_dict(state)     plain tensors, lists and strings (torch.load
                                                    with weights_only=True reads them)
        .save(path) / .load_file(path)              atomic torch.save / load
    REPLAY_INFO_KEYS = ("lpo_replayed", "lpo_replay_age")
    fingerprint(rows) -> float        order-independent CRC of (sequences, attention_mask) rows' token ids
                                      (mod 2^24: exact in a float32 TensorBoard scalar), to compare draws

Memory: a sample costs its token ids and masks plus one float32 behaviour log-prob per response
token. At the 8B recipe's shape (1024 samples per batch, up to 5k tokens) that is ~100 MB per batch
in the trainer process and in each checkpoint's ``_lpo_replay/global_step<N>.pt``.
"""

from __future__ import annotations

import copy
import os
import zlib
from collections import deque
from dataclasses import fields
from typing import Dict, List

import torch

from openrlhf.trainer.ppo_utils.experience import Experience

__all__ = ["ReplayBuffer", "REPLAY_INFO_KEYS", "fingerprint"]

REPLAY_INFO_KEYS = ("lpo_replayed", "lpo_replay_age")
_DERIVED_INFO = set(REPLAY_INFO_KEYS) | {"lpo_gid"}  # written by the experience maker, not by the rollout


def _record(sample: Experience) -> Dict:
    """A single-sample Experience as plain data (no derived fields: log-probs other than the behaviour
    ones, advantages, KL are recomputed when it is replayed)."""
    rec = {}
    for f in fields(Experience):
        if f.name in ("action_log_probs", "base_action_log_probs", "values", "returns", "advantages", "kl", "index"):
            continue
        value = getattr(sample, f.name)
        if f.name == "info":
            value = {k: v for k, v in value.items() if k not in _DERIVED_INFO}
        rec[f.name] = copy.deepcopy(value)
    return rec


def _sample(rec: Dict) -> Experience:
    return Experience(**copy.deepcopy(rec))


def fingerprint(rows) -> float:
    """Order-independent CRC of ``(sequences_row, attention_row)`` pairs' unpadded token ids, mod 2^24."""
    total = 0
    for seq, att in rows:
        total += zlib.crc32(seq.reshape(-1)[att.reshape(-1).bool()].to(torch.int64).numpy().tobytes())
    return float(total % (1 << 24))


class ReplayBuffer:
    """See the module docstring."""

    def __init__(self, batches: int, seed: int):
        if batches < 1:
            raise ValueError(f"--lpo.replay_batches {batches}: a replay buffer holds >= 1 rollout batch")
        self.max_batches = int(batches)
        self.seed = int(seed)
        self.batches: deque = deque(maxlen=self.max_batches)  # {"step": int, "groups": [[record] * K]}

    @property
    def num_groups(self) -> int:
        return sum(len(b["groups"]) for b in self.batches)

    def add(self, groups: List[List[Experience]], step: int) -> None:
        for group in groups:
            if any(s.rollout_log_probs is None for s in group):
                raise ValueError("replay: every stored sample needs its behaviour log-probs (rollout_log_probs)")
        self.batches.append({"step": int(step), "groups": [[_record(s) for s in group] for group in groups]})

    def draw(self, n: int, step: int) -> List[List[Experience]]:
        pool = [(b["step"], g) for b in self.batches for g in b["groups"]]
        n = min(int(n), len(pool))
        if n <= 0:
            return []
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + int(step) * 7919 + 17)
        picks = torch.randperm(len(pool), generator=gen)[:n].tolist()
        out = []
        for i in picks:
            born, group = pool[i]
            members = []
            for rec in group:
                sample = _sample(rec)
                sample.info["lpo_replayed"] = torch.tensor([1.0])
                sample.info["lpo_replay_age"] = torch.tensor([float(step - born)])
                members.append(sample)
            out.append(members)
        return out

    # -- persistence
    def state_dict(self) -> Dict:
        return {"version": 1, "max_batches": self.max_batches, "seed": self.seed,
                "batches": [{"step": b["step"], "groups": b["groups"]} for b in self.batches]}

    def load_state_dict(self, state: Dict) -> None:
        if state.get("version") != 1:
            raise ValueError(f"replay buffer state version {state.get('version')!r} is not 1")
        self.batches = deque(({"step": int(b["step"]), "groups": b["groups"]} for b in state["batches"]),
                             maxlen=self.max_batches)

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        torch.save(self.state_dict(), tmp)
        os.replace(tmp, path)

    def load_file(self, path: str) -> None:
        self.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
