"""Policy-loss types beyond OpenRLHF 0.11.2's ``ppo`` / ``gspo`` (``--actor.policy_loss_type``), shared by
both backends: the registry, the refusals and the 5-tuple ``PolicyLoss`` returns.

A type is a per-token loss ``fn(log_probs, old_log_probs, advantages, eps_low, eps_high, rollout_log_probs,
is_correction, action_mask, context) -> (loss [B,T], clipped [B,T] bool, filtered [B,T] bool or None)``; the
backends aggregate it with upstream's ``aggregate_loss`` and ``masked_mean``, which they hand in (this room imports
no OpenRLHF). ``context`` is a :class:`PolicyLossContext`: the type's options (its ``--actor.<option>`` flags),
``--train.seed`` and the optimizer step (for a seeded random choice). ``clipped`` is what ``ppo_clip_ratio``
logs: the tokens whose ratio left the band (CISPO), the tokens the covariance rule selected (Clip-Cov, KL-Cov).

Registered: ``cispo`` (MiniMax-M1, arXiv 2506.13585), ``clip_cov`` and ``kl_cov`` (arXiv 2505.22617, core/covariance.py).

Public names (stable):
    POLICY_LOSS_TYPES, PolicyLossType, TypeOption, PolicyLossContext, register_policy_loss_type(name, options,
    clips), type_options(policy_loss_type, values) -> ((name, value), ...), policy_loss_options(args),
    token_correction(level, mode, gating,
    threshold, type, dual_clip) -> None or (mode, low, high), policy_loss_outputs(...) -> (loss, clip_ratio, ppo_kl,
    vllm_kl, is_filter_ratio)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple

import torch

from openrlhf_lpo import listwise
from openrlhf_lpo.core import covariance
from openrlhf_lpo.registry import register_unique

__all__ = ["POLICY_LOSS_TYPES", "PolicyLossType", "TypeOption", "PolicyLossContext", "register_policy_loss_type",
           "type_options", "policy_loss_options", "token_correction", "policy_loss_outputs"]


@dataclass(frozen=True)
class TypeOption:
    """A hyper-parameter of a type, the flag ``--actor.<name>``: its default (the paper's), help, and the test a
    value must pass (``check``) with the requirement the error states."""

    name: str
    default: float
    help: str
    check: Callable[[float], bool] = lambda v: math.isfinite(v)
    need: str = "a finite number"


@dataclass(frozen=True)
class PolicyLossType:
    """A registered ``--actor.policy_loss_type``: the per-token loss, its options, and whether it reads
    ``--actor.eps_clip_low_high`` (``clips``; KL-Cov has no ratio clip)."""

    name: str
    fn: Callable
    options: Tuple[TypeOption, ...] = ()
    clips: bool = True

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


@dataclass(frozen=True)
class PolicyLossContext:
    """What a type may read beyond the tokens: its options by name, ``--train.seed`` and the optimizer step."""

    options: Mapping[str, float] = field(default_factory=dict)
    seed: int = 42
    step: int = 0


POLICY_LOSS_TYPES: Dict[str, PolicyLossType] = {}


def register_policy_loss_type(name: str, options: Sequence[TypeOption] = (), clips: bool = True):
    """Register a per-token loss as ``--actor.policy_loss_type <name>`` (like ``listwise.register_pg_estimator``);
    OpenRLHF's own types cannot be shadowed. ``options`` become ``--actor.<option>`` flags (cli/policy_loss_types.py)."""
    if name in ("ppo", "gspo"):
        raise ValueError(f"policy loss type {name!r} is OpenRLHF's own; pick another name")

    def deco(fn):
        register_unique(POLICY_LOSS_TYPES, "policy loss type", name, PolicyLossType(name, fn, tuple(options), clips))
        return fn

    return deco


def type_options(policy_loss_type: str, values: Optional[Mapping[str, float]] = None) -> Tuple[Tuple[str, float], ...]:
    """The options of a registered type, ((name, value), ...): ``values`` where given, the defaults elsewhere; ()
    for a type without options or one that is not registered (ppo, gspo)."""
    kind = POLICY_LOSS_TYPES.get(policy_loss_type)
    values = values or {}
    return tuple((o.name, float(values[o.name]) if values.get(o.name) is not None else o.default)
                 for o in (kind.options if kind else ()))


def policy_loss_options(args) -> Tuple[Tuple[str, float], ...]:
    """:func:`type_options` of the run's ``--actor.policy_loss_type`` from its ``--actor.<option>`` flags."""
    actor = getattr(args, "actor", None)
    kind = getattr(actor, "policy_loss_type", "ppo")
    known = POLICY_LOSS_TYPES[kind].options if kind in POLICY_LOSS_TYPES else ()
    return type_options(kind, {o.name: getattr(actor, o.name, None) for o in known})


@register_policy_loss_type("cispo")
def _cispo(log_probs, old_log_probs, advantages, eps_low, eps_high, rollout_log_probs=None, is_correction=None,
           action_mask=None, context=None):
    """CISPO (MiniMax-M1 Eq. 4): -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi_theta per token."""
    return listwise.cispo_token_loss(log_probs, old_log_probs, advantages, eps_low, eps_high,
                                     rollout_log_probs=rollout_log_probs, is_correction=is_correction)


_FRACTION = dict(check=lambda v: 0.0 < v <= 1.0, need="a fraction of the tokens in (0, 1]")


@register_policy_loss_type("clip_cov", options=(
    TypeOption("clip_cov_ratio", 2e-4, "Clip-Cov: the fraction r of a micro-batch's tokens whose gradient is detached "
               "(at least 1), drawn among those with covariance in (clip_cov_lb, clip_cov_ub) (default 2e-4)",
               **_FRACTION),
    TypeOption("clip_cov_lb", 1.0, "Clip-Cov: the covariance band's lower end omega_low (default 1)"),
    TypeOption("clip_cov_ub", 5.0, "Clip-Cov: the covariance band's upper end omega_high (default 5)")))
def _clip_cov(log_probs, old_log_probs, advantages, eps_low, eps_high, rollout_log_probs=None, is_correction=None,
              action_mask=None, context=None):
    """Clip-Cov (arXiv 2505.22617, Sec. 5): PPO's clipped loss with a random r N of the tokens whose covariance lies
    in (omega_low, omega_high) detached (core/covariance.py)."""
    o = context.options
    return covariance.clip_cov_token_loss(log_probs, old_log_probs, advantages, eps_low, eps_high, action_mask,
                                          o["clip_cov_ratio"], o["clip_cov_lb"], o["clip_cov_ub"], context.seed,
                                          context.step, rollout_log_probs=rollout_log_probs, is_correction=is_correction)


@register_policy_loss_type("kl_cov", clips=False, options=(
    TypeOption("kl_cov_ratio", 2e-3, "KL-Cov: the fraction k of a micro-batch's tokens (at least 1), those of "
               "largest covariance, whose loss adds kl_cov_coef |log r| (default 2e-3, the paper's 7B setting; "
               "2e-4 for 32B)", **_FRACTION),
    TypeOption("kl_cov_coef", 1.0, "KL-Cov: the coefficient beta of |log pi_theta - log pi_old| (default 1)",
               check=lambda v: math.isfinite(v) and v >= 0.0, need="a coefficient >= 0")))
def _kl_cov(log_probs, old_log_probs, advantages, eps_low, eps_high, rollout_log_probs=None, is_correction=None,
            action_mask=None, context=None):
    """KL-Cov (arXiv 2505.22617, Sec. 5): -r A per token, no clip, plus beta |log r| on the top k N tokens by
    covariance (core/covariance.py)."""
    o = context.options
    return covariance.kl_cov_token_loss(log_probs, old_log_probs, advantages, action_mask, o["kl_cov_ratio"],
                                        o["kl_cov_coef"], rollout_log_probs=rollout_log_probs,
                                        is_correction=is_correction)


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
    ``policy_loss_type``, ``clip_eps_low/high``, ``correction``, ``token_level_loss`` and ``context()``, the
    :class:`PolicyLossContext` of this call): upstream's ``aggregate`` (token / sequence aggregation with
    ``normalisers`` = (dp_size, batch_num_tokens, global_batch_size)), the fraction of tokens the type marks as
    clipped, the masked mean of log pi_old - log pi_theta and, with the correction, ``vllm_kl`` (masked mean of
    log mu - log pi_old) and the fraction of tokens it truncated or dropped (else None)."""
    mask = torch.ones_like(log_probs) if action_mask is None else action_mask
    per_token, clipped, filtered = POLICY_LOSS_TYPES[loss_fn.policy_loss_type](
        log_probs, old_log_probs, advantages, loss_fn.clip_eps_low, loss_fn.clip_eps_high,
        rollout_log_probs=rollout_log_probs, is_correction=loss_fn.correction, action_mask=mask,
        context=loss_fn.context())
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
