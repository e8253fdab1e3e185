"""Per-micro-batch policy losses for the Megatron actor (run on the last pipeline stage).

Every loss returns ``(loss_sum, count, stats)``: megatron's schedule (with
``calculate_per_token_loss=True``) back-propagates ``loss_sum`` unchanged and
``finalize_model_grads`` divides all gradients by the ``count`` summed over micro-batches and
data-parallel ranks. So the optimizer sees the *global* mean over whatever ``count`` counts,
independent of the TP/PP/DP layout and of how sequences are split into micro-batches.

Listwise losses are core/loss.py's (written once for both backends); this module keeps Megatron's
normalisation: they count **responses** and multiply the per-group loss by K, so the sum over groups of
D_g divided by the number of groups G equals ``sum_g K*D_g / (G*K)``, i.e. the LPO objective
(mean over prompts, Eq. 10/11) whatever the grouping of micro-batches.

Off-policy LPO (async training, partial rollout, ``--algo.advantage.is_correction_*``) is the
DeepSpeed trainer's placement (``openrlhf_lpo/core/offpolicy.py``): each sample carries
w* = softmax(R/tau + s_t) (Eq. 8) and s_t = delta (``prev_log_ratio``: the corrected
log pi_t - log mu, 0 when the correction is off), and s = (1/n) sum_t clip(log pi_theta - log pi_t) + delta
over the tokens the correction keeps (``mask`` mode drops tokens, ``rollout_log_probs`` = mu). At the start
of the update s = s_t, so a group with equal rewards already has P = w*.

The policy-gradient estimators use OpenRLHF's own ``PolicyLoss`` (PPO clip with clip-higher, dual clip,
GSPO, the train/rollout importance-sampling correction), asked for sums: with ``batch_num_tokens = 1``
(token mean) or ``global_batch_size = 1`` (sequence mean) and ``dp_size = 1`` its ``aggregate_loss`` returns
the masked sum, and ``count`` (tokens, or responses with at least one token) makes megatron divide by the
global total exactly as DeepSpeed's window normalisers do.

KL and entropy terms (``--algo.kl.use_loss``, ``--actor.entropy_coef``) are token means over the optimizer
window like the DeepSpeed trainer's (``aggregate_loss`` with the window's global token count): the actor
adds ``coef * sum(term * mask) * C / T`` to each micro-batch's sum, C and T being the window's global count
and token total, so after megatron's division by C the step follows ``coef * sum(term * mask) / T``.

Registry ``POLICY_LOSSES``: name -> fn(log_probs[b,A], mb: dict, spec: LossSpec) -> (sum, count, stats).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

from openrlhf_lpo.core.loss import clip_bounds  # noqa: F401  (one epsilon or a pair -> (low, high))
from openrlhf_lpo.core.policy_loss import (POLICY_LOSS_TYPES, PolicyLossContext, policy_loss_outputs, token_correction,
                                           type_options)
from openrlhf_lpo.registry import lookup, registrar

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
    correction: Optional[object] = None  # listwise: offpolicy.BehaviourCorrection (None: s_t from the batch only)
    score: str = "mean_clip"  # listwise: --lpo.score (listwise.sequence_score)
    dual_clip: Optional[float] = None  # pg: --actor.dual_clip
    policy_loss_type: str = "ppo"  # pg: --actor.policy_loss_type (ppo / gspo / cispo / clip_cov / kl_cov)
    type_options: Tuple = ()  # pg: a registered type's ((option, value), ...) (core/policy_loss.type_options)
    seed: int = 42  # pg: --train.seed (a registered type's seeded draw, with the optimizer step)
    is_correction: Tuple = ("off", "clip", "ratio", (0.5, 5.0))  # pg: level, mode, gating, threshold
    kl_coef: float = 0.0  # --algo.kl.use_loss: the KL controller's value (kl_ctl) times the token-mean KL
    kl_estimator: str = "k1"
    kl_unbiased_gradient: bool = False
    entropy_coef: float = 0.0  # --actor.entropy_coef: minus coef times the token-mean entropy

    @property
    def correction_band(self) -> Optional[Tuple[float, float]]:
        """The train/rollout ratio band of the behaviour correction (None when it is off): the logged
        ``is_filter_ratio`` counts the tokens outside it."""
        if self.name == "pg":
            level, _, _, threshold = self.is_correction
            return None if level == "off" else (float(threshold[0]), float(threshold[1]))
        if self.correction is None or self.correction.mode == "none":
            return None
        return float(self.correction.low), float(self.correction.high)


def register_policy_loss(name: str):
    return registrar(POLICY_LOSSES, "policy loss", name)


def get_policy_loss(name: str):
    return lookup(POLICY_LOSSES, "policy loss", name)




def _count(mb, key: str, fallback) -> torch.Tensor:
    """The micro-batch's precomputed count (on the device, no host sync), else ``fallback()``."""
    c = mb.get(key)
    return c if c is not None else torch.tensor(int(fallback()), dtype=torch.int)


