"""Flag group ``policy-loss-types``: ``--actor.policy_loss_type`` accepts the types registered in
``openrlhf_lpo.core.policy_loss.POLICY_LOSS_TYPES`` (``cispo``, ``clip_cov``, ``kl_cov``) beside OpenRLHF 0.11.2's
``ppo`` / ``gspo``, and each type's options are flags ``--actor.<option>`` (Clip-Cov: ``clip_cov_ratio``,
``clip_cov_lb``, ``clip_cov_ub``; KL-Cov: ``kl_cov_ratio``, ``kl_cov_coef``), refused with any other type.

Validation (after the stock one; exit 2 naming the flag): a registered type needs
``--actor.eps_clip_low_high`` low >= 0 and high > 0 (CISPO clips the importance weight to
[1 - low, 1 + high]; low >= 1 means no lower bound; KL-Cov has no clip and refuses clip flags other than the
default), refuses ``--actor.dual_clip`` (no clipped objective
to bound) and, of the train/rollout correction, the sequence level and the binary_kl / tv gates (the token
level with the ratio gate, modes clip / mask, weighs each token as for PPO).
With ``--algo.advantage.estimator lpo`` the ``lpo`` group already refuses any type but ppo.

The policy actor builds the loss inside ``openrlhf_lpo.openrlhf.cispo.policy_loss_types()`` (patch point
``policy-loss-types``); the Megatron actor's pg loss computes the same types (``megatron/losses.py``).
"""

from __future__ import annotations

import argparse

from openrlhf_lpo.cli.flags import FlagError, FlagGroup, register_flag_group

__all__ = ["extra_policy_loss_types"]

DEST = "actor.policy_loss_type"
DEFAULT_EPS_CLIP = 0.2  # OpenRLHF 0.11.2's --actor.eps_clip default


def extra_policy_loss_types():
    from openrlhf_lpo.core.policy_loss import POLICY_LOSS_TYPES

    return sorted(POLICY_LOSS_TYPES)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    from openrlhf_lpo.core.policy_loss import POLICY_LOSS_TYPES

    actions = [a for a in parser._actions if a.dest == DEST]
    if len(actions) != 1 or actions[0].choices is None:
        raise RuntimeError(f"openrlhf's parser has no --{DEST} with choices; this openrlhf_lpo release supports "
                           "openrlhf==0.11.2 only")
    action = actions[0]
    action.choices = list(action.choices) + [t for t in extra_policy_loss_types() if t not in action.choices]
    action.help = ("policy loss: ppo (clipped ratio), gspo (clipped sequence ratio), cispo (MiniMax-M1: REINFORCE "
                   "weighted by the detached importance ratio clipped to [1 - low, 1 + high] of "
                   "--actor.eps_clip_low_high), clip_cov (Clip-Cov, arXiv 2505.22617: PPO with a random few "
                   "high-covariance tokens detached), kl_cov (KL-Cov, arXiv 2505.22617: the unclipped ratio loss with "
                   "|log r| on the highest-covariance tokens)")
    g = parser.add_argument_group("policy-loss types (--actor.policy_loss_type cispo / clip_cov / kl_cov)")
    for kind in POLICY_LOSS_TYPES.values():  # each option of a registered type: --actor.<option>, default None
        for option in kind.options:
            g.add_argument(f"--actor.{option.name}", type=float, default=None,
                           help=f"{option.help}; only with --actor.policy_loss_type {kind.name}")


def _validate_options(args: argparse.Namespace, kind: str) -> None:
    """A registered type's ``--actor.<option>`` flags: given only with their type, valid values, defaults filled."""
    from openrlhf_lpo.core.policy_loss import POLICY_LOSS_TYPES

    for name, registered in POLICY_LOSS_TYPES.items():
        for option in registered.options:
            value = getattr(args.actor, option.name, None)
            if name != kind:
                if value is not None:
                    raise FlagError(f"--actor.{option.name} only applies with --actor.policy_loss_type {name} (got "
                                    f"{kind}): drop it or switch the policy loss to {name}")
                continue
            if value is None:
                setattr(args.actor, option.name, option.default)
            elif not option.check(value):
                raise FlagError(f"--actor.{option.name} {value}: --actor.policy_loss_type {name} needs {option.need}")
    if kind == "clip_cov" and not args.actor.clip_cov_lb < args.actor.clip_cov_ub:
        raise FlagError(f"--actor.clip_cov_lb {args.actor.clip_cov_lb} / --actor.clip_cov_ub {args.actor.clip_cov_ub}: "
                        "Clip-Cov draws tokens whose covariance lies between them, so it needs lb < ub")


def _validate(args: argparse.Namespace) -> None:
    from openrlhf_lpo.core.policy_loss import POLICY_LOSS_TYPES

    kind = args.actor.policy_loss_type
    _validate_options(args, kind)
    if kind not in extra_policy_loss_types():
        return
    lo, hi = args.actor.eps_clip_low_high
    eps = args.actor.eps_clip
    if not POLICY_LOSS_TYPES[kind].clips and ((lo, hi) != (eps, eps) or eps != DEFAULT_EPS_CLIP):
        raise FlagError(f"--actor.eps_clip_low_high/--actor.eps_clip = ({lo}, {hi}): --actor.policy_loss_type {kind} "
                        "has no ratio clip (its loss is -r A, plus a KL term on the selected tokens); drop the clip "
                        "flags")
    if not (lo >= 0.0) or not (hi > 0.0):
        raise FlagError(f"--actor.eps_clip_low_high/--actor.eps_clip = ({lo}, {hi}): --actor.policy_loss_type {kind} "
                        "clips the importance weight to [1 - low, 1 + high], so it needs low >= 0 (>= 1: no lower "
                        "bound) and high > 0")
    if args.actor.dual_clip is not None:
        raise FlagError(f"--actor.dual_clip is a PPO option; --actor.policy_loss_type {kind} has no clipped "
                        "objective to bound: drop --actor.dual_clip")
    adv = args.algo.advantage
    if adv.is_correction_level == "seq":
        raise FlagError(f"--algo.advantage.is_correction_level seq is not implemented for --actor.policy_loss_type "
                        f"{kind}: use the token level (or --actor.policy_loss_type ppo)")
    if adv.is_correction_level == "token" and adv.is_correction_gating != "ratio":
        raise FlagError(f"--algo.advantage.is_correction_gating {adv.is_correction_gating} is not implemented for "
                        f"--actor.policy_loss_type {kind}: use --algo.advantage.is_correction_gating ratio")


register_flag_group(FlagGroup(name="policy-loss-types", add_arguments=_add_arguments, validate=_validate))
