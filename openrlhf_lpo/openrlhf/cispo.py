"""Policy-loss types beyond OpenRLHF 0.11.2's ``ppo`` / ``gspo`` on the DeepSpeed actor: CISPO, Clip-Cov and KL-Cov
as ``--actor.policy_loss_type cispo | clip_cov | kl_cov`` (the registry of core/policy_loss.py).

CISPO (MiniMax-M1, arXiv 2506.13585, Eq. 4-5) is REINFORCE with the importance ratio clipped and
detached as a token weight:

    L = -(1/sum_i |o_i|) sum_i sum_t sg(clip(r_it, 1 - eps_low, 1 + eps_high)) A_it log pi_theta(o_it),
    r_it = pi_theta(o_it) / pi_old(o_it),

with eps_low, eps_high = ``--actor.eps_clip_low_high`` (eps_low >= 1: no lower bound) and the
aggregation of ``--actor.loss_agg_mode`` (``token-mean`` is the paper's 1/sum_i |o_i|). The per-token
math is ``openrlhf_lpo.listwise.cispo_token_loss``; the registry, the refusals and the 5-tuple are
``openrlhf_lpo.core.policy_loss`` (shared with the Megatron actor's pg loss).

How it enters upstream (patch point ``policy-loss-types``, openrlhf/patches.py): ``ActorPPOTrainer.__init__``
builds ``self.actor_loss_fn = PolicyLoss(..., policy_loss_type=args.actor.policy_loss_type)``, looking
``PolicyLoss`` up in ``openrlhf.trainer.ray.ppo_actor`` at call time. :func:`policy_loss_types` swaps that
name for :class:`ExtendedPolicyLoss` for the duration of one call (the policy actor's
``init_model_from_pretrained``); the subclass computes the registered types and hands every other type
(``ppo``, ``gspo``) to the stock ``PolicyLoss.forward`` unchanged.

Public names (stable):
    POLICY_LOSS_TYPES                name -> fn(log_probs, old_log_probs, advantages, eps_low, eps_high,
                                     rollout_log_probs, is_correction) -> (per-token loss [B,T], clipped [B,T]
                                     bool, filtered [B,T] bool or None)
    register_policy_loss_type(name)  decorator adding an entry (like ``listwise.register_pg_estimator``)
    ExtendedPolicyLoss               ``openrlhf.models.loss.PolicyLoss`` + the registered types
    policy_loss_types()              context manager: the scoped swap of ``ppo_actor.PolicyLoss``
    bind_policy_loss(trainer, args)  the run's type options, --train.seed and the engine's step into the built loss
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from openrlhf.models.loss import PolicyLoss, aggregate_loss
from openrlhf.models.utils import masked_mean

from openrlhf_lpo.core.policy_loss import (POLICY_LOSS_TYPES, PolicyLossContext, policy_loss_options,
                                           policy_loss_outputs, register_policy_loss_type, token_correction,
                                           type_options)

__all__ = ["POLICY_LOSS_TYPES", "register_policy_loss_type", "ExtendedPolicyLoss", "policy_loss_types",
           "bind_policy_loss"]


class ExtendedPolicyLoss(PolicyLoss):
    """OpenRLHF's ``PolicyLoss`` that also computes the registered ``policy_loss_type`` s (same constructor,
    same ``forward`` signature and 5-tuple ``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)``).

    For a registered type the loss is ``aggregate_loss`` (upstream's token / sequence aggregation with the
    global normalisers the trainer passes) of the type's per-token loss; ``clip_ratio`` is the fraction of
    tokens whose ratio left the band, ``ppo_kl`` the masked mean of log pi_old - log pi_theta; with
    ``--algo.advantage.is_correction_level token`` (gating ``ratio``, mode ``clip``/``mask``) the per-token loss is
    weighted by the train/rollout correction and ``vllm_kl`` (masked mean of log mu - log pi_old) and
    ``is_filter_ratio`` (tokens truncated or dropped) are returned as upstream's PPO returns them, else None.
    The sequence level and the binary_kl / tv gates are refused (``cli/policy_loss_types.py``)."""

    def __init__(self, clip_eps_low: float = 0.2, clip_eps_high: float = 0.2, dual_clip: float = None,
                 token_level_loss: bool = True, policy_loss_type: str = "ppo", is_correction_level: str = "off",
                 is_correction_mode: str = "mask", is_correction_gating: str = "ratio",
                 is_correction_threshold: list = (0.5, 5.0)) -> None:
        registered = policy_loss_type in POLICY_LOSS_TYPES
        super().__init__(clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high, dual_clip=dual_clip,
                         token_level_loss=token_level_loss, policy_loss_type="ppo" if registered else policy_loss_type,
                         is_correction_level=is_correction_level, is_correction_mode=is_correction_mode,
                         is_correction_gating=is_correction_gating, is_correction_threshold=is_correction_threshold)
        self.policy_loss_type = policy_loss_type
        self.correction = None
        if registered:
            self.correction = token_correction(is_correction_level, is_correction_mode, is_correction_gating,
                                               is_correction_threshold, policy_loss_type, dual_clip)
        # the type's options (defaults until bind_policy_loss sets the run's flags), --train.seed, the step
        self.options = dict(type_options(policy_loss_type))
        self.seed = 42
        self.step_source = lambda: 0

    def context(self) -> PolicyLossContext:
        """The options, seed and current optimizer step a registered type reads (core/policy_loss.py)."""
        return PolicyLossContext(self.options, self.seed, int(self.step_source()))

    def forward(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        action_mask: Optional[torch.Tensor] = None,
        rollout_log_probs: Optional[torch.Tensor] = None,
        dp_size: int = 1,
        batch_num_tokens: Optional[float] = None,
        global_batch_size: Optional[float] = None,
    ):
        if self.policy_loss_type not in POLICY_LOSS_TYPES:
            return super().forward(log_probs, old_log_probs, advantages, action_mask=action_mask,
                                   rollout_log_probs=rollout_log_probs, dp_size=dp_size,
                                   batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size)
        return policy_loss_outputs(self, log_probs, old_log_probs, advantages, action_mask, rollout_log_probs,
                                   (dp_size, batch_num_tokens, global_batch_size), aggregate_loss, masked_mean)


def bind_policy_loss(trainer, args) -> None:
    """After the policy actor built its trainer: the run's ``--actor.<option>`` values and ``--train.seed`` go into
    a registered type's loss, and its step is the DeepSpeed engine's optimizer-step count (restored by a resume),
    so a seeded draw (Clip-Cov) repeats on a rerun. Other losses are left as they are."""
    loss_fn = getattr(trainer, "actor_loss_fn", None)
    loss_fn = getattr(loss_fn, "inner", loss_fn)  # the trainer meters its loss (actor_trainer.MeteredLoss)
    if not isinstance(loss_fn, ExtendedPolicyLoss) or loss_fn.policy_loss_type not in POLICY_LOSS_TYPES:
        return
    loss_fn.options = dict(policy_loss_options(args))
    loss_fn.seed = int(args.train.seed)
    engine = getattr(getattr(trainer, "actor", None), "model", None)
    loss_fn.step_source = lambda: int(getattr(engine, "global_steps", 0) or 0)


@contextlib.contextmanager
def policy_loss_types():
    """Patch point ``policy-loss-types``: ``openrlhf.trainer.ray.ppo_actor.PolicyLoss`` is
    :class:`ExtendedPolicyLoss` inside the block (the trainer keeps the instance it built), restored on exit."""
    from openrlhf.trainer.ray import ppo_actor

    old = ppo_actor.PolicyLoss
    ppo_actor.PolicyLoss = ExtendedPolicyLoss
    try:
        yield ExtendedPolicyLoss
    finally:
        ppo_actor.PolicyLoss = old