def _listwise_terms(log_probs, mb, spec: LossSpec, coefficients):
    from openrlhf_lpo.core.loss import listwise_micro_loss

    return listwise_micro_loss(log_probs, mb["old_log_probs"], mb["action_mask"], mb["target"], spec.group_size,
                               spec.divergence, spec.projection, spec.clip_eps, prev=mb.get("prev_log_ratio"),
                               coefficients=coefficients, rollout_log_probs=mb.get("rollout_log_probs"),
                               correction=spec.correction, score=spec.score)


@register_policy_loss("listwise")
def _listwise(log_probs, mb, spec: LossSpec) -> Tuple[torch.Tensor, torch.Tensor, dict]:
    """LPO on whole groups (K consecutive rows): K * sum_g D(w*_g, softmax(s_g)) (core/loss.py)."""
    terms = _listwise_terms(log_probs, mb, spec, None)
    total = (terms.total * spec.group_size).to(log_probs.dtype)
    return total, _count(mb, "n_responses", lambda: log_probs.shape[0]), {"s_rows": terms.s}


@register_policy_loss("listwise_surrogate")
def _listwise_surrogate(log_probs, mb, spec: LossSpec):
    """Two-pass LPO: K * sum_k stopgrad(c_k) s_k with the window's c from the update plan (core/update.py)."""
    terms = _listwise_terms(log_probs, mb, spec, mb["coefficients"])
    total = (terms.total * spec.group_size).to(log_probs.dtype)
    return total, _count(mb, "n_responses", lambda: log_probs.shape[0]), {"s_rows": terms.s}


class RegisteredPolicyLoss:
    """A ``--actor.policy_loss_type`` of ``core.policy_loss`` (CISPO: MiniMax-M1, arXiv 2506.13585, Eq. 4-5; Clip-Cov
    and KL-Cov: arXiv 2505.22617), which OpenRLHF 0.11.2's ``PolicyLoss`` lacks, in its call convention and 5-tuple:
    the type's per-token loss aggregated by upstream's ``aggregate_loss`` (a sum with ``batch_num_tokens = 1`` /
    ``global_batch_size = 1``, as ``_pg`` asks). ``options``, ``seed`` and ``step`` are what the type reads (its
    ``--actor.<option>`` flags, ``--train.seed``, the optimizer step). The DeepSpeed actor's twin is
    ``openrlhf_lpo.openrlhf.cispo.ExtendedPolicyLoss``."""

    def __init__(self, policy_loss_type: str, clip_eps_low: float, clip_eps_high: float, token_level_loss: bool,
                 dual_clip=None, is_correction: Tuple = ("off", "clip", "ratio", (0.5, 5.0)), options: Tuple = (),
                 seed: int = 42, step: int = 0):
        level, mode, gating, threshold = is_correction
        self.correction = token_correction(level, mode, gating, threshold, policy_loss_type, dual_clip)
        self.policy_loss_type = policy_loss_type
        self.clip_eps_low, self.clip_eps_high, self.token_level_loss = clip_eps_low, clip_eps_high, token_level_loss
        self.options = dict(type_options(policy_loss_type, dict(options)))
        self.seed, self.step = int(seed), int(step)

    def context(self) -> PolicyLossContext:
        return PolicyLossContext(self.options, self.seed, self.step)

    def __call__(self, log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None, dp_size=1,
                 batch_num_tokens=None, global_batch_size=None):
        from openrlhf.models.loss import aggregate_loss
        from openrlhf.models.utils import masked_mean

        return policy_loss_outputs(self, log_probs, old_log_probs, advantages, action_mask, rollout_log_probs,
                                   (dp_size, batch_num_tokens, global_batch_size), aggregate_loss, masked_mean)


