"""LPO actor trainer: group-level shuffle, whole-group optimizer windows, exact listwise gradient.

Public names (stable):
    LPOActorTrainer    subclass of openrlhf's ActorPPOTrainer (0.11.2); owns ``ppo_train`` for
                       ``--algo.advantage.estimator lpo``, stock behaviour for every other estimator
    LPOPolicyLoss      drop-in for ``PolicyLoss`` (same call signature, same 5-tuple) used by the
                       stock ``training_step``; takes the micro-batch's ``LPOMicroBatch`` as an argument
    LPOMicroBatch      per-micro-batch input: targets, s_t, optional detached coefficients, normaliser
    WindowPlan         one optimizer window: micro-batches of replay-buffer indices, its pass mode
    lpo_group_stats(s[G,K], w*[G,K]) -> dict of per-group KL / entropies (Figure 5 metrics)
    detached_entropy(logits) -> per-token entropy without an autograd graph (chunked)

Every other estimator runs the stock ``ppo_train``; with ``--lpo.end_kl`` a group estimator
(GRPO, Dr.GRPO, MaxRL, ...) also logs lpo/kl_start, lpo/kl_end, lpo/entropy_p_end and
lpo/entropy_target for the target w* of its paired temperature (metrics only, after the update).

Exactness (the listwise gradient sum_k c_k grad s_k needs every c_k from all K members at the
current parameters; s_t and w* are fixed for the rollout batch):

* each DP rank holds whole groups (LPOExperienceMaker) and every optimizer window holds
  ``--train.batch_size`` / K groups of the rank's share (the last window of a partial rollout
  batch holds the rest), groups shuffled as units;
* the trainer marks DeepSpeed's accumulation boundary itself (``set_gradient_accumulation_boundary``)
  at the end of each window, so windows of any length step exactly once;
* micro-batches: ``--train.micro_batch_size`` samples, or under dynamic batching
  ``--train.max_tokens_per_gpu`` tokens (whole groups as items when each group fits, single
  samples otherwise), the count agreed across ranks;
* per window, c comes from one of three places (``lpo/*_windows`` count them):
    one pass     every micro-batch holds whole groups: the loss D(w*, softmax(s_g)) is
                 differentiated directly inside the stock training_step;
    shortcut     the first window of a rollout batch runs at the parameters that produced the old
                 log-probs, so s = s_t exactly and c = dD/ds(s_t) needs no forward;
    pre-pass     later windows whose micro-batches split groups: a no-grad forward gives s;
  then each micro-batch back-propagates the detached surrogate sum_k c_k s_k;
* normalisation: every micro-batch loss is divided by (global groups in the window / gas) and
  multiplied by dp (DeepSpeed divides by its gas and averages over DP), so one optimizer step
  follows the gradient of the listwise loss averaged over the window's groups. KL and entropy
  terms get the window's global token/sample counts the same way.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn

from openrlhf.models import actor as _actor_module
from openrlhf.models.utils import masked_mean
from openrlhf.trainer.ppo_utils.experience import make_experience_batch
from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

from openrlhf_lpo import listwise
from openrlhf_lpo.core.listwise_metrics import (distributed_listwise_stats, listwise_update_metrics, lpo_group_stats,
                                                update_metrics)
from openrlhf_lpo.core import layout, update
from openrlhf_lpo.core.config import LPOConfig
from openrlhf_lpo.core.update import WindowMode
from openrlhf_lpo.openrlhf.experience_maker import LPO_INFO_KEYS
from openrlhf_lpo.core.offpolicy import BehaviourCorrection, correction_from_args, token_keep_mask
from openrlhf_lpo.openrlhf.vlm import mm_forward_kwargs

__all__ = ["LPOActorTrainer", "LPOPolicyLoss", "LPOMicroBatch", "WindowPlan", "lpo_group_stats",
           "detached_entropy"]


# ----------------------------------------------------------------------------- loss


@dataclass(frozen=True)
class LPOMicroBatch:
    """What the loss needs besides the stock arguments, for one micro-batch (B samples); the loss takes it as
    its ``micro_batch`` argument and writes this pass's s and c into ``record``."""

    target: torch.Tensor  # [B] w*_k, members of a group contiguous when coefficients is None
    groups_norm: float  # global groups in the optimizer window / gas
    group_size: int
    divergence: str = "fwd"  # the trainer's (it owns the divergence schedule)
    projection: str = "listwise"
    prev: Optional[torch.Tensor] = None  # [B] s_t = delta_k (offpolicy.py); None = 0
    coefficients: Optional[torch.Tensor] = None  # [B] detached c_k (shortcut / pre-pass / pointwise)
    record: Dict[str, torch.Tensor] = field(default_factory=dict)  # s, c of this pass (detached)


