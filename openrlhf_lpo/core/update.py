"""One policy update, written once for both backends (the DeepSpeed trainer and the Megatron actor).

The listwise gradient sum_k c_k grad s_k (Eq. 10/11) is exact only when every c_k comes from all K
members of its group at the current parameters. An LPO update is cut into optimizer windows of whole
groups (shuffled as units) and, per window, c comes from one of four places (:class:`WindowMode`):

    one_pass    every micro-batch holds whole groups: the loss D(w*, softmax(s_g)) is differentiated
                directly, c is never materialised;
    shortcut    the first window of a rollout batch runs at the parameters that produced the old
                log-probs, so s = s_t exactly and c = dD/ds at s_t needs no forward;
    pre_pass    later windows whose micro-batches split groups: a no-grad forward gives s first;
    pointwise   the pointwise projection: c = -w* needs no forward.

A policy-gradient estimator (GRPO, Dr.GRPO, DAPO, ...) runs the same loop with windows of
``--train.batch_size / dp`` samples and its own loss; both kinds shuffle with :func:`window_generator`
from ``--train.seed``, so one seed gives the same windows on either backend.

:func:`plan_update` is the planner (windows, micro-batches under one budget rule, modes; also used
by the dry runs), :func:`run_update` the loop: it asks the backend's :class:`UpdateEngine` for
no-grad s (``forward_s``), one optimizer step per window (``step``) and its data-parallel reductions,
and builds the one metric set of every method (core/metrics.py) from what the steps return.

Public names (stable):
    WindowMode, window_generator(seed, update_index, epoch), groups_per_window(batch_size, dp, K),
    group_windows(gids, K, groups_per_window, generator), check_window_count(n, all_reduce_max),
    choose_mode(projection, whole_groups, first_window, force_two_pass),
    window_coefficients(mode, target, divergence, projection, K, s=None, gids=None),
    UpdateSettings, UpdateBatch, WindowPlan, Window, StepResult, UpdateEngine, UpdateRecord,
    plan_update(batch, settings, reduce, update_index), pass_micro_batches(indices, lengths, settings, reduce),
    run_update(batch, settings, engine, divergence=None) -> (status, UpdateRecord)
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from openrlhf_lpo import listwise
from openrlhf_lpo.core import layout

__all__ = ["WindowMode", "window_generator", "groups_per_window", "group_windows", "check_window_count",
           "choose_mode", "window_coefficients", "UpdateSettings", "UpdateBatch", "WindowPlan", "Window", "StepResult",
           "UpdateEngine", "UpdateRecord", "plan_update", "pass_micro_batches", "run_update"]

Reduce = Callable[[List[float]], List[float]]


class WindowMode(str, Enum):
    """Where one optimizer window's coefficients c come from (the ``lpo/<mode>_windows`` metrics)."""

    ONE_PASS = "one_pass"
    SHORTCUT = "shortcut"
    PRE_PASS = "pre_pass"
    POINTWISE = "pointwise"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


def window_generator(seed: int, update_index: int, epoch: int) -> torch.Generator:
    """The window shuffle's generator: a function of (seed, optimizer steps before this update, epoch)
    only, so a resumed run (whose step count the checkpoint restores) shuffles like the uninterrupted
    one on either backend."""
    return torch.Generator().manual_seed(int(seed) * 1000003 + int(update_index) * 1009 + int(epoch))


def groups_per_window(batch_size: int, dp: int, group_size: int) -> int:
    """Groups of one rank in one optimizer window: ``--train.batch_size`` responses over ``dp`` ranks."""
    if batch_size % (dp * group_size):
        raise ValueError(f"--train.batch_size {batch_size} does not give each of {dp} data-parallel rank(s) whole "
                         f"groups of --rollout.n_samples_per_prompt {group_size}: use a multiple of {dp * group_size}")
    return batch_size // (dp * group_size)


