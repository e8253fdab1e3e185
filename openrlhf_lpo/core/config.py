"""Settings shared by the CLI (``openrlhf_lpo.cli``) and the OpenRLHF extension: the estimators we
add, the temperature that pairs each group policy-gradient estimator with LPO, and when a run
logs the listwise metrics. The CLI imports this module; nothing here imports the CLI.

Public names (stable):
    LPO_ESTIMATORS, EXTRA_ESTIMATORS, PAIRED_TEMPERATURE, PAIRED_METHODS, dp_size(args),
    listwise_metrics_enabled(args), uses_lpo_classes(args)
    LPOConfig                     the frozen ``--lpo.*`` settings: each field holds its flag's default and help
                                  (``cli/flags.py`` builds the flags from them); ``LPOConfig.from_args(args)``
                                  is what both backends read
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional, Union

from openrlhf_lpo.core.training_backends import backend_of

__all__ = ["LPO_ESTIMATORS", "EXTRA_ESTIMATORS", "PAIRED_TEMPERATURE", "PAIRED_METHODS", "dp_size", "listwise_metrics_enabled",
           "uses_lpo_classes", "LPOConfig"]

LPO_ESTIMATORS = ("lpo",)
EXTRA_ESTIMATORS = ("lpo", "maxrl")
# Group-baseline policy-gradient estimators and the temperature of their LPO pairing: with
# --lpo.end_kl they log the same KL(w*||P) as LPO (metrics only), so the two can be compared.
PAIRED_TEMPERATURE = {"group_norm": "std", "dr_grpo": "one", "maxrl": "mean", "rloo": "loo",
                      "reinforce_baseline": "batch_std"}
# Each baseline method file of configs/methods and its LPO pairs (same temperature, same method-specific settings):
# the pairs lpo-compare runs and the matched-pair test checks (docs/methods.md "Matched pairs").
PAIRED_METHODS = {
    "grpo": {"fwd": "lpo_fwd", "rev": "lpo_rev"},
    "dr_grpo": {"fwd": "lpo_fwd_drgrpo", "rev": "lpo_rev_drgrpo"},
    "maxrl": {"fwd": "lpo_fwd_maxrl", "rev": "lpo_rev_maxrl"},
    "rloo": {"fwd": "lpo_fwd_rloo", "rev": "lpo_rev_rloo"},
    "reinforce_pp": {"fwd": "lpo_fwd_reinforce_pp", "rev": "lpo_rev_reinforce_pp"},
    "dapo": {"fwd": "lpo_fwd_dapo", "rev": "lpo_rev_dapo"},
    "gspo": {"fwd": "lpo_fwd", "rev": "lpo_rev"},
    "cispo": {"fwd": "lpo_fwd", "rev": "lpo_rev"},
    "kl_cov": {"fwd": "lpo_fwd", "rev": "lpo_rev"},
    "clip_cov": {"fwd": "lpo_fwd", "rev": "lpo_rev"},
}


def dp_size(args) -> int:
    """Effective data-parallel size of the actor (what OpenRLHF chunks experiences by): the actor
    GPUs divided by what one model replica spans (the backend's ``model_parallel``: ``--megatron.tp x
    --megatron.pp`` with ``--backend megatron``, DeepSpeed's ring-attention and tensor-parallel sizes otherwise)."""
    tp, pp = backend_of(args).model_parallel(args)
    return args.actor.num_nodes * args.actor.num_gpus_per_node // max(tp * pp, 1)


def listwise_metrics_enabled(args) -> bool:
    """True when a non-LPO estimator logs the listwise KL (the LPO classes must be installed)."""
    est = args.algo.advantage.estimator
    return est not in LPO_ESTIMATORS and est in PAIRED_TEMPERATURE and bool(getattr(args.lpo, "end_kl", False))


def uses_lpo_classes(args) -> bool:
    """True when the run needs our trainer / experience maker / actor classes."""
    return args.algo.advantage.estimator in EXTRA_ESTIMATORS or listwise_metrics_enabled(args)


def _flag(default, help: str, type=None, choices=None):
    """A field of :class:`LPOConfig`: its flag's default, help, value type (None: a switch) and choices (a
    callable, read when the parser is built)."""
    return field(default=default, metadata={"help": help, "type": type, "choices": choices})


def _projections():
    from openrlhf_lpo import listwise

    return sorted(listwise.PROJECTIONS)


def _scores():
    from openrlhf_lpo import listwise

    return sorted(listwise.SEQUENCE_SCORES)


def _anchors():
    from openrlhf_lpo import listwise

    return list(listwise.ANCHORS)


@dataclass(frozen=True)
class LPOConfig:
    """The ``--lpo.*`` settings of a run, the one place of each flag's default and help. The CLI fills the
    defaults after validation (a flag left at None was not given), and both backends read
    ``LPOConfig.from_args(args)`` instead of the namespace."""

    divergence: str = _flag(
        "fwd", "divergence between the target w* and the listwise policy P: fwd = KL(w*||P) (Eq. 10), "
        "rev = KL(P||w*) (Eq. 11), js = Jensen-Shannon, hellinger = squared Hellinger, tv = total variation, "
        "alpha:<a> = Amari alpha-divergence for any real a (alpha:1 = fwd, alpha:0 = rev), or a registered name "
        "(docs/divergences.md). Default fwd.", type=str)
    divergence_schedule: Optional[str] = _flag(
        None, "divergence by global step: comma-separated name@step stages, e.g. fwd@0,rev@50 (update t, the one "
        "after t completed updates, uses the last stage with step <= t; logged at step t+1). With "
        "--lpo.divergence_switch_entropy one later stage may omit @step (reached only by the switch).", type=str)
    divergence_switch_entropy: Optional[float] = _flag(
        None, "move to the schedule's next divergence once the running mean of the logged response entropy "
        "(nats/token, last --lpo.divergence_switch_window steps) falls below this value; once. The step is "
        "logged (lpo/divergence_switched_at) and kept in checkpoints.", type=float)
    divergence_switch_window: int = _flag(
        5, "steps in the running mean of --lpo.divergence_switch_entropy (default 5)", type=int)
    temperature: Union[str, float] = _flag(
        "std", "temperature tau of w* = softmax(R/tau + s_t): std (pairs with GRPO/group_norm), one "
        "(Dr.GRPO), mean (MaxRL), loo (RLOO), batch_std (REINFORCE++-baseline) or a positive number. Default std.",
        type=str)
    temperature_scale: float = _flag(
        1.0, "multiply tau by this positive factor, whatever --lpo.temperature is (tune tau apart from the "
        "paired baseline's; < 1 sharpens w*). The plan and lpo/tau_* show the effective tau. Default 1.", type=float)
    projection: str = _flag(
        "listwise", "listwise (the LPO loss) or pointwise (-sum_k w*_k s_k; the paper's ablation). Default listwise.",
        type=str, choices=_projections)
    score: str = _flag(
        "mean_clip", "the response score s_k: mean_clip (Eq. 4: the per-token mean of the log-ratios clipped by "
        "--actor.eps_clip_low_high), sum (Target Policy Optimization, arXiv 2604.06159: the sequence log-ratio "
        "l_theta - l_old, summed, unclipped) or mean (the per-token mean, unclipped). Default mean_clip.",
        type=str, choices=_scores)
    anchor: str = _flag(
        "none", "none (P = softmax(s): the list measured against the sampled responses) or old (Target Policy "
        "Optimization: the old policy's own log-probability of each response, aggregated as --lpo.score aggregates, "
        "is added to s and to w*'s logits: P = softmax(l_theta) over the group, w* = softmax(l_old + R/tau)). "
        "Default none.", type=str, choices=_anchors)
    force_two_pass: bool = _flag(
        False, "always use the two-pass path (no-grad s, then detached surrogate), even when every "
        "micro-batch holds whole groups (for benchmarks and checks).")
    end_kl: bool = _flag(
        False, "log KL(w*||P) at the end of the update exactly (one extra no-grad forward of the rollout "
        "batch per step); without it lpo/kl_last uses P from each group's last training visit. Also "
        "works with group_norm, dr_grpo, maxrl, rloo and reinforce_baseline (metrics only; w* uses "
        "--lpo.temperature, default the estimator's pairing: std, one, mean, loo, batch_std).")
    replay_batches: int = _flag(
        0, "listwise replay: keep the last N rollout batches' groups (responses, rewards, behaviour log-probs) "
        "and train each step on the fresh groups plus --lpo.replay_ratio replayed groups per fresh group, "
        "through the listwise off-policy target (s_t against each group's own behaviour log-probs). Saved with "
        "checkpoints. Default 0 (off).", type=int)
    replay_ratio: float = _flag(
        1.0, "replayed groups per fresh group (needs --lpo.replay_batches; default 1)", type=float)
    replay_max_abs_s: Optional[float] = _flag(
        None, "staleness filter: drop (and count) a replayed group with any |s_t| above this (needs "
        "--lpo.replay_batches; default: no filter)", type=float)

    @classmethod
    def from_args(cls, args) -> "LPOConfig":
        """The run's settings from the parsed flags (``args.lpo``); a field the namespace lacks or leaves at None
        takes its default."""
        ns = getattr(args, "lpo", None)
        values = {}
        for f in fields(cls):
            value = getattr(ns, f.name, None)
            values[f.name] = f.default if value is None else value
        return cls(**values)

    @classmethod
    def fill_defaults(cls, namespace, names=None) -> None:
        """Set each flag of ``names`` (default: all) that was not given (None) to its default, in place."""
        for f in fields(cls):
            if (names is None or f.name in names) and getattr(namespace, f.name, None) is None:
                setattr(namespace, f.name, f.default)
