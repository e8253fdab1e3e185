"""Flag groups: the extension hook of ``lpo-train`` (``openrlhf_lpo.cli.train_ppo_ray``).

Public names (stable):
    FlagGroup, FlagError, FLAG_GROUPS, register_flag_group(group), flag_groups(args=None),
    EXTRA_ESTIMATORS, LPO_ESTIMATORS, PAIRED_TEMPERATURE, dp_size(args), flag_was_given(args, dest)

A flag group bundles what one feature adds to the stock OpenRLHF 0.11.2 CLI:

* ``add_arguments(parser)``   adds dotted flags (``--lpo.divergence``) to the stock parser;
* ``validate(args)``          runs after the stock validation on the hierarchised namespace
                              (``args.lpo.divergence``); raise ``FlagError`` naming the flags;
* ``before_train(args)``      optional; returns a context manager (or None) entered around the
                              stock ``train(args)``: class swaps, CPU shims, another backend.
* ``estimators``              extra ``--algo.advantage.estimator`` choices it owns;
* ``backend``                 the training backend it belongs to (``--backend``): its ``validate``,
                              ``before_train`` and ``plan_lines`` run only for runs of that backend.

Groups run in registration order. ``--backend`` itself is this module's ``backend`` group, its choices the
training-backend table (:mod:`openrlhf_lpo.core.training_backends`). Other engineers add theirs (CPU mode,
``--backend megatron --megatron.tp/pp``) with ``register_flag_group(FlagGroup(...))`` in their
own module and import it from ``openrlhf_lpo.cli.train_ppo_ray`` (see ``PLUGIN_MODULES``) —
nothing else in the CLI needs to change.
"""

from __future__ import annotations

import argparse
import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Dict, List, Optional, Tuple

from openrlhf_lpo.core.training_backends import DEFAULT_BACKEND, backend_names, backend_of
from openrlhf_lpo.registry import register_unique

__all__ = [
    "FlagGroup",
    "FlagError",
    "FLAG_GROUPS",
    "register_flag_group",
    "flag_groups",
    "EXTRA_ESTIMATORS",
    "LPO_ESTIMATORS",
    "PAIRED_TEMPERATURE",
    "dp_size",
    "flag_was_given",
]


class FlagError(ValueError):
    """A bad flag combination; the message names the flags and what to do."""


@dataclass(frozen=True)
class FlagGroup:
    name: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    validate: Optional[Callable[[argparse.Namespace], None]] = None
    before_train: Optional[Callable[[argparse.Namespace], Optional[ContextManager]]] = None
    estimators: Tuple[str, ...] = field(default_factory=tuple)
    plan_lines: Optional[Callable[[argparse.Namespace], List[str]]] = None  # what --dry-run adds for the group
    backend: Optional[str] = None  # a training backend's group: validate / before_train / plan_lines for its runs only


FLAG_GROUPS: Dict[str, FlagGroup] = {}


def register_flag_group(group: FlagGroup) -> FlagGroup:
    """Register ``group`` (name must be new). Returns it, so it can be used at module level."""
    return register_unique(FLAG_GROUPS, "flag group", group.name, group)


def flag_groups(args: Optional[argparse.Namespace] = None) -> List[FlagGroup]:
    """Every registered group (registration order); with ``args``, the groups of that run: those of every run and
    those bound to its ``--backend``."""
    groups = list(FLAG_GROUPS.values())
    if args is None:
        return groups
    name = backend_of(args).name
    return [g for g in groups if g.backend is None or g.backend == name]


# ----------------------------------------------------------------------------- helpers

_UNSET = "__lpo_unset__"


def flag_was_given(args: argparse.Namespace, dotted: str) -> bool:
    """True when the user passed flag ``--<dotted>`` (its default is the unset sentinel)."""
    node = args
    for part in dotted.split("."):
        node = getattr(node, part, _UNSET)
    return node is not _UNSET and node is not None


def dp_size(args: argparse.Namespace) -> int:
    """Effective data-parallel size of the actor (what OpenRLHF chunks experiences by)."""
    from openrlhf_lpo.core.config import dp_size as _dp_size

    return _dp_size(args)


# ----------------------------------------------------------------------------- LPO / MaxRL

from openrlhf_lpo.core.config import (  # noqa: E402  (shared with the OpenRLHF extension)
    EXTRA_ESTIMATORS, LPO_ESTIMATORS, PAIRED_TEMPERATURE, LPOConfig)