def group_windows(gids: Sequence[int], group_size: int, per_window: int,
                  generator: Optional[torch.Generator]) -> List[List[List[int]]]:
    """The rank's optimizer windows: member indices of each group (every group must have K members on
    this rank), groups shuffled as units, ``per_window`` groups each (the last window may hold fewer)."""
    return layout.window_groups(layout.group_members(gids, group_size), per_window, generator)


def check_window_count(n_windows: int, all_reduce_max: Reduce) -> None:
    """Every data-parallel rank must run the same number of optimizer steps (each is collective): a
    mismatch is an error now, not a hang until the collective timeout."""
    hi, neg_lo = all_reduce_max([float(n_windows), float(-n_windows)])
    if int(hi) != int(-neg_lo):
        raise RuntimeError(f"data-parallel ranks hold different numbers of optimizer windows ({int(-neg_lo)} vs "
                           f"{int(hi)}); the LPO experience maker deals groups in equal counts")


def choose_mode(projection: str, whole_groups: bool, first_window: bool, force_two_pass: bool) -> WindowMode:
    """Where the window's c comes from. ``first_window``: the first window of the update's first epoch
    (its parameters produced the old log-probs); ``whole_groups``: every micro-batch holds whole groups on
    every rank."""
    if projection == "pointwise":
        return WindowMode.POINTWISE
    if whole_groups and not force_two_pass:
        return WindowMode.ONE_PASS
    if first_window and not force_two_pass:
        return WindowMode.SHORTCUT
    return WindowMode.PRE_PASS


def window_coefficients(mode: WindowMode, target: torch.Tensor, divergence: str, projection: str, group_size: int,
                        s: Optional[torch.Tensor] = None, gids: Optional[Sequence[int]] = None
                        ) -> Optional[torch.Tensor]:
    """The window's detached c [B] (float64, in the order of ``target``), or None for one pass.

    ``s``: s_t for the shortcut, the pre-pass's s otherwise. ``gids``: each sample's group id when the
    members of a group are not K consecutive rows (None: they are)."""
    mode = WindowMode(mode)
    if mode is WindowMode.ONE_PASS:
        return None
    target = target.double()
    if mode is WindowMode.POINTWISE:
        return -target  # c = dL/ds of the pointwise projection's loss -sum_k w*_k s_k
    if s is None:
        raise ValueError(f"{mode.value} window: its coefficients need s (s_t for the shortcut, the pre-pass's s)")
    s = s.double()
    K = group_size
    if gids is None:
        return listwise.projection_coefficients(listwise.to_groups(s, K), listwise.to_groups(target, K), divergence,
                                                projection).reshape(-1)
    order = torch.tensor(sorted(range(len(gids)), key=lambda j: (int(gids[j]), j)), dtype=torch.long)
    c_sorted = listwise.projection_coefficients(s[order].view(-1, K), target[order].view(-1, K), divergence, projection)
    c = torch.empty(len(order), dtype=torch.float64)
    c[order] = c_sorted.reshape(-1).to(c.dtype)
    return c


# ----------------------------------------------------------------------------- the update, once

Reduction = Callable[[List[float], str], List[float]]  # values, "sum" | "max" | "min" -> over the DP ranks