def lpo_log_ratio(log_probs, old_log_probs, action_mask, rollout_log_probs, prev, clip_eps,
                  correction: Optional[BehaviourCorrection], score: str = "mean_clip") -> torch.Tensor:
    """s_k = (1/n_k) sum_t clip(log pi_theta - log pi_t) + delta_k (Eq. 4 against the behaviour
    policy, offpolicy.py), float64; tokens that the correction's mask mode rejects are left out.
    ``score`` (--lpo.score): another registered score (listwise.sequence_score), e.g. TPO's summed log-ratio."""
    mask = token_keep_mask(old_log_probs, rollout_log_probs, action_mask, correction)
    s = listwise.sequence_score(log_probs.double(), old_log_probs.double(), mask, clip_eps, score)
    return s if prev is None else s + prev.to(device=s.device, dtype=s.dtype)


class LPOPolicyLoss(nn.Module):
    """The LPO objective in ``PolicyLoss``'s calling convention (Eq. 4, 10, 11).

    ``forward(log_probs, old_log_probs, advantages, action_mask, rollout_log_probs, dp_size,
    batch_num_tokens, global_batch_size, *, micro_batch) -> (loss, clip_ratio, ppo_kl, None, None)``;
    ``advantages`` and the token/sample normalisers are ignored (LPO normalises by groups). The stock
    ``training_step`` calls ``actor_loss_fn`` without ``micro_batch``: the trainer binds it for that one call
    (:meth:`LPOActorTrainer._step_with`); the loss keeps no state between calls.
    """

    def __init__(self, clip_eps_low: float, clip_eps_high: float, correction: Optional[BehaviourCorrection] = None,
                 score: str = "mean_clip"):
        super().__init__()
        self.clip_eps = (clip_eps_low, clip_eps_high)
        self.correction = correction
        self.score = score

    def forward(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor = None,
        action_mask: Optional[torch.Tensor] = None,
        rollout_log_probs: Optional[torch.Tensor] = None,
        dp_size: int = 1,
        batch_num_tokens=None,
        global_batch_size=None,
        *,
        micro_batch: Optional[LPOMicroBatch] = None,
    ):
        ctx = micro_batch
        if ctx is None:
            raise RuntimeError("LPOPolicyLoss needs its micro_batch argument (LPOActorTrainer.ppo_train binds it)")
        # LPO math in float64 (B scalars): the listwise softmax is exact whatever the layout.
        s = lpo_log_ratio(log_probs, old_log_probs, action_mask, rollout_log_probs, ctx.prev, self.clip_eps,
                          self.correction, self.score)
        if ctx.coefficients is None:
            K = ctx.group_size
            s_g = s.view(-1, K)
            w_g = ctx.target.to(s.device).view(-1, K)
            total = listwise.listwise_loss(s_g, w_g, ctx.divergence, ctx.projection) * s_g.shape[0]
            coef = listwise.projection_coefficients(s_g, w_g, ctx.divergence, ctx.projection).reshape(-1)
        else:
            coef = ctx.coefficients.to(device=s.device, dtype=s.dtype)
            total = (coef.detach() * s).sum()
        ctx.record["s"] = s.detach()
        ctx.record["c"] = coef.detach()
        loss = (total / ctx.groups_norm * dp_size).to(log_probs.dtype)

        raw = (log_probs - old_log_probs).detach()
        lo, hi = math.log1p(-self.clip_eps[0]), math.log1p(self.clip_eps[1])
        mask = action_mask if action_mask is not None else torch.ones_like(raw, dtype=torch.bool)
        clip_ratio = masked_mean(((raw < lo) | (raw > hi)).float(), mask, dim=None)
        ppo_kl = masked_mean(-raw, mask, dim=None)
        return loss, clip_ratio, ppo_kl, None, None