def _add_lpo_arguments(parser: argparse.ArgumentParser) -> None:
    """``--lpo.<field>`` for every field of :class:`LPOConfig` (its help; default None, so validation can tell a
    flag that was not given, then fills the field's default)."""
    from dataclasses import fields

    g = parser.add_argument_group("Listwise Policy Optimization (LPO, arXiv 2605.06139)")
    for f in fields(LPOConfig):
        md = f.metadata
        if md["type"] is None:  # a switch
            g.add_argument(f"--lpo.{f.name}", action="store_true", default=False, help=md["help"])
            continue
        choices = md["choices"]() if md["choices"] else None
        g.add_argument(f"--lpo.{f.name}", type=md["type"], default=None, choices=choices, help=md["help"])


def _validate_extra_estimators(args: argparse.Namespace) -> None:
    from openrlhf_lpo import listwise

    est = args.algo.advantage.estimator
    K = args.rollout.n_samples_per_prompt
    # response entropy is one of the logged quantities of every method (core/metrics.py): with coefficient 0 it
    # is computed without an autograd graph (LPOActorTrainer.training_step)
    if args.actor.entropy_coef is None:
        args.actor.entropy_coef = 0.0
    if est not in LPO_ESTIMATORS:
        given = [f"--{f}" for f in ("lpo.divergence", "lpo.projection", "lpo.score", "lpo.anchor") + RESEARCH_FLAGS
                 if flag_was_given(args, f)]
        given += ["--lpo.force_two_pass"] if args.lpo.force_two_pass else []
        if given:
            raise FlagError(
                f"{', '.join(given)} only apply with --algo.advantage.estimator lpo (got {est}); "
                "drop them or switch the estimator to lpo"
            )
        _validate_listwise_metrics(args, est, K)
    if est not in EXTRA_ESTIMATORS:
        return
    if K < 2:
        raise FlagError(
            f"--algo.advantage.estimator {est} needs --rollout.n_samples_per_prompt >= 2 (got {K}): "
            "the baseline / listwise simplex is built from a prompt's K responses"
        )
    if est == "maxrl":
        return

    # ---- lpo: fill defaults, check values
    divergence_given = flag_was_given(args, "lpo.divergence")
    LPOConfig.fill_defaults(args.lpo, ("divergence", "temperature", "projection", "score", "anchor"))
    try:
        args.lpo.temperature = listwise.parse_temperature(args.lpo.temperature)
    except ValueError as e:
        raise FlagError(f"--lpo.temperature: {e}") from None
    try:
        listwise.parse_divergence(args.lpo.divergence)
    except ValueError as e:
        raise FlagError(f"--lpo.divergence: {e}") from None
    divergence_given = _validate_research_flags(args, divergence_given)
    if args.lpo.projection == "pointwise" and divergence_given:
        raise FlagError(
            "--lpo.divergence has no effect with --lpo.projection pointwise (the pointwise loss is "
            "-sum_k w*_k s_k); drop one of them"
        )

    # ---- options the listwise loss does not implement (everything else composes: docs/lpo_flags.md)
    adv = args.algo.advantage
    refusals = [
        (args.ds.ring_attn_size > 1, "--ds.ring_attn_size > 1",
         "ring attention splits one sequence over ranks; the LPO trainer's no-grad passes and group "
         "windows do not implement it"),
        (args.ds.tensor_parallel_size > 1, "--ds.tensor_parallel_size > 1",
         "DeepSpeed tensor parallelism is not supported with LPO; use --backend megatron --megatron.tp N"),
        (args.actor.policy_loss_type != "ppo", f"--actor.policy_loss_type {args.actor.policy_loss_type}",
         "LPO replaces the policy loss (GSPO's sequence ratio included); leave --actor.policy_loss_type at ppo"),
        (args.actor.dual_clip is not None, "--actor.dual_clip", "dual-clip is a PPO option LPO does not use"),
        (adv.is_correction_level == "seq", "--algo.advantage.is_correction_level seq",
         "a rejected response would have to leave its group's list (changing K); use the token level, whose "
         "clip/mask modes LPO maps onto its listwise correction s_t"),
        (adv.is_correction_level != "off" and adv.is_correction_gating != "ratio",
         f"--algo.advantage.is_correction_gating {adv.is_correction_gating}",
         "LPO's listwise correction reads the ratio pi_t/mu itself; use --algo.advantage.is_correction_gating ratio"),
    ]
    for bad, flag, why in refusals:
        if bad:
            raise FlagError(f"{flag} is not supported with --algo.advantage.estimator lpo: {why}")
    _validate_score_and_anchor(args)
    if adv.is_correction_level != "off":
        low, high = adv.is_correction_threshold
        if not (0.0 < low < 1.0 < high):
            raise FlagError(
                f"--algo.advantage.is_correction_threshold {low} {high}: LPO's listwise correction bounds "
                "the ratio pi_t/mu to [low, high] around 1, so it needs 0 < low < 1 < high (e.g. 0.5 5.0)"
            )
    elif args.train.async_enable:
        print("[openrlhf_lpo] --train.async_enable without --algo.advantage.is_correction_level: LPO treats each "
              "list as drawn from the start-of-update policy (s_t = 0). Add --algo.advantage.is_correction_level "
              "token --algo.advantage.is_correction_mode clip for the listwise off-policy target (docs/lpo_flags.md).")
    lo, hi = args.actor.eps_clip_low_high
    if listwise.SEQUENCE_SCORES[args.lpo.score].clip and (not (0.0 < lo < 1.0) or hi <= 0.0):
        raise FlagError(
            f"--actor.eps_clip_low_high/--actor.eps_clip = ({lo}, {hi}): LPO clips token log-ratios to "
            "[log(1-low), log(1+high)], so it needs 0 < low < 1 and high > 0"
        )

    # ---- whole groups on one rank and in every optimizer window
    dp = dp_size(args)
    rb, tb, mb = args.rollout.batch_size, args.train.batch_size, args.train.micro_batch_size
    if rb % dp:
        raise FlagError(
            f"--rollout.batch_size {rb} must be divisible by the actor data-parallel size {dp} "
            "(--actor.num_nodes x --actor.num_gpus_per_node, divided by --megatron.tp x --megatron.pp with "
            "--backend megatron) so every rank gets whole prompt groups"
        )
    if tb % (dp * K):
        raise FlagError(
            f"--train.batch_size {tb} must be a multiple of dp x --rollout.n_samples_per_prompt = "
            f"{dp} x {K} = {dp * K} so every optimizer step on every rank holds whole groups"
        )
    if not args.train.dynamic_batch_enable and tb % (dp * mb):
        raise FlagError(
            f"--train.batch_size {tb} must be a multiple of dp x --train.micro_batch_size = {dp} x {mb} "
            "(whole micro-batches per optimizer step)"
        )
    if (rb * K) % tb:
        raise FlagError(
            f"--rollout.batch_size x --rollout.n_samples_per_prompt = {rb * K} must be a multiple of "
            f"--train.batch_size {tb} (whole optimizer steps per rollout batch)"
        )