@dataclass(frozen=True)
class UpdateSettings:
    """What one update needs from the flags, read once (``from_args``) with the parser's values."""

    group_size: int  # --rollout.n_samples_per_prompt
    batch_size: int  # --train.batch_size (responses per optimizer step, all ranks)
    dp: int  # data-parallel ranks (model replicas)
    epochs: int  # --train.max_epochs
    seed: int  # --train.seed: the window shuffle of every estimator on both backends
    micro_batch_size: int  # --train.micro_batch_size
    max_tokens: Optional[int]  # --train.max_tokens_per_gpu with --train.dynamic_batch_enable, else None
    listwise: bool  # --algo.advantage.estimator lpo
    clip_eps: Tuple[float, float]  # --actor.eps_clip_low_high
    projection: str = "listwise"
    divergence: str = "fwd"
    force_two_pass: bool = False
    end_kl: bool = False  # --lpo.end_kl: s at the end of the update (lpo/kl_end, ...)
    correction: bool = False  # --algo.advantage.is_correction_level is on (lpo/behaviour_*, vllm_kl)
    kl_loss: bool = False  # --algo.kl.use_loss with --algo.kl.init_coef > 0: ``kl`` is the KL loss's token mean

    @classmethod
    def from_args(cls, args, dp: int) -> "UpdateSettings":
        from openrlhf_lpo.core.config import LPOConfig

        lpo = LPOConfig.from_args(args)
        train, actor = args.train, args.actor
        eps = getattr(actor, "eps_clip_low_high", None) or (actor.eps_clip, actor.eps_clip)
        kl = args.algo.kl
        return cls(group_size=int(args.rollout.n_samples_per_prompt), batch_size=int(train.batch_size), dp=int(dp),
                   epochs=int(train.max_epochs), seed=int(train.seed), micro_batch_size=int(train.micro_batch_size),
                   max_tokens=int(train.max_tokens_per_gpu) if train.dynamic_batch_enable else None,
                   listwise=args.algo.advantage.estimator == "lpo", clip_eps=(float(eps[0]), float(eps[1])),
                   projection=lpo.projection, divergence=lpo.divergence, force_two_pass=bool(lpo.force_two_pass),
                   end_kl=bool(lpo.end_kl), correction=args.algo.advantage.is_correction_level != "off",
                   kl_loss=bool(kl.use_loss) and float(kl.init_coef) > 0)


@dataclass
class UpdateBatch:
    """The rank's samples as the update sees them. ``lengths``: tokens per sample (prompt + response; the token
    budgets). The listwise fields (per sample, float64; ``gids`` the global group ids) come with lpo and with
    ``--lpo.end_kl`` (else None). ``info``: per-sample values whose means every method logs (core/metrics.py)."""

    lengths: List[int]
    gids: Optional[List[int]] = None
    target: Optional[torch.Tensor] = None
    prev: Optional[torch.Tensor] = None
    reward: Optional[torch.Tensor] = None
    tau: Optional[torch.Tensor] = None
    info: Dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def has_targets(self) -> bool:
        return self.target is not None and self.gids is not None


@dataclass(frozen=True)
class WindowPlan:
    """One optimizer window of the rank: micro-batches of sample indices (every rank runs the same count), where
    c comes from (``mode``; None for a policy-gradient estimator), the window's global groups (LPO) and samples."""

    epoch: int
    index: int
    micro_batches: List[List[int]]
    mode: Optional[WindowMode]
    groups: int
    samples: int

    @property
    def indices(self) -> List[int]:
        return [i for mb in self.micro_batches for i in mb]


@dataclass(frozen=True)
class Window:
    """What the engine's ``step`` gets: the plan, the detached c of its samples (float64, in the order of
    ``plan.indices``; None for one pass and for policy gradients) and the divergence of this update."""

    plan: WindowPlan
    coefficients: Optional[torch.Tensor]
    divergence: str


@dataclass
class StepResult:
    """What one optimizer step reports. ``sums``: the rank's sums over the window's training passes (core/metrics.py
    ``STEP_SUMS``); ``s``: LPO's s of each sample at its training pass (float64, ``plan.indices`` order);
    ``grad_norm``: the global gradient norm before clipping; ``lr``: the learning rate after the step."""

    sums: Dict[str, float]
    grad_norm: float
    lr: float
    s: Optional[torch.Tensor] = None


