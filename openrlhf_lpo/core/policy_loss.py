"""Policy-loss types beyond OpenRLHF 0.11.2's ``ppo`` / ``gspo`` (``--actor.policy_loss_type``), shared by
both backends: the registry, the refusals and the 5-tuple ``PolicyLoss`` returns.

A type is a per-token loss ``fn(log_probs, old_log_probs, advantages, eps_low, eps_high, rollout_log_probs,
is_correction) -> (loss [B,T], clipped [B,T] bool, filtered [B,T] bool or None)``; the backends aggregate it
with upstream's ``aggregate_loss`` and ``masked_mean``, which they hand in (this room imports no OpenRLHF).

Public names (stable):
    POLICY_LOSS_TYPES, register_policy_loss_type(name), token_correction(level, mode, gating, threshold, type,
    dual_clip) -> None or (mode, low, high), policy_loss_outputs(...) -> (loss, clip_ratio, ppo_kl, vllm_kl,
    is_filter_ratio)
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from openrlhf_lpo import listwise
from openrlhf_lpo.registry import registrar

__all__ = ["POLICY_LOSS_TYPES", "register_policy_loss_type", "token_correction", "policy_loss_outputs"]

POLICY_LOSS_TYPES: Dict[str, Callable] = {}


def register_policy_loss_type(name: str):
    """Register a per-token loss as ``--actor.policy_loss_type <name>`` (like ``listwise.register_pg_estimator``);
    OpenRLHF's own types cannot be shadowed."""
    if name in ("ppo", "gspo"):
        raise ValueError(f"policy loss type {name!r} is OpenRLHF's own; pick another name")
    return registrar(POLICY_LOSS_TYPES, "policy loss type", name)


@register_policy_loss_type("cispo")
def _cispo(log_probs, old_log_probs, advantages, eps_low, eps_high, rollout_log_probs=None, is_correction=None):
    """CISPO (MiniMax-M1 Eq. 4): -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi_theta per token."""
    return listwise.cispo_token_loss(log_probs, old_log_probs, advantages, eps_low, eps_high,
                                     rollout_log_probs=rollout_log_probs, is_correction=is_correction)


def token_correction(level: str, mode: str, gating: str, threshold: Sequence[float], policy_loss_type: str,
                     dual_clip=None) -> Optional[Tuple[str, float, float]]:
    """The token-level train/rollout correction a registered type applies (None when off); refuses, naming the
    flag, what the registered types do not implement (dual clip, the sequence level, gates other than ratio)."""
    if dual_clip is not None:
        raise ValueError(f"--actor.dual_clip is a PPO option; --actor.policy_loss_type {policy_loss_type} has no "
                         "clipped objective to bound")
    if level not in ("off", "token") or (level == "token" and gating != "ratio"):
        raise ValueError(f"--algo.advantage.is_correction_level {level} with --algo.advantage.is_correction_gating "
                         f"{gating} is not implemented for --actor.policy_loss_type {policy_loss_type}; use the token "
                         "level with the ratio gate")
    return (mode, float(threshold[0]), float(threshold[1])) if level == "token" else None


def policy_loss_outputs(loss_fn, log_probs, old_log_probs, advantages, action_mask, rollout_log_probs, normalisers,
                        aggregate: Callable, masked_mean: Callable):
    """``PolicyLoss``'s 5-tuple for ``loss_fn`` (an ``ExtendedPolicyLoss`` / ``RegisteredPolicyLoss``: its
    ``policy_loss_type``, ``clip_eps_low/high``, ``correction``, ``token_level_loss``): upstream's ``aggregate``
    (token / sequence aggregation with ``normalisers`` = (dp_size, batch_num_tokens, global_batch_size)), the fraction of tokens whose ratio left the band, the masked
    mean of log pi_old - log pi_theta and, with the correction, ``vllm_kl`` (masked mean of log mu - log pi_old)
    and the fraction of tokens it truncated or dropped (else None)."""
    mask = torch.ones_like(log_probs) if action_mask is None else action_mask
    per_token, clipped, filtered = POLICY_LOSS_TYPES[loss_fn.policy_loss_type](
        log_probs, old_log_probs, advantages, loss_fn.clip_eps_low, loss_fn.clip_eps_high,
        rollout_log_probs=rollout_log_probs, is_correction=loss_fn.correction)
    dp_size, batch_num_tokens, global_batch_size = normalisers
    loss = aggregate(per_token, mask, token_level_loss=loss_fn.token_level_loss, dp_size=dp_size,
                     batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size)
    clip_ratio = masked_mean(clipped.to(log_probs.dtype), mask, dim=None)
    ppo_kl = masked_mean(-(log_probs - old_log_probs).detach(), mask, dim=None)
    vllm_kl = is_filter_ratio = None
    if filtered is not None:
        vllm_kl = masked_mean((rollout_log_probs - old_log_probs).detach(), mask, dim=None)
        is_filter_ratio = masked_mean(filtered.to(log_probs.dtype), mask, dim=None)
    return loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio
