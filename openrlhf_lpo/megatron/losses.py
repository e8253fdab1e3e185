"""Per-micro-batch policy losses for the Megatron actor (run on the last pipeline stage).

Every loss returns ``(loss_sum, count, stats)``: megatron's schedule (with
``calculate_per_token_loss=True``) back-propagates ``loss_sum`` unchanged and
``finalize_model_grads`` divides all gradients by the ``count`` summed over micro-batches and
data-parallel ranks. So the optimizer sees the *global* mean over whatever ``count`` counts,
independent of the TP/PP/DP layout and of how sequences are split into micro-batches.

Listwise losses count **responses** and multiply the per-group loss by K: the sum over groups of
D_g divided by the number of groups G equals ``sum_g K*D_g / (G*K)``, i.e. the LPO objective
(mean over prompts, Eq. 10/11) whatever the grouping of micro-batches.

Off-policy LPO composes without change: the target carried by each sample is
w* = softmax(R/tau + s_t) (Eq. 8, s_t = the start-of-update policy against the behaviour policy,
``info["lpo_prev_log_ratio"]``) and s is measured against the same behaviour (old) log-probs, so
at the start of an update s = s_t and a group with equal rewards already has P = w*.

Registry ``POLICY_LOSSES``: name -> fn(log_probs[b,A], mb: dict, spec: LossSpec) -> (sum, count, stats).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import torch

from openrlhf_lpo import listwise

POLICY_LOSSES: Dict[str, Callable] = {}


@dataclass
class LossSpec:
    """What to optimise. ``name`` in POLICY_LOSSES.

    * ``listwise``: LPO with whole groups per micro-batch (``projection`` listwise or pointwise).
    * ``listwise_surrogate``: LPO two-pass surrogate sum_k stopgrad(c_k) s_k (groups may straddle
      micro-batches; c from a no-grad pass at the same parameters).
    * ``pg``: PPO-clip token surrogate with per-response advantages (GRPO, Dr.GRPO, MaxRL via
      ``listwise.pg_advantages``), aggregated as the mean over responses of the token mean.

    ``clip_eps``: one epsilon or ``(low, high)`` (``--actor.eps_clip_low_high``, clip-higher).
    """

    name: str = "listwise"
    group_size: int = 8
    divergence: str = "fwd"
    projection: str = "listwise"
    clip_eps: float = 0.2
    loss_agg_mode: str = "seq-mean-token-mean"  # pg only: or "token-mean"


def register_policy_loss(name: str):
    def deco(fn):
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        return fn

    return deco


def get_policy_loss(name: str):
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; registered: {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


def clip_bounds(clip_eps) -> Tuple[float, float]:
    """(low, high) from one epsilon or a pair."""
    if isinstance(clip_eps, (tuple, list)):
        lo, hi = clip_eps
        return float(lo), float(hi)
    return float(clip_eps), float(clip_eps)


def _count(n: int) -> torch.Tensor:
    return torch.tensor(n, dtype=torch.int)


@register_policy_loss("listwise")
def _listwise(log_probs, mb, spec: LossSpec) -> Tuple[torch.Tensor, torch.Tensor, dict]:
    """LPO on whole groups: K * sum_g D(w*_g, softmax(s_g)) (Eq. 4, 8, 10/11)."""
    b = log_probs.shape[0]
    K = spec.group_size
    if b % K:
        raise ValueError(f"micro-batch of {b} responses does not hold whole groups of K={K}")
    s = listwise.sequence_log_ratio(log_probs, mb["old_log_probs"], mb["action_mask"], spec.clip_eps)
    g = b // K
    per_group_mean = listwise.listwise_loss(
        s.view(g, K), mb["target"].view(g, K), spec.divergence, spec.projection
    )
    return per_group_mean * g * K, _count(b), {"loss_sum": per_group_mean.detach() * g, "loss_count": g}


@register_policy_loss("listwise_surrogate")
def _listwise_surrogate(log_probs, mb, spec: LossSpec):
    """Two-pass LPO: K * sum_k stopgrad(c_k) s_k with c from ``projection_coefficients`` (the
    gradient of the projection's loss: dD/ds for listwise, -w* for pointwise)."""
    s = listwise.sequence_log_ratio(log_probs, mb["old_log_probs"], mb["action_mask"], spec.clip_eps)
    sur = listwise.listwise_surrogate(s.unsqueeze(-1), mb["coefficients"].unsqueeze(-1))
    return sur.sum() * spec.group_size, _count(s.shape[0]), {"surrogate_sum": sur.detach().sum()}


@register_policy_loss("pg")
def _pg(log_probs, mb, spec: LossSpec):
    """PPO-clip surrogate -min(r A, clip(r, 1-eps_low, 1+eps_high) A) per token, mean over tokens
    then over responses (OpenRLHF's ``seq-mean-token-mean``; A per response [b] or per token [b, A])."""
    mask = mb["action_mask"].to(log_probs.dtype)
    ratio = torch.exp((log_probs - mb["old_log_probs"]).clamp(-20.0, 20.0))
    adv = mb["advantages"].to(log_probs.dtype)
    if adv.dim() == 1:  # one advantage per response, else OpenRLHF's per-token [b, A]
        adv = adv.unsqueeze(-1)
    lo, hi = clip_bounds(spec.clip_eps)
    clipped = ratio.clamp(1 - lo, 1 + hi)
    surr = -torch.minimum(ratio * adv, clipped * adv)
    stats = {"clip_sum": float((((ratio < 1 - lo) | (ratio > 1 + hi)).to(mask.dtype) * mask).sum())}
    if spec.loss_agg_mode == "token-mean":
        total = (surr * mask).sum()
        stats.update(loss_sum=total.detach(), loss_count=float(mask.sum()))
        return total, _count(int(mask.sum())), stats
    if spec.loss_agg_mode != "seq-mean-token-mean":
        raise ValueError(f"--actor.loss_agg_mode {spec.loss_agg_mode!r}: use token-mean or seq-mean-token-mean")
    per_seq = (surr * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    stats["loss_sum"] = per_seq.detach().sum()
    return per_seq.sum(), _count(log_probs.shape[0]), stats