class UpdateEngine(abc.ABC):
    """What a backend hands :func:`run_update`. Every method but ``update_index`` is collective over the
    data-parallel ranks (all call it, in the same order)."""

    @abc.abstractmethod
    def update_index(self) -> int:
        """Optimizer steps before this update (restored by a resume: a resumed run shuffles as the uninterrupted)."""

    @abc.abstractmethod
    def all_reduce(self, values: List[float], op: str) -> List[float]:
        """``values`` reduced element-wise over the data-parallel ranks; ``op`` is sum, max or min."""

    @abc.abstractmethod
    def forward_s(self, micro_batches: List[List[int]], extra: int = 0) -> torch.Tensor:
        """No-grad s (float64, with s_t) of the samples of ``micro_batches`` in their flattened order at the current
        parameters, one forward per micro-batch; ``extra`` forwards more whose result is dropped (every rank runs
        the same number)."""

    @abc.abstractmethod
    def step(self, window: Window) -> StepResult:
        """Forward and backward of every micro-batch of the window, then one optimizer step."""

    def prepare(self, plans: List[WindowPlan]) -> None:
        """Called once with the update's whole plan before the first step (engines that index per micro-batch)."""


@dataclass
class UpdateRecord:
    """What an update did, per window: its plan, the c it used (float64; LPO), the rank's s at its training pass and
    the gradient norm; the end-of-update s with ``--lpo.end_kl``; the divergence it trained. Backends keep the last
    one (``last_update``)."""

    windows: List[WindowPlan] = field(default_factory=list)
    coefficients: List[Optional[torch.Tensor]] = field(default_factory=list)
    s: List[Optional[torch.Tensor]] = field(default_factory=list)
    grad_norms: List[float] = field(default_factory=list)
    s_end: Optional[torch.Tensor] = None
    divergence: str = ""