def _validate_score_and_anchor(args: argparse.Namespace) -> None:
    """``--lpo.score`` other than Eq. 4's and ``--lpo.anchor old`` (Target Policy Optimization's configuration):
    the listwise off-policy correction and listwise replay measure s_t = delta as a per-token mean against the
    behaviour policy, with no anchor, so they run with the default score and no anchor only."""
    lpo, adv = args.lpo, args.algo.advantage
    custom = [f"--lpo.score {lpo.score}"] if lpo.score != "mean_clip" else []
    custom += [f"--lpo.anchor {lpo.anchor}"] if lpo.anchor != "none" else []
    if not custom:
        return
    what = " and ".join(custom)
    if adv.is_correction_level != "off":
        raise FlagError(f"{what} with --algo.advantage.is_correction_level {adv.is_correction_level}: the listwise "
                        "off-policy correction s_t = delta is the per-token mean of log pi_t - log mu (Eq. 4's score, "
                        "no anchor); drop the correction, or use --lpo.score mean_clip --lpo.anchor none")
    if lpo.replay_batches:
        raise FlagError(f"{what} with --lpo.replay_batches {lpo.replay_batches}: a replayed group's start point "
                        "s_t = delta is the per-token mean against its behaviour policy (Eq. 4's score, no anchor); "
                        "drop --lpo.replay_batches, or use --lpo.score mean_clip --lpo.anchor none")


# the research-agenda flags (issue 25): a schedule, the entropy switch, tau scaling, listwise replay
RESEARCH_FLAGS = ("lpo.divergence_schedule", "lpo.divergence_switch_entropy", "lpo.divergence_switch_window",
                  "lpo.temperature_scale", "lpo.replay_batches", "lpo.replay_ratio", "lpo.replay_max_abs_s")


