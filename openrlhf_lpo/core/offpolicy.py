"""LPO's listwise off-policy correction: s_t against the behaviour policy (Eq. 8 with s_t != 0).

The rollout engine samples response k from a behaviour policy mu (vLLM's sampler; an older actor
under async training; a mix of versions under partial rollout). OpenRLHF stores mu's per-token
log-probs as ``rollout_log_probs`` (when ``--algo.advantage.is_correction_level`` is not off) and
the start-of-update actor's as ``action_log_probs`` (pi_t). LPO measures the list against mu
with the trust region anchored at pi_t (research note offpolicy.md, placement B):

    delta_k = (1/n_k) sum_t corr(log pi_t - log mu)            (the start point s_t)
    s_k(theta) = (1/n_k) sum_t clip(log pi_theta - log pi_t) + delta_k
    w* = softmax(R/tau + delta),  P = softmax(s)

so P = w* exactly where R is flat and the clip band measures the update's own movement whatever
the lag. ``--algo.advantage.is_correction_*`` chooses corr (token level, ratio gating):

    clip   per-token log-ratios truncated to [log low, log high]   (TIS)
    mask   tokens whose ratio leaves [low, high] drop out of s and delta (ICEPOP)
    none   no truncation (``UNTRUNCATED``): replayed groups when no correction is set (their
           staleness is bounded by --lpo.replay_max_abs_s instead)

Sequence-level rejection and the binary_kl / tv gates are refused for LPO (cli/flags.py): a
rejected member would have to leave the list, changing K per group.

Public names (stable):
    BehaviourCorrection(mode, low, high)  (None = off: delta = 0, the on-policy assumption)
    UNTRUNCATED                           BehaviourCorrection("none"): delta = the plain mean log-ratio
    correction_from_args(args) -> BehaviourCorrection | None
    token_keep_mask(old_log_probs, rollout_log_probs, action_mask, correction) -> action mask
    behaviour_log_ratio(old_log_probs, rollout_log_probs, action_mask, correction) -> delta [B]
    behaviour_stats(delta[G,K]) -> {"abs_mean", "abs_max", "ess"} (ESS of softmax(delta) / K)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional

import torch

__all__ = ["BehaviourCorrection", "UNTRUNCATED", "correction_from_args", "token_keep_mask", "behaviour_log_ratio",
           "behaviour_stats"]


@dataclass(frozen=True)
class BehaviourCorrection:
    mode: str  # "clip" | "mask"
    low: float
    high: float

    def __post_init__(self):
        if self.mode not in ("clip", "mask", "none"):
            raise ValueError(f"behaviour correction mode {self.mode!r}: use clip, mask or none")
        if self.mode != "none" and not (0.0 < self.low < self.high):
            raise ValueError(f"behaviour correction band [{self.low}, {self.high}] needs 0 < low < high")

    @property
    def log_band(self):
        if self.mode == "none":
            return -math.inf, math.inf
        return math.log(self.low), math.log(self.high)


UNTRUNCATED = BehaviourCorrection("none", 0.0, math.inf)


def correction_from_args(args) -> Optional[BehaviourCorrection]:
    """The correction named by ``--algo.advantage.is_correction_*`` (None when the level is off)."""
    adv = args.algo.advantage
    if adv.is_correction_level == "off":
        return None
    low, high = adv.is_correction_threshold
    return BehaviourCorrection(adv.is_correction_mode, float(low), float(high))


def token_keep_mask(old_log_probs: torch.Tensor, rollout_log_probs: Optional[torch.Tensor],
                    action_mask: torch.Tensor, correction: Optional[BehaviourCorrection]) -> torch.Tensor:
    """``action_mask`` without the tokens that ``mask`` mode rejects (unchanged otherwise)."""
    if correction is None or correction.mode != "mask" or rollout_log_probs is None:
        return action_mask
    lo, hi = correction.log_band
    ell = old_log_probs.double() - rollout_log_probs.double()
    return action_mask.bool() & (ell >= lo) & (ell <= hi)


def behaviour_log_ratio(old_log_probs: torch.Tensor, rollout_log_probs: Optional[torch.Tensor],
                        action_mask: torch.Tensor, correction: Optional[BehaviourCorrection]) -> torch.Tensor:
    """delta [B] (float64): the length-normalised, corrected log pi_t - log mu of each response;
    0 when the correction is off."""
    if correction is None:
        return torch.zeros(action_mask.shape[0], dtype=torch.float64)
    if rollout_log_probs is None:
        raise ValueError(
            "--algo.advantage.is_correction_level is on but the rollout carries no behaviour log-probs "
            "(Experience.rollout_log_probs); the engine or agent must return the sampled tokens' log-probs"
        )
    keep = token_keep_mask(old_log_probs, rollout_log_probs, action_mask, correction).double()
    ell = old_log_probs.double() - rollout_log_probs.double()
    if correction.mode == "clip":
        ell = ell.clamp(*correction.log_band)
    return ((ell * keep).sum(-1) / keep.sum(-1).clamp(min=1.0)).cpu()


def behaviour_stats(delta: torch.Tensor) -> Dict[str, float]:
    """Sums over groups of mean |delta|, max |delta| and the effective sample size of
    softmax(delta) as a fraction of K (1 = on-policy); ``delta`` is [G, K]."""
    d = delta.double()
    p = torch.softmax(d, dim=-1)
    ess = 1.0 / (p * p).sum(-1) / d.shape[-1]
    return {"abs_mean_sum": float(d.abs().mean(-1).sum()), "abs_max": float(d.abs().max()) if d.numel() else 0.0,
            "ess_sum": float(ess.sum()), "groups": float(d.shape[0])}
