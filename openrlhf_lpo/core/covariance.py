"""Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
Models", arXiv 2505.22617, Sec. 5): the covariance-ranked token selection and the two per-token losses, in pure
torch (the ``--actor.policy_loss_type clip_cov`` / ``kl_cov`` of both backends, registered in core/policy_loss.py).

The set is the tokens of one policy-loss call: one micro-batch of one data-parallel rank, as in the authors' code
(verl's ``compute_policy_loss_clip_cov`` / ``_kl_cov``, called per micro-batch). Over its N response tokens,
with A_i the token's advantage and log pi(y_i) its log-probability at the current parameters (detached),

    Cov(y_i) = (log pi(y_i) - (1/N) sum_j log pi(y_j)) (A_i - (1/N) sum_j A_j)        (Sec. 5.1)

Clip-Cov: I_clip = max(floor(r N), 1) tokens drawn uniformly at random (without replacement; all of them if fewer)
among those with omega_low < Cov < omega_high whose PPO ratio is not clipped already; their loss is 0 (the
gradient of those tokens detached), the rest keep PPO's clipped loss max(-r_i A_i, -clip(r_i, 1 - eps_low,
1 + eps_high) A_i). KL-Cov: I_KL = the max(floor(k N), 1) tokens of largest Cov (ties: the earlier token, in
row-major order); every token's loss is the unclipped -r_i A_i, and those of I_KL add beta |log r_i|.
r_i = pi_theta(y_i) / pi_old(y_i). Defaults (the paper's, for Qwen2.5-7B): r = 2e-4, omega = (1, 5); k = 2e-3,
beta = 1 (k = 2e-4 for 32B).

The random draw is seeded from ``--train.seed``, the optimizer step and the candidate tokens themselves
(:func:`selection_seed`), on the CPU: the same tokens at the same step are selected on any device, backend or rank.

Public names (stable):
    token_covariance(log_probs, advantages, mask) -> Cov [B,T] float64 (0 off the mask)
    clip_cov_selection(cov, eligible, n_valid, ratio, lower, upper, seed) -> bool [B,T]
    kl_cov_selection(cov, mask, ratio) -> bool [B,T]
    selection_seed(seed, step, candidates) -> int
    clip_cov_token_loss(...), kl_cov_token_loss(...) -> (loss [B,T], selected [B,T], filtered [B,T] or None)
"""

from __future__ import annotations

import math
import zlib
from typing import Optional, Tuple

import torch

from openrlhf_lpo import listwise

Tensor = torch.Tensor

__all__ = ["token_covariance", "clip_cov_selection", "kl_cov_selection", "selection_seed", "clip_cov_token_loss",
           "kl_cov_token_loss"]