def _positive(args, dotted: str) -> Optional[float]:
    value = getattr(args.lpo, dotted.split(".", 1)[1])
    if value is not None and not (math.isfinite(value) and value > 0):
        raise FlagError(f"--{dotted} {value}: must be a positive finite number")
    return value


def _validate_research_flags(args: argparse.Namespace, divergence_given: bool) -> bool:
    """Divergence schedule / entropy switch, temperature scale, replay (lpo only). Returns whether a
    divergence was chosen by flag (--lpo.divergence or the schedule)."""
    from openrlhf_lpo.core.divergence_schedule import DivergenceSchedule, parse_schedule

    lpo = args.lpo
    # ---- divergence schedule and the entropy switch
    if lpo.divergence_schedule is not None:
        if divergence_given:
            raise FlagError("--lpo.divergence and --lpo.divergence_schedule both choose the divergence; give one "
                            "(the schedule's first stage is the divergence at step 0)")
        try:
            stages = parse_schedule(lpo.divergence_schedule)
        except ValueError as e:
            raise FlagError(f"--lpo.divergence_schedule: {e}") from None
        lpo.divergence = stages[0].divergence
        divergence_given = True
    if lpo.divergence_switch_entropy is not None:
        h = lpo.divergence_switch_entropy
        if not (math.isfinite(h) and h > 0):
            raise FlagError(f"--lpo.divergence_switch_entropy {h}: the threshold is a response entropy in nats per "
                            "token, so it must be a positive finite number (a threshold <= 0 never fires)")
        if lpo.divergence_schedule is None:
            raise FlagError("--lpo.divergence_switch_entropy moves to the schedule's next divergence: give "
                            "--lpo.divergence_schedule with two or more stages, e.g. fwd@0,rev (rev by entropy only)")
    elif lpo.divergence_switch_window is not None:
        raise FlagError("--lpo.divergence_switch_window only applies with --lpo.divergence_switch_entropy")
    LPOConfig.fill_defaults(lpo, ("divergence_switch_window",))
    if lpo.divergence_schedule is not None:
        try:
            DivergenceSchedule(parse_schedule(lpo.divergence_schedule), lpo.divergence_switch_entropy,
                               lpo.divergence_switch_window)
        except ValueError as e:
            flag = ("--lpo.divergence_switch_window" if "window" in str(e) else "--lpo.divergence_schedule")
            raise FlagError(f"{flag}: {e}") from None
    # ---- temperature scale
    _positive(args, "lpo.temperature_scale")
    LPOConfig.fill_defaults(lpo, ("temperature_scale",))
    # ---- listwise replay
    if lpo.replay_batches is not None and lpo.replay_batches < 0:
        raise FlagError(f"--lpo.replay_batches {lpo.replay_batches}: must be >= 0 (0 = no replay)")
    replay = bool(lpo.replay_batches)
    for flag in ("lpo.replay_ratio", "lpo.replay_max_abs_s"):
        if flag_was_given(args, flag) and not replay:
            raise FlagError(f"--{flag} needs a replay buffer: add --lpo.replay_batches N (N >= 1 rollout batches)")
        _positive(args, flag)
    LPOConfig.fill_defaults(lpo, ("replay_batches",) + (("replay_ratio",) if replay else ()))
    lpo.replay_batches = int(lpo.replay_batches)
    return divergence_given


def research_plan_lines(args: argparse.Namespace) -> List[str]:
    """The dry-run plan's lines for the flags above (lpo only): effective tau, schedule, replay."""
    lpo = args.lpo
    lines = []
    scale = float(getattr(lpo, "temperature_scale", 1.0) or 1.0)
    base = {"std": "group std", "pop_std": "group population std", "one": "1", "mean": "group mean"}.get(
        lpo.temperature, lpo.temperature)
    if isinstance(lpo.temperature, float):
        lines.append(f"  effective tau = {scale:g} x {lpo.temperature:g} = {scale * lpo.temperature:g}"
                     + (" (--lpo.temperature_scale)" if scale != 1.0 else ""))
    else:
        lines.append(f"  effective tau = {'' if scale == 1.0 else f'{scale:g} x '}{base} per group"
                     + (" (--lpo.temperature_scale)" if scale != 1.0 else ""))
    if getattr(lpo, "divergence_schedule", None):
        from openrlhf_lpo.core.divergence_schedule import parse_schedule

        stages = parse_schedule(lpo.divergence_schedule)
        text = ", ".join(f"{s.divergence} from update {s.start}" if s.start is not None else
                         f"{s.divergence} by the entropy switch" for s in stages)
        lines.append(f"  divergence schedule: {text}")
        if lpo.divergence_switch_entropy is not None:
            lines.append(f"  entropy switch: once the mean response entropy of the last {lpo.divergence_switch_window} "
                         f"step(s) < {lpo.divergence_switch_entropy:g}, move to the next stage")
    if getattr(lpo, "replay_batches", 0):
        K = args.rollout.n_samples_per_prompt
        extra = int(math.floor(lpo.replay_ratio * args.rollout.batch_size))
        lines.append(f"  listwise replay: buffer of the last {lpo.replay_batches} rollout batch(es); up to {extra} replayed "
                     f"group(s) ({extra * K} samples) per step beside {args.rollout.batch_size} fresh"
                     + (f"; groups with |s_t| > {lpo.replay_max_abs_s:g} dropped" if lpo.replay_max_abs_s else ""))
    return lines


