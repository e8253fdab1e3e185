"""The LPO loss of one micro-batch, written once for both backends (Eq. 4, 8, 10/11).

Each backend hands in the micro-batch's token log-probs and gets back the un-normalised loss, s and c as
values; it keeps only its normalisation (the DeepSpeed trainer divides by the window's groups / gas and
multiplies by dp, the Megatron actor counts responses and multiplies by K):

    s_k   = (1/n_k) sum_t clip(log pi_theta - log pi_t, log(1-eps_low), log(1+eps_high)) + delta_k
            over the tokens the behaviour correction keeps (Eq. 4; delta = s_t, offpolicy.py)
    total = sum_g D(w*_g, softmax(s_g))             one pass (the micro-batch holds whole groups,
                                                     K consecutive rows)
          = sum_k stopgrad(c_k) s_k                  surrogate (c from the update plan: shortcut,
                                                     pre-pass or pointwise)
    c     = dL/ds of the projection's loss at this s (returned detached in both cases)

``token_statistics`` gives the per-token quantities every method logs with one definition (the metric
contract, core/metrics.py): the response tokens, the tokens whose log-ratio lies outside the clip band
[log(1-eps_low), log(1+eps_high)] and the sum of log pi_old - log pi_theta (``ppo_kl``).

Public names (stable):
    ListwiseTerms(total, s, c)
    log_ratio(log_probs, old_log_probs, action_mask, rollout_log_probs, prev, clip_eps, correction, score) -> s [B]
    listwise_micro_loss(log_probs, old_log_probs, action_mask, target, group_size, divergence, projection,
                        clip_eps, prev=None, coefficients=None, rollout_log_probs=None, correction=None, score)
        -> ListwiseTerms
    token_statistics(log_probs, old_log_probs, action_mask, clip_eps, rollout_log_probs=None, correction_band=None)
        -> {"tokens", "out_of_band", "ppo_kl_sum"[, "vllm_kl_sum", "filtered"]}
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

import torch

from openrlhf_lpo import listwise
from openrlhf_lpo.core.offpolicy import BehaviourCorrection, token_keep_mask

__all__ = ["ListwiseTerms", "log_ratio", "listwise_micro_loss", "token_statistics", "clip_bounds"]

ClipEps = Union[float, Tuple[float, float]]


def clip_bounds(clip_eps: ClipEps) -> Tuple[float, float]:
    """(eps_low, eps_high) from one epsilon or a pair."""
    if isinstance(clip_eps, (tuple, list)):
        lo, hi = clip_eps
        return float(lo), float(hi)
    return float(clip_eps), float(clip_eps)


@dataclass(frozen=True)
class ListwiseTerms:
    """One micro-batch's listwise loss: ``total`` (differentiable, un-normalised: a sum over its groups or its
    samples), ``s`` [B] and ``c`` [B] (float64, detached)."""

    total: torch.Tensor
    s: torch.Tensor
    c: torch.Tensor


def log_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor, action_mask: torch.Tensor,
              rollout_log_probs: Optional[torch.Tensor], prev: Optional[torch.Tensor], clip_eps: ClipEps,
              correction: Optional[BehaviourCorrection], score: str = "mean_clip") -> torch.Tensor:
    """s_k (Eq. 4 against the behaviour policy, offpolicy.py) in float64: the clipped, length-normalised
    log-ratio over the tokens the correction keeps, plus delta_k = ``prev`` (None: 0). ``score`` (--lpo.score):
    another registered score (listwise.sequence_score), e.g. TPO's summed, unclipped log-ratio."""
    mask = token_keep_mask(old_log_probs, rollout_log_probs, action_mask, correction)
    s = listwise.sequence_score(log_probs.double(), old_log_probs.double(), mask, clip_bounds(clip_eps), score)
    return s if prev is None else s + prev.to(device=s.device, dtype=s.dtype)


def listwise_micro_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, action_mask: torch.Tensor,
                        target: torch.Tensor, group_size: int, divergence: str, projection: str, clip_eps: ClipEps,
                        prev: Optional[torch.Tensor] = None, coefficients: Optional[torch.Tensor] = None,
                        rollout_log_probs: Optional[torch.Tensor] = None,
                        correction: Optional[BehaviourCorrection] = None, score: str = "mean_clip") -> ListwiseTerms:
    """The listwise loss of one micro-batch (module doc). Without ``coefficients`` the rows must be whole groups,
    K consecutive; with them any rows (c in row order)."""
    s = log_ratio(log_probs, old_log_probs, action_mask, rollout_log_probs, prev, clip_eps, correction, score)
    if coefficients is None:
        K = int(group_size)
        if s.shape[0] % K:
            raise ValueError(f"a one-pass micro-batch of {s.shape[0]} responses does not hold whole groups of "
                             f"--rollout.n_samples_per_prompt {K}")
        s_g = s.view(-1, K)
        w_g = target.to(device=s.device, dtype=s.dtype).view(-1, K)
        total = listwise.listwise_loss(s_g, w_g, divergence, projection) * s_g.shape[0]
        c = listwise.projection_coefficients(s_g.detach(), w_g, divergence, projection).reshape(-1)
    else:
        c = coefficients.to(device=s.device, dtype=s.dtype).detach()
        if c.shape != s.shape:
            raise ValueError(f"coefficients of shape {tuple(c.shape)} for {s.shape[0]} responses")
        total = listwise.listwise_surrogate(s.unsqueeze(-1), c.unsqueeze(-1)).sum()
    return ListwiseTerms(total=total, s=s.detach(), c=c.detach())


@torch.no_grad()
def token_statistics(log_probs: torch.Tensor, old_log_probs: torch.Tensor, action_mask: torch.Tensor,
                     clip_eps: ClipEps, rollout_log_probs: Optional[torch.Tensor] = None,
                     correction_band: Optional[Tuple[float, float]] = None) -> Dict[str, torch.Tensor]:
    """Sums over the micro-batch's response tokens (0-d float64 tensors on the log-probs' device, no host sync):
    ``tokens``; ``out_of_band``, the tokens whose log pi_theta - log pi_old lies outside
    [log(1-eps_low), log(1+eps_high)] (the clip ratio of every method is out_of_band / tokens); ``ppo_kl_sum`` of
    log pi_old - log pi_theta; with ``rollout_log_probs`` and ``correction_band`` (low, high) also ``vllm_kl_sum``
    of log mu - log pi_old and ``filtered``, the tokens whose ratio pi_old / mu lies outside [low, high]."""
    lo, hi = clip_bounds(clip_eps)
    mask = action_mask.to(torch.float64)
    old = old_log_probs.detach().double()
    raw = log_probs.detach().double() - old
    outside = (raw < math.log1p(-lo)) | (raw > math.log1p(hi)) if lo < 1.0 else raw > math.log1p(hi)
    out = {"tokens": mask.sum(), "out_of_band": (outside.to(torch.float64) * mask).sum(),
           "ppo_kl_sum": (-raw * mask).sum()}
    if rollout_log_probs is not None and correction_band is not None:
        behaviour = old - rollout_log_probs.detach().double()
        low, high = correction_band
        off = (behaviour < math.log(low)) | (behaviour > math.log(high)) if low > 0 else behaviour > math.log(high)
        out["vllm_kl_sum"] = (-behaviour * mask).sum()
        out["filtered"] = (off.to(torch.float64) * mask).sum()
    return out