def _wide(x: Tensor) -> Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def token_covariance(log_probs: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """Cov(y_i) = (log pi(y_i) - mean log pi)(A_i - mean A) per token, means over the masked tokens, float64,
    0 off the mask (Sec. 5.1). Detached."""
    m = mask.to(torch.float64)
    n = m.sum().clamp(min=1.0)
    lp = log_probs.detach().to(torch.float64)
    adv = advantages.detach().to(torch.float64)
    lp_c = lp - (lp * m).sum() / n
    adv_c = adv - (adv * m).sum() / n
    return lp_c * adv_c * m


def selection_seed(seed: int, step: int, candidates: Tensor) -> int:
    """A 63-bit seed from ``--train.seed``, the optimizer step and the candidates' flat indices (int64 [n]): equal
    inputs give equal draws on any device or backend, different micro-batches of one step draw apart."""
    head = f"{int(seed)}:{int(step)}:{candidates.numel()}".encode()
    crc = zlib.crc32(candidates.to(torch.int64).cpu().numpy().tobytes(), zlib.crc32(head))
    return (int(seed) * 1_000_003 + int(step) * 7_919 + crc) % (2 ** 63 - 1)


def clip_cov_selection(cov: Tensor, eligible: Tensor, n_valid: int, ratio: float, lower: float, upper: float,
                       seed: int, step: int) -> Tensor:
    """I_clip: min(max(floor(ratio n_valid), 1), #candidates) tokens drawn uniformly without replacement from the
    candidates ``eligible & (lower < cov < upper)`` (row-major flat order, ``torch.randperm`` on a CPU generator
    seeded by :func:`selection_seed`). Returns a bool mask shaped like ``cov``."""
    candidates = (eligible.bool() & (cov > lower) & (cov < upper)).reshape(-1).nonzero().reshape(-1).cpu()
    chosen = torch.zeros(cov.numel(), dtype=torch.bool)
    if candidates.numel():
        want = min(max(int(ratio * n_valid), 1), candidates.numel())
        g = torch.Generator().manual_seed(selection_seed(seed, step, candidates))
        chosen[candidates[torch.randperm(candidates.numel(), generator=g)[:want]]] = True
    return chosen.view(cov.shape).to(cov.device)


def kl_cov_selection(cov: Tensor, mask: Tensor, ratio: float) -> Tensor:
    """I_KL: the max(floor(ratio N), 1) masked tokens of largest covariance (a stable sort: among equal values the
    earlier token in row-major order). Returns a bool mask shaped like ``cov``."""
    valid = mask.bool().reshape(-1).nonzero().reshape(-1)
    chosen = torch.zeros(cov.numel(), dtype=torch.bool, device=cov.device)
    if valid.numel():
        k = min(max(int(ratio * valid.numel()), 1), valid.numel())
        order = torch.sort(-cov.reshape(-1)[valid], stable=True).indices[:k]
        chosen[valid[order]] = True
    return chosen.view(cov.shape)


def _check(name: str, value: float, ok: bool, need: str) -> None:
    if not ok:
        raise ValueError(f"--actor.{name} {value}: {need}")


def clip_cov_token_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, eps_low: float, eps_high: float,
                        action_mask: Tensor, ratio: float = 2e-4, lower: float = 1.0, upper: float = 5.0,
                        seed: int = 42, step: int = 0, rollout_log_probs: Optional[Tensor] = None,
                        is_correction: Optional[tuple] = None) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Clip-Cov's per-token loss (module doc): PPO's clipped loss with the tokens of I_clip set to 0. With
    ``is_correction`` (mode, low, high) each token is weighted by the detached train/rollout ratio pi_old/mu as for
    CISPO (listwise.token_is_weight). Returns (loss [B,T] in the dtype of ``log_probs``, I_clip, filtered or None)."""
    _check("clip_cov_ratio", ratio, 0.0 < ratio <= 1.0, "the fraction of tokens to detach must be in (0, 1]")
    _check("clip_cov_ub", upper, lower < upper, f"the covariance band needs lower < upper (lower {lower})")
    mask = action_mask.bool()
    log_ratio = _wide(log_probs) - _wide(old_log_probs)
    r = log_ratio.exp()
    adv = _wide(advantages)
    lo = 1.0 - eps_low
    plain, clipped = -adv * r, -adv * r.clamp(min=lo, max=1.0 + eps_high)
    ppo_clipped = (clipped > plain) & mask
    cov = token_covariance(log_probs, advantages, mask)
    selected = clip_cov_selection(cov, mask & ~ppo_clipped, int(mask.sum()), ratio, lower, upper, seed, step)
    loss = torch.where(selected, torch.zeros_like(plain), torch.maximum(plain, clipped))
    weight, filtered = listwise.token_is_weight(old_log_probs, rollout_log_probs, is_correction)
    if weight is not None:
        loss = loss * weight
    return loss.to(log_probs.dtype), selected, filtered


def kl_cov_token_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, action_mask: Tensor,
                      ratio: float = 2e-3, coef: float = 1.0, rollout_log_probs: Optional[Tensor] = None,
                      is_correction: Optional[tuple] = None) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """KL-Cov's per-token loss (module doc): -r_i A_i, plus beta |log r_i| on the tokens of I_KL; no ratio clip.
    ``is_correction`` as for :func:`clip_cov_token_loss`. Returns (loss [B,T], I_KL, filtered or None)."""
    _check("kl_cov_ratio", ratio, 0.0 < ratio <= 1.0, "the fraction of tokens to penalise must be in (0, 1]")
    _check("kl_cov_coef", coef, math.isfinite(coef) and coef >= 0.0, "the KL coefficient must be >= 0")
    mask = action_mask.bool()
    log_ratio = _wide(log_probs) - _wide(old_log_probs)
    loss = -_wide(advantages) * log_ratio.exp()
    selected = kl_cov_selection(token_covariance(log_probs, advantages, mask), mask, ratio)
    loss = loss + torch.where(selected, coef * log_ratio.abs(), torch.zeros_like(loss))
    weight, filtered = listwise.token_is_weight(old_log_probs, rollout_log_probs, is_correction)
    if weight is not None:
        loss = loss * weight
    return loss.to(log_probs.dtype), selected, filtered