def _validate_listwise_metrics(args: argparse.Namespace, est: str, K: int) -> None:
    """--lpo.end_kl / --lpo.temperature with a policy-gradient estimator: the metrics-only target."""
    from openrlhf_lpo import listwise

    temperature_given = flag_was_given(args, "lpo.temperature")
    if not args.lpo.end_kl:
        if temperature_given:
            raise FlagError(
                f"--lpo.temperature with --algo.advantage.estimator {est} only sets the target of the "
                "logged KL(w*||P); add --lpo.end_kl or drop --lpo.temperature"
            )
        return
    if est not in PAIRED_TEMPERATURE:
        raise FlagError(
            f"--lpo.end_kl needs prompt groups: it applies to --algo.advantage.estimator lpo or one of "
            f"{sorted(PAIRED_TEMPERATURE)} (got {est}); drop --lpo.end_kl"
        )
    if K < 2:
        raise FlagError(
            f"--lpo.end_kl needs --rollout.n_samples_per_prompt >= 2 (got {K}): KL(w*||P) lives on the "
            "simplex of a prompt's K responses"
        )
    if not temperature_given:
        args.lpo.temperature = PAIRED_TEMPERATURE[est]
        if est == "reinforce_baseline" and getattr(args.algo.advantage, "no_std_norm", False):
            args.lpo.temperature = "one"  # no whitening: the advantage is R - group mean, Dr.GRPO's
    try:
        args.lpo.temperature = listwise.parse_temperature(args.lpo.temperature)
    except ValueError as e:
        raise FlagError(f"--lpo.temperature: {e}") from None


def _lpo_before_train(args: argparse.Namespace):
    # every run uses the LPO classes: one update loop and one metric set for every estimator (core/update.py),
    # the seeded prompt order, the project's in-training eval and the runtime safety nets (openrlhf/ray_classes.py)
    from openrlhf_lpo.openrlhf.patches import apply_patches

    return apply_patches()


register_flag_group(
    FlagGroup(
        name="lpo",
        add_arguments=_add_lpo_arguments,
        validate=_validate_extra_estimators,
        before_train=_lpo_before_train,
        estimators=EXTRA_ESTIMATORS,
    )
)


def _add_backend_argument(parser: argparse.ArgumentParser) -> None:
    if any(a.dest == "backend" for a in parser._actions):
        return
    names = backend_names()
    parser.add_argument_group("Training backend").add_argument(
        "--backend", type=str, choices=names, default=DEFAULT_BACKEND,
        help=f"policy training backend: {', '.join(names)} (default {DEFAULT_BACKEND}; megatron: docs/megatron.md)")


register_flag_group(FlagGroup(name="backend", add_arguments=_add_backend_argument))


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("lpo-train run control")
    g.add_argument("--dry-run", dest="dry_run", action="store_true", default=False,
                   help="validate every flag, print the plan (GPUs per role, groups per rank, optimizer windows "
                   "per rollout batch, one- or two-pass, steps per episode, the last partial batch) and exit "
                   "without starting Ray or loading a model")


register_flag_group(FlagGroup(name="run", add_arguments=_add_run_arguments))