# ----------------------------------------------------------------------------- helpers


def detached_entropy(logits: torch.Tensor, max_elements: int = 1 << 26) -> torch.Tensor:
    """Per-token entropy of softmax(logits) [B, T] with no autograd graph, computed over chunks of
    positions so the temporary holds at most ``max_elements`` (the stock ``compute_entropy`` keeps the
    full [B, T, V] softmax for backward; with ``--actor.entropy_coef 0`` it is only logged)."""
    with torch.no_grad():
        b, t, v = logits.shape
        out = torch.empty(b, t, dtype=logits.dtype, device=logits.device)
        step = max(1, max_elements // max(b * v, 1))
        for lo in range(0, t, step):
            chunk = logits[:, lo:lo + step]
            p = torch.softmax(chunk, dim=-1)
            out[:, lo:lo + step] = torch.logsumexp(chunk, dim=-1) - (p * chunk).sum(-1)
    return out


@dataclass
class WindowPlan:
    """One optimizer window: micro-batches of replay-buffer indices and where c comes from."""

    micro_batches: List[List[int]]
    groups: int  # global groups in the window (all ranks)
    mode: WindowMode
    loss_norm: Dict[str, object]  # dp_size, batch_num_tokens, global_batch_size (stock KL / entropy terms)


def _pop_lpo_info(info: dict) -> Dict[str, torch.Tensor]:
    out = {}
    for key in LPO_INFO_KEYS:
        value = info.pop(key, None)
        if value is None:
            continue
        out[key] = torch.stack([torch.as_tensor(v) for v in value]) if isinstance(value, list) else value
    return out


# ----------------------------------------------------------------------------- trainer


class LPOActorTrainer(ActorPPOTrainer):
    """ActorPPOTrainer whose ``ppo_train`` implements LPO (see module doc); stock otherwise."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.is_lpo = self.args.algo.advantage.estimator == "lpo"
        self.lpo = LPOConfig.from_args(self.args)
        self.divergence = self.lpo.divergence  # this trainer's; --lpo.divergence_schedule moves it (set_divergence)
        self.correction = correction_from_args(self.args) if self.is_lpo else None
        if self.is_lpo:
            lo, hi = self.args.actor.eps_clip_low_high
            self.actor_loss_fn = LPOPolicyLoss(lo, hi, correction=self.correction, score=self.lpo.score)
        self.last_window_plan: List[WindowPlan] = []  # for inspection/tests
        self.pass_shapes: List[List[int]] = []  # tokens per no-grad forward of each pass (inspection/tests)
        self._ppo_calls = 0

    def set_divergence(self, divergence: str) -> None:
        """The divergence of the next updates (--lpo.divergence_schedule; the driver calls it through
        ``LPOPolicyActor.set_lpo_divergence`` before each update whose divergence changes)."""
        listwise.parse_divergence(divergence)
        self.divergence = divergence

    # -- distributed helpers
    def _device(self) -> torch.device:
        return next(self.actor.parameters()).device

    def _dp_group(self):
        mesh = getattr(self.strategy, "ds_device_mesh", None)
        return mesh["dp"].get_group() if mesh is not None else None

    def _dp_size(self) -> int:
        if not dist.is_initialized():
            return 1
        return dist.get_world_size(group=self._dp_group())

    def _all_reduce(self, values: List[float], op=None) -> List[float]:
        """All-reduce a few numbers over the DP group, on the group's device (NCCL needs it)."""
        t = torch.tensor(values, dtype=torch.float64, device=self._device())
        if dist.is_initialized():
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=self._dp_group())
        return t.tolist()

    def _engine(self):
        return getattr(self.actor, "model", None)

    def _gas(self) -> int:
        """Gradient-accumulation steps the engine divides each backward loss by."""
        engine = self._engine()
        if hasattr(engine, "gradient_accumulation_steps"):
            return int(engine.gradient_accumulation_steps())
        return 1 if self.args.train.dynamic_batch_enable else max(int(self.strategy.accumulated_gradient), 1)

    def _update_index(self) -> int:
        """Which update this is: the engine's optimizer-step count (restored by a resume, so a resumed
        run shuffles its windows like the uninterrupted one), else the number of ppo_train calls."""
        steps = getattr(self._engine(), "global_steps", None)
        return int(steps) if isinstance(steps, int) else self._ppo_calls

    def _step_with(self, micro_batch: LPOMicroBatch, experience, kl_ctl, step: int, loss_norm):
        """The stock ``training_step`` on one micro-batch, its ``actor_loss_fn`` call given ``micro_batch``."""
        loss_fn = self.actor_loss_fn
        self.actor_loss_fn = functools.partial(loss_fn, micro_batch=micro_batch)
        try:
            return self.training_step(experience, kl_ctl, step, loss_norm)
        finally:
            self.actor_loss_fn = loss_fn

    def _mark_boundary(self, is_boundary: bool) -> None:
        engine = self._engine()
        if hasattr(engine, "set_gradient_accumulation_boundary"):
            engine.set_gradient_accumulation_boundary(is_boundary)

    # -- forward helpers
    @torch.no_grad()
    def _log_ratio(self, experience, prev: Optional[torch.Tensor]) -> torch.Tensor:
        log_probs = self.actor(
            experience.sequences,
            experience.action_mask,
            attention_mask=experience.attention_mask,
            ring_attn_group=self.strategy.ring_attn_group,
            **mm_forward_kwargs(self.actor, experience),  # VLM: the images (else s is wrong)
        )
        return lpo_log_ratio(log_probs, experience.action_log_probs, experience.action_mask,
                             experience.rollout_log_probs, prev, tuple(self.args.actor.eps_clip_low_high),
                             self.correction, self.lpo.score).cpu()

    def _collate(self, items, indices):
        exp = make_experience_batch([items[i] for i in indices], self.args.ds.packing_samples)
        meta = _pop_lpo_info(exp.info)
        exp.to_device(self._device())
        return exp, meta

    def _log_ratios(self, items, micro_batches: List[List[int]], prev: Optional[torch.Tensor],
                    extra_forwards: int = 0) -> torch.Tensor:
        """s of the items in ``micro_batches`` (in their flattened order) at the current parameters, one
        no-grad forward per micro-batch; ``extra_forwards`` repeat the first one with the result
        dropped (ZeRO-3 gathers parameters in every forward: each rank runs the same number)."""
        n = sum(len(mb) for mb in micro_batches)
        out = torch.zeros(n, dtype=torch.float64)
        self.actor.train()
        lo = 0
        for m, ids in enumerate(list(micro_batches) + list(micro_batches[:1]) * extra_forwards):
            exp, _ = self._collate(items, ids)
            s = self._log_ratio(exp, None if prev is None else prev[torch.tensor(ids)]).double()
            if m < len(micro_batches):
                out[lo:lo + len(ids)] = s
                lo += len(ids)
        self.pass_shapes.append([sum(int(items[i].total_length.reshape(-1)[0]) for i in ids) for ids in micro_batches])
        return out

    def _pass_micro_batches(self, items, indices: List[int]):
        """Micro-batches for a no-grad pass over ``indices`` (the end-of-update KL): under dynamic batching
        ``--train.max_tokens_per_gpu`` tokens each (the count agreed across ranks), else
        ``--train.micro_batch_size`` samples; plus the forwards this rank repeats to match the others."""
        args = self.args
        dynamic = bool(args.train.dynamic_batch_enable)
        if dynamic:
            budget = int(args.train.max_tokens_per_gpu)
            lengths = [int(items[i].total_length.reshape(-1)[0].item()) for i in indices]
            need = layout.first_fit_count(lengths, budget)
        else:
            need = -(-len(indices) // max(int(self.micro_train_batch_size), 1))
        agreed = int(self._all_reduce([float(need)], op=dist.ReduceOp.MAX)[0])  # every rank, also an empty one
        if not indices:  # nothing to forward here (a ZeRO-3 peer's gathers then wait on this rank)
            return [], 0
        own = min(agreed, len(indices))
        if dynamic:
            parts = layout.budget_partition(lengths, own, budget)
            batches = [[indices[j] for j in p] for p in parts]
        else:
            micro = -(-len(indices) // own)
            batches = [indices[i:i + micro] for i in range(0, len(indices), micro)]
        return batches, agreed - len(batches)

    def training_step(self, experience, kl_ctl, step, loss_batch_info=None):
        if self.args.actor.entropy_coef == 0:
            # entropy is only logged: no [B, T, V] softmax kept for backward
            with mock.patch.object(_actor_module, "compute_entropy", detached_entropy):
                return super().training_step(experience, kl_ctl, step, loss_batch_info)
        return super().training_step(experience, kl_ctl, step, loss_batch_info)

    # -- policy-gradient estimators (stock update, optional listwise metrics)
    def _pg_ppo_train(self, kl_ctl: float):
        """Stock ppo_train; with --lpo.end_kl, the listwise KL of the paired target after it.
        Every rank joins the metric's collectives, also one whose share of a partial batch is empty."""
        items = self.replay_buffer.items
        self.pass_shapes = []
        meta = [{k: it.info.pop(k) for k in LPO_INFO_KEYS if k in it.info} for it in items]
        status = super().ppo_train(kl_ctl)
        if not (self.lpo.end_kl and all("lpo_target" in m for m in meta)):
            return status
        gids = torch.tensor([int(m["lpo_gid"]) for m in meta], dtype=torch.long)
        target = torch.tensor([float(m["lpo_target"]) for m in meta], dtype=torch.float64)
        prev = torch.tensor([float(m["lpo_prev_log_ratio"]) for m in meta], dtype=torch.float64)
        batches, extra = self._pass_micro_batches(items, list(range(len(items))))
        order = [i for mb in batches for i in mb]
        s_end = torch.empty(len(items), dtype=torch.float64)
        s_end[torch.tensor(order, dtype=torch.long)] = self._log_ratios(items, batches, None, extra)
        status.update(listwise_update_metrics(gids, prev, s_end, target, self.args.rollout.n_samples_per_prompt,
                                              group=self._dp_group(), device=self._device()))
        return status

    # -- planning
    def _loss_norm(self, items, indices: List[int], gas: int, dp: int) -> Dict[str, object]:
        """Stock normalisers of one window (KL / entropy terms): global response tokens and non-empty
        samples of the window, divided by gas (DeepSpeed divides each backward by its gas)."""
        masks = [items[i].action_mask for i in indices]
        tokens = float(sum(int(m.sum()) for m in masks))
        samples = float(sum(int(m.sum() > 0) for m in masks))
        tokens, samples = self._all_reduce([tokens, samples])
        device = self._device()
        return {"dp_size": dp, "batch_num_tokens": torch.tensor(tokens / gas, dtype=torch.float32, device=device),
                "global_batch_size": torch.tensor(samples / gas, dtype=torch.float32, device=device)}

    def plan(self, items, gids: List[int], epoch: int) -> List[WindowPlan]:
        """The optimizer windows of one epoch over this rank's items (collectives: every rank calls it).
        The first window of epoch 0 runs at the parameters that produced the old log-probs."""
        args = self.args
        K = args.rollout.n_samples_per_prompt
        dp, gas = self._dp_size(), self._gas()
        windows = update.group_windows(gids, K, update.groups_per_window(args.train.batch_size, dp, K),
                                       update.window_generator(args.train.seed, self._update_index(), epoch))
        update.check_window_count(len(windows), lambda v: self._all_reduce(v, op=dist.ReduceOp.MAX))
        dynamic = bool(args.train.dynamic_batch_enable)
        lengths = [int(it.total_length.reshape(-1)[0].item()) for it in items] if dynamic else None
        projection = self.lpo.projection
        plans = []
        for w, window in enumerate(windows):
            if dynamic:
                budget = int(args.train.max_tokens_per_gpu)
                whole, per_sample = layout.budget_micro_count(window, lengths, budget)
                all_whole = self._all_reduce([0.0 if whole is None else 1.0], op=dist.ReduceOp.MIN)[0] > 0
                n_micro = int(self._all_reduce([float(whole if all_whole else per_sample)], op=dist.ReduceOp.MAX)[0])
                micro_batches = layout.budget_micro_batches(window, lengths, n_micro, all_whole, budget)
                whole_groups = all_whole
            else:
                micro = int(self.micro_train_batch_size)
                micro_batches = layout.fixed_micro_batches(window, micro)
                whole_groups = micro % K == 0
            mode = update.choose_mode(projection, whole_groups, epoch == 0 and w == 0, self.lpo.force_two_pass)
            indices = [i for mb in micro_batches for i in mb]
            n_groups = int(self._all_reduce([float(len(window))])[0])
            plans.append(WindowPlan(micro_batches, n_groups, mode, self._loss_norm(items, indices, gas, dp)))
        return plans

    # -- main loop
    def ppo_train(self, kl_ctl: float):
        if not self.is_lpo:
            return self._pg_ppo_train(kl_ctl)

        args = self.args
        K = args.rollout.n_samples_per_prompt
        items = self.replay_buffer.items
        if not items:
            raise RuntimeError("LPO: this rank received no samples for the update (the experience maker deals "
                               "every rank whole groups in equal counts)")
        gas = self._gas()
        div = self.divergence

        # per-sample constants of the rollout batch
        gids = [int(it.info["lpo_gid"]) for it in items]
        target = torch.tensor([float(it.info["lpo_target"]) for it in items], dtype=torch.float64)
        prev = torch.tensor([float(it.info["lpo_prev_log_ratio"]) for it in items], dtype=torch.float64)
        reward = torch.tensor([float(it.info["lpo_reward"]) for it in items], dtype=torch.float64)
        tau = torch.tensor([float(it.info["lpo_tau"]) for it in items], dtype=torch.float64)
        prev_ctx = prev if bool(prev.abs().max() > 0) else None

        plans = [p for epoch in range(self.max_epochs) for p in self.plan(items, gids, epoch)]
        self.last_window_plan = plans
        self.pass_shapes = []
        if args.train.dynamic_batch_enable:  # read by the stock training_step, per micro-batch
            flags, scales = [], []
            for p in plans:
                n = sum(len(mb) for mb in p.micro_batches)
                flags += [0] * (len(p.micro_batches) - 1) + [1]
                scales += [len(mb) / n for mb in p.micro_batches]
            self.replay_buffer.dynamic_optimizer_step = flags
            self.replay_buffer.dynamic_sample_loss_scale = scales

        last_s = prev.clone()
        sums: Dict[str, float] = {}
        weights: Dict[str, str] = {}
        last: Dict[str, float] = {}
        counts = {"_n_samples": 0.0, "_n_tokens": 0.0}
        abs_coef_sum, coef_count = 0.0, 0
        modes = {m.value: 0 for m in WindowMode}

        step = 0
        for plan in plans:
            modes[plan.mode.value] += 1
            idx = torch.tensor([i for mb in plan.micro_batches for i in mb])
            s_win = None
            if plan.mode is WindowMode.SHORTCUT:
                s_win = prev[idx]
            elif plan.mode is WindowMode.PRE_PASS:  # the window's own micro-batches (token budgets when dynamic)
                s_win = self._log_ratios(items, plan.micro_batches, prev_ctx)
            coefficients = update.window_coefficients(plan.mode, target[idx], div, self.lpo.projection, K,
                                                      s=s_win, gids=[gids[int(i)] for i in idx])
            offset = 0
            for m, mb in enumerate(plan.micro_batches):
                exp, _ = self._collate(items, mb)
                sel = torch.tensor(mb)
                ctx = LPOMicroBatch(
                    target=target[sel],
                    groups_norm=plan.groups / gas,
                    group_size=K,
                    divergence=div,
                    projection=self.lpo.projection,
                    prev=None if prev_ctx is None else prev_ctx[sel],
                    coefficients=None if coefficients is None else coefficients[offset:offset + len(mb)],
                )
                offset += len(mb)
                self._mark_boundary(m == len(plan.micro_batches) - 1)
                status = self._step_with(ctx, exp, kl_ctl, step, plan.loss_norm)
                step += 1
                last_s[sel] = ctx.record["s"].double().cpu()
                abs_coef_sum += float(ctx.record["c"].abs().sum())
                coef_count += len(mb)
                self._accumulate(status, sums, weights, last, counts)

        status = self._reduce(sums, weights, last, counts)
        status.update(self._lpo_metrics(items, gids, target, prev, reward, tau, last_s, abs_coef_sum, coef_count,
                                        modes, prev_ctx))
        self._ppo_calls += 1
        return status

    # -- metrics
    @staticmethod
    def _accumulate(status, sums, weights, last, counts):
        n_tok, n_smp = status["num_action_tokens"], status["num_samples"]
        counts["_n_tokens"] += n_tok
        counts["_n_samples"] += n_smp
        for k, v in status["metrics"].items():
            w = status["weights"][k]
            if w is None:
                last[k] = float(v) if not isinstance(v, torch.Tensor) else float(v.float().mean())
                continue
            scale = n_tok if w == "token" else n_smp
            val = v.float().mean().item() if isinstance(v, torch.Tensor) else float(v)
            sums[k] = sums.get(k, 0.0) + val * scale
            weights[k] = w

    def _reduce(self, sums, weights, last, counts):
        keys = sorted(sums)
        totals = self._all_reduce([sums[k] for k in keys] + [counts["_n_tokens"], counts["_n_samples"]])
        n_tok, n_smp = totals[-2], totals[-1]
        out = {}
        for k, v in zip(keys, totals):
            denom = n_tok if weights[k] == "token" else n_smp
            out[k] = float(v) / max(denom, 1e-12)
        out.update(last)
        if "entropy_loss" in out:
            out["response_entropy"] = out["entropy_loss"]
        return out

    def _lpo_metrics(self, items, gids, target, prev, reward, tau, last_s, abs_coef_sum, coef_count, modes,
                     prev_ctx):
        K = self.args.rollout.n_samples_per_prompt
        s_end = end = None
        if self.lpo.end_kl:
            batches, extra = self._pass_micro_batches(items, list(range(len(items))))
            order = torch.tensor([i for mb in batches for i in mb], dtype=torch.long)
            s_end = torch.empty(len(items), dtype=torch.float64)
            s_end[order] = self._log_ratios(items, batches, prev_ctx, extra)
        out = update_metrics(gids, target, prev, reward, tau, last_s, abs_coef_sum, coef_count, modes, K,
                             self.divergence, self._all_reduce,
                             lambda v: self._all_reduce(v, op=dist.ReduceOp.MAX), correction=self.correction is not None,
                             s_end=s_end)
        if s_end is not None:
            end = distributed_listwise_stats(torch.tensor(gids), s_end, target, K, group=self._dp_group(),
                                             device=self._device())
            out["lpo/kl_end"] = end["kl"]
            out["lpo/entropy_p_end"] = end["entropy_p"]
        return out