def _sample_windows(n: int, per_window: int, generator: torch.Generator, reduce: Reduction) -> List[List[List[int]]]:
    """Policy-gradient windows of single samples: a shuffled order cut every ``per_window``; when the ranks hold
    different numbers of samples (a stock partial batch), every rank cuts its order into the largest window count
    any rank needs (each optimizer step is collective)."""
    order = torch.randperm(n, generator=generator).tolist() if n > 1 else list(range(n))
    mine = -(-n // per_window)
    most, n_hi, neg_lo = reduce([float(mine), float(n), float(-n)], "max")
    if int(n_hi) == -int(neg_lo):
        return [[[i] for i in order[j:j + per_window]] for j in range(0, n, per_window)]
    count = int(most)
    if n < count:
        raise ValueError(f"{n} samples cannot fill the {count} optimizer windows the other data-parallel ranks run")
    return [[[int(i)] for i in part] for part in torch.tensor_split(torch.tensor(order), count)]


def _micro_batches(window: List[List[int]], lengths: Sequence[int], settings: UpdateSettings, unit: int,
                   reduce: Reduction) -> Tuple[List[List[int]], bool]:
    """The window's micro-batches and whether each holds whole groups (``unit`` members each; 1: samples).
    Fixed: ``--train.micro_batch_size`` samples. Token budgets: first-fit counts of whole groups (when every rank's
    groups fit) or samples, the largest over the ranks, balanced, none over the budget unless a single item."""
    if settings.max_tokens is None:
        micro = settings.micro_batch_size
        return layout.fixed_micro_batches(window, micro), micro % unit == 0
    budget = settings.max_tokens
    whole, per_sample = layout.budget_micro_count(window, lengths, budget)
    all_whole = unit > 1 and reduce([0.0 if whole is None else 1.0], "min")[0] > 0
    n_micro = int(reduce([float(whole if all_whole else per_sample)], "max")[0])
    n_micro = min(n_micro, len(window) if all_whole else sum(len(g) for g in window))
    return layout.budget_micro_batches(window, lengths, n_micro, all_whole, budget), all_whole or unit == 1


def plan_update(batch: UpdateBatch, settings: UpdateSettings, reduce: Reduction,
                update_index: int) -> List[WindowPlan]:
    """Every optimizer window of the update, epoch after epoch (collective: every rank calls it). LPO: windows of
    ``batch_size / (dp K)`` whole groups; policy gradients: ``batch_size / dp`` samples."""
    K = settings.group_size
    plans: List[WindowPlan] = []
    for epoch in range(settings.epochs):
        generator = window_generator(settings.seed, update_index, epoch)
        if settings.listwise:
            if not batch.has_targets:
                raise ValueError("estimator lpo: the experiences carry no listwise targets (info['lpo_target'], "
                                 "info['lpo_gid']); use the LPO experience maker")
            windows = group_windows(batch.gids, K, groups_per_window(settings.batch_size, settings.dp, K), generator)
            check_window_count(len(windows), lambda v: reduce(v, "max"))
            unit = K
        else:
            windows = _sample_windows(len(batch), groups_per_window(settings.batch_size, settings.dp, 1), generator,
                                      reduce)
            unit = 1
        for w, window in enumerate(windows):
            micro, whole = _micro_batches(window, batch.lengths, settings, unit, reduce)
            mode = (choose_mode(settings.projection, whole, epoch == 0 and w == 0, settings.force_two_pass)
                    if settings.listwise else None)
            n_groups, n_samples = reduce([float(len(window)), float(sum(len(g) for g in window))], "sum")
            plans.append(WindowPlan(epoch, w, micro, mode, int(n_groups) if settings.listwise else 0, int(n_samples)))
    return plans


def pass_micro_batches(indices: List[int], lengths: Sequence[int], settings: UpdateSettings,
                       reduce: Reduction) -> Tuple[List[List[int]], int]:
    """Micro-batches of a no-grad pass over ``indices`` (the end-of-update s): the token budget or
    ``--train.micro_batch_size`` samples, the count agreed over the ranks; plus the forwards this rank repeats to
    run as many as the others (also a rank with nothing to forward)."""
    if settings.max_tokens is not None:
        need = layout.first_fit_count([lengths[i] for i in indices], settings.max_tokens) if indices else 0
    else:
        need = -(-len(indices) // max(settings.micro_batch_size, 1))
    agreed = int(reduce([float(need)], "max")[0])
    if not indices:
        return [], agreed
    own = min(agreed, len(indices))
    if settings.max_tokens is not None:
        parts = layout.budget_partition([lengths[i] for i in indices], own, settings.max_tokens)
        batches = [[indices[j] for j in p] for p in parts]
    else:
        micro = -(-len(indices) // own)
        batches = [indices[i:i + micro] for i in range(0, len(indices), micro)]
    return batches, agreed - len(batches)


def _scatter(n: int, indices: List[int], values: torch.Tensor, into: Optional[torch.Tensor] = None) -> torch.Tensor:
    out = torch.zeros(n, dtype=torch.float64) if into is None else into
    out[torch.tensor(indices, dtype=torch.long)] = values.detach().to("cpu", torch.float64)
    return out


def _window_loss_sum(s: torch.Tensor, target: torch.Tensor, gids: List[int], K: int, divergence: str,
                     projection: str) -> float:
    """Sum over the window's groups (on this rank) of the projection's loss at s (the logged ``policy_loss``)."""
    order = sorted(range(len(gids)), key=lambda j: (gids[j], j))
    idx = torch.tensor(order, dtype=torch.long)
    s_g, w_g = s.double()[idx].view(-1, K), target.double()[idx].view(-1, K)
    return float(listwise.listwise_loss(s_g, w_g, divergence, projection)) * s_g.shape[0]


def run_update(batch: UpdateBatch, settings: UpdateSettings, engine: UpdateEngine,
               divergence: Optional[str] = None) -> Tuple[Dict[str, float], UpdateRecord]:
    """One update of the rank's batch (module doc): the plan, c per window, the steps, the metrics. Returns the
    status every method logs (core/metrics.py) and the :class:`UpdateRecord`."""
    from openrlhf_lpo.core import metrics
    from openrlhf_lpo.core.listwise_metrics import update_metrics

    divergence = divergence or settings.divergence
    listwise.parse_divergence(divergence)
    reduce = engine.all_reduce
    K = settings.group_size
    N = len(batch)
    plans = plan_update(batch, settings, reduce, engine.update_index())
    engine.prepare(plans)
    record = UpdateRecord(divergence=divergence)
    sums: Dict[str, float] = {k: 0.0 for k in metrics.STEP_SUMS}
    window_loss: List[float] = []
    window_count: List[float] = []
    lr = 0.0
    lpo = settings.listwise
    target = batch.target.double() if batch.has_targets else None
    prev = (batch.prev.double() if batch.prev is not None else torch.zeros(N, dtype=torch.float64)) \
        if target is not None else None
    last_s = prev.clone() if lpo else None
    abs_coef_sum, coef_count = 0.0, 0
    modes = {m.value: 0 for m in WindowMode}
    for plan in plans:
        idx = plan.indices
        gids = [batch.gids[i] for i in idx] if lpo else None
        coefficients = None
        if lpo:
            modes[plan.mode.value] += 1
            s_from = None
            if plan.mode is WindowMode.SHORTCUT:
                s_from = prev[idx]
            elif plan.mode is WindowMode.PRE_PASS:  # the window's own micro-batches (token budgets when dynamic)
                s_from = engine.forward_s(plan.micro_batches)
            coefficients = window_coefficients(plan.mode, target[idx], divergence, settings.projection, K,
                                               s=s_from, gids=gids)
        result = engine.step(Window(plan, coefficients, divergence))
        for k in metrics.STEP_SUMS:
            sums[k] += float(result.sums.get(k, 0.0))
        lr = result.lr
        record.windows.append(plan)
        record.grad_norms.append(float(result.grad_norm))
        if lpo:
            if result.s is None:
                raise RuntimeError("the engine's step returned no s for an LPO window")
            s_w = result.s.detach().to("cpu", torch.float64)
            last_s[torch.tensor(idx, dtype=torch.long)] = s_w
            c_w = coefficients if coefficients is not None else window_coefficients(
                WindowMode.PRE_PASS, target[idx], divergence, settings.projection, K, s=s_w, gids=gids)
            abs_coef_sum += float(c_w.abs().sum())
            coef_count += len(idx)
            window_loss.append(_window_loss_sum(s_w, target[idx], gids, K, divergence, settings.projection))
            window_count.append(float(len(idx) // K))
            record.coefficients.append(c_w)
            record.s.append(s_w)
        else:
            window_loss.append(float(result.sums.get("loss_sum", 0.0)))
            window_count.append(float(result.sums.get("loss_count", 0.0)))
            record.coefficients.append(None)
            record.s.append(None)

    s_end = None
    if settings.end_kl and target is not None:
        batches, extra = pass_micro_batches(list(range(N)), batch.lengths, settings, reduce)
        order = [i for mb in batches for i in mb]
        s_end = _scatter(N, order, engine.forward_s(batches, extra)) if order else torch.zeros(N, dtype=torch.float64)
        record.s_end = s_end

    status = metrics.update_status(sums, window_loss, window_count, record.grad_norms, lr, batch.info, settings,
                                   reduce)
    if lpo:
        reward = batch.reward if batch.reward is not None else torch.zeros(N, dtype=torch.float64)
        tau = batch.tau if batch.tau is not None else torch.full((N,), float("nan"), dtype=torch.float64)
        status.update(update_metrics(batch.gids, target, prev, reward, tau, last_s, abs_coef_sum,
                                     coef_count, modes, K, divergence, lambda v: reduce(v, "sum"),
                                     lambda v: reduce(v, "max"), correction=settings.correction, s_end=s_end))
    elif target is not None and settings.end_kl:
        status.update(metrics.paired_listwise_metrics(batch, prev, s_end, K, reduce))
    return status, record