def _add_runtime_arguments(parser: argparse.ArgumentParser) -> None:
    from openrlhf_lpo.rewards.reward_errors import DEFAULT_STOP_FRAC, DEFAULT_WINDOW

    g = parser.add_argument_group("lpo-train runtime safety nets (every estimator)")
    g.add_argument("--reward.error_window", type=int, default=DEFAULT_WINDOW,
                   help="samples in the reward-error window: a reward that raised or reported status error "
                   "scores 0 and is counted (reward/error_frac); the run stops only when more than "
                   f"--reward.error_stop_frac of the last N samples failed (default {DEFAULT_WINDOW}; 0: never stop)")
    g.add_argument("--reward.error_stop_frac", type=float, default=DEFAULT_STOP_FRAC,
                   help=f"fraction of failed rewards in the window that stops the run (default {DEFAULT_STOP_FRAC}; "
                   "1: never stop)")
    g.add_argument("--ckpt.auto_resume", type=int, default=0, metavar="N",
                   help="restart a run that died (a lost Ray worker, node or driver) from its last complete "
                   "checkpoint, at most N times in a row from one checkpoint (a restart that reaches a newer "
                   "checkpoint resets the count); each restart is logged with its cause (docs/pipeline.md). "
                   "Needs --ckpt.save_steps > 0. Default 0: off")
    g.add_argument("--ckpt.auto_resume_delay", type=float, default=10.0, metavar="SECONDS",
                   help="--ckpt.auto_resume: seconds between a death and the restart (default 10)")
    g.add_argument("--ckpt.auto_resume_wait", type=float, default=1800.0, metavar="SECONDS",
                   help="--ckpt.auto_resume: how long a restart waits for the GPUs its layout needs to be there and "
                   "free (a lost node back, the dead attempt's GPU memory released) before it stops with exit 5; "
                   "waiting does not count as a failed attempt (default 1800: 30 minutes)")
    g.add_argument("--ckpt.hf_max_num", type=int, default=None,
                   help="HF exports (<ckpt.path>/<tag>_hf, --ckpt.save_hf) to keep; default: the ones whose "
                   "state --ckpt.max_num keeps; -1 keeps every export (e.g. to evaluate a learning curve)")


def _validate_runtime(args: argparse.Namespace) -> None:
    window, frac = args.reward.error_window, args.reward.error_stop_frac
    if window < 0:
        raise FlagError(f"--reward.error_window {window}: give a number of samples >= 0 (0 never stops the run)")
    if not 0.0 < frac <= 1.0:
        raise FlagError(f"--reward.error_stop_frac {frac}: give a fraction in (0, 1] (1 never stops the run)")
    _validate_auto_resume(args)
    if args.ckpt.hf_max_num is not None and args.ckpt.hf_max_num < -1:
        raise FlagError(f"--ckpt.hf_max_num {args.ckpt.hf_max_num}: give a count >= 0, or -1 to keep every export")


def _validate_auto_resume(args: argparse.Namespace) -> None:
    n, ckpt = args.ckpt.auto_resume, args.ckpt
    if n < 0:
        raise FlagError(f"--ckpt.auto_resume {n}: give a number of restarts >= 0 (0: off)")
    if ckpt.auto_resume_delay < 0:
        raise FlagError(f"--ckpt.auto_resume_delay {ckpt.auto_resume_delay}: give seconds >= 0")
    if not ckpt.auto_resume_wait >= 0:  # (NaN too)
        raise FlagError(f"--ckpt.auto_resume_wait {ckpt.auto_resume_wait}: give seconds >= 0 (0: a restart that "
                        "finds the cluster without the GPUs it needs stops at once)")
    if n == 0:
        return
    if ckpt.save_steps is None or ckpt.save_steps <= 0:
        raise FlagError(f"--ckpt.auto_resume {n} restarts from the last checkpoint, but --ckpt.save_steps "
                        f"{ckpt.save_steps} saves none: add --ckpt.save_steps S (e.g. 20)")
    if not backend_of(args).saves_before_pruning and ckpt.max_num < 2:
        raise FlagError(f"--ckpt.auto_resume {n} with --ckpt.max_num {ckpt.max_num}: the {backend_of(args).name} "
                        "backend deletes the oldest checkpoint before it writes the next, so a kill during that save "
                        "would leave nothing to resume: keep at least 2 (--ckpt.max_num 2)")


register_flag_group(FlagGroup(name="runtime", add_arguments=_add_runtime_arguments, validate=_validate_runtime))


def enter_before_train(stack: contextlib.ExitStack, args: argparse.Namespace) -> None:
    """Enter the run's groups' ``before_train`` contexts on ``stack`` (registration order)."""
    for group in flag_groups(args):
        if group.before_train is not None:
            cm = group.before_train(args)
            if cm is not None:
                stack.enter_context(cm)