def policy_loss_module(spec: LossSpec, step: int = 0):
    """OpenRLHF's ``PolicyLoss`` configured as ``ActorPPOTrainer`` configures it from the flags, or
    :class:`RegisteredPolicyLoss` for a type of ``core.policy_loss`` (``cispo``, ``clip_cov``, ``kl_cov``; ``step``:
    the optimizer steps taken before this one, which a seeded draw reads)."""
    from openrlhf.models import PolicyLoss

    lo, hi = clip_bounds(spec.clip_eps)
    level, mode, gating, threshold = spec.is_correction
    if spec.policy_loss_type in POLICY_LOSS_TYPES:
        return RegisteredPolicyLoss(spec.policy_loss_type, lo, hi, token_level_loss=spec.loss_agg_mode == "token-mean",
                                    dual_clip=spec.dual_clip, is_correction=spec.is_correction,
                                    options=spec.type_options, seed=spec.seed, step=step)
    return PolicyLoss(clip_eps_low=lo, clip_eps_high=hi, dual_clip=spec.dual_clip,
                      token_level_loss=spec.loss_agg_mode == "token-mean", policy_loss_type=spec.policy_loss_type,
                      is_correction_level=level, is_correction_mode=mode, is_correction_gating=gating,
                      is_correction_threshold=threshold)


@register_policy_loss("pg")
def _pg(log_probs, mb, spec: LossSpec):
    """OpenRLHF's ``PolicyLoss`` (PPO clip, clip-higher, dual clip, GSPO, IS correction) or CISPO as a sum:
    masked token sum (``token-mean``) or sum of per-response token means (``seq-mean-token-mean``);
    advantages per response [b] or per token [b, A]."""
    if spec.loss_agg_mode not in ("token-mean", "seq-mean-token-mean"):
        raise ValueError(f"--actor.loss_agg_mode {spec.loss_agg_mode!r}: use token-mean or seq-mean-token-mean")
    mask = mb["action_mask"]
    adv = mb["advantages"].to(log_probs.dtype)
    if adv.dim() == 1:  # one advantage per response, else OpenRLHF's per-token [b, A]
        adv = adv.unsqueeze(-1) * mask.to(log_probs.dtype)
    fn = mb.get("_policy_loss_fn") or policy_loss_module(spec)
    old = mb["old_log_probs"].to(log_probs.dtype)
    rollout = mb.get("rollout_log_probs")
    total, *_ = fn(
        log_probs, old, adv, action_mask=mask, rollout_log_probs=None if rollout is None else rollout.to(log_probs.dtype),
        dp_size=1, batch_num_tokens=1.0, global_batch_size=1.0)
    stats = {"loss_sum": total.detach()}
    if spec.loss_agg_mode == "token-mean" and spec.policy_loss_type != "gspo":
        return total, _count(mb, "n_tokens", lambda: mask.sum()), stats
    return total, _count(mb, "n_nonempty", lambda: (mask.sum(-1) > 0).sum()), stats


def count_key(spec: LossSpec) -> str:
    """Which precomputed count divides the loss of ``spec`` (the micro-batch keys the actor fills)."""
    if spec.name == "pg":
        return "n_tokens" if spec.loss_agg_mode == "token-mean" and spec.policy_loss_type != "gspo" else "n_nonempty"
    return "n_responses"
