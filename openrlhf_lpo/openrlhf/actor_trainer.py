"""The DeepSpeed backend of the policy update: ``LPOActorTrainer`` runs core/update.py's loop for every estimator.

Public names (stable):
    LPOActorTrainer    subclass of openrlhf's ActorPPOTrainer (0.11.2) whose ``ppo_train`` is
                       ``core.update.run_update`` with this trainer as the engine (:class:`DeepSpeedEngine`): LPO
                       and every policy-gradient estimator (GRPO, Dr.GRPO, DAPO, GSPO, CISPO, RLOO, ...) take their
                       windows from ``--train.seed`` and log the metric set of core/metrics.py
    LPOPolicyLoss      drop-in for ``PolicyLoss`` (same call signature, same 5-tuple) used by the stock
                       ``training_step``: core/loss.py's listwise loss with DeepSpeed's normalisation; takes the
                       micro-batch's ``LPOMicroBatch`` as an argument and keeps its last ``ListwiseTerms``
    MeteredLoss        wraps the trainer's loss: the token statistics of every training pass (core/loss.py)
    LPOMicroBatch      per-micro-batch input: targets, s_t, optional detached coefficients, normaliser
    DeepSpeedEngine    core.update.UpdateEngine of this trainer
    lpo_group_stats(s[G,K], w*[G,K]) -> dict of per-group KL / entropies (Figure 5 metrics)
    detached_entropy(logits) -> per-token entropy without an autograd graph (chunked)

What stays here is the engine side: DeepSpeed's normalisation and calls. Each micro-batch goes through the stock
``training_step`` (its forward, KL and entropy terms, backward and optimizer step) with the window's loss
normalisers; the trainer marks DeepSpeed's accumulation boundary itself at the end of each window
(``set_gradient_accumulation_boundary``), so windows of any length step exactly once. The listwise loss of a
micro-batch is divided by (global groups in the window / gas) and multiplied by dp (DeepSpeed divides by its gas
and averages over DP), so one optimizer step follows the gradient of the listwise loss averaged over the window's
groups; a policy-gradient loss and the KL / entropy terms get the window's global token/sample counts the same way
(upstream's ``aggregate_loss``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List, Optional
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn

from openrlhf.models import actor as _actor_module
from openrlhf.trainer.ppo_utils.experience import make_experience_batch
from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

from openrlhf_lpo import listwise
from openrlhf_lpo.core import metrics as metric_set
from openrlhf_lpo.core.config import LPOConfig
from openrlhf_lpo.core.listwise_metrics import lpo_group_stats
from openrlhf_lpo.core.loss import ListwiseTerms, listwise_micro_loss, log_ratio, token_statistics
from openrlhf_lpo.core.offpolicy import BehaviourCorrection, correction_from_args
from openrlhf_lpo.core.update import (StepResult, UpdateBatch, UpdateEngine, UpdateRecord, UpdateSettings, Window,
                                      WindowPlan, run_update)
from openrlhf_lpo.openrlhf.experience_maker import LPO_INFO_KEYS
from openrlhf_lpo.openrlhf.vlm import mm_forward_kwargs

__all__ = ["LPOActorTrainer", "LPOPolicyLoss", "MeteredLoss", "LPOMicroBatch", "DeepSpeedEngine", "lpo_group_stats",
           "detached_entropy"]


# ----------------------------------------------------------------------------- loss


@dataclass(frozen=True)
class LPOMicroBatch:
    """What the loss needs besides the stock arguments, for one micro-batch (B samples)."""

    target: torch.Tensor  # [B] w*_k, members of a group contiguous when coefficients is None
    groups_norm: float  # global groups in the optimizer window / gas
    group_size: int
    divergence: str = "fwd"  # the trainer's (it owns the divergence schedule)
    projection: str = "listwise"
    prev: Optional[torch.Tensor] = None  # [B] s_t = delta_k (offpolicy.py); None = 0
    coefficients: Optional[torch.Tensor] = None  # [B] detached c_k (shortcut / pre-pass / pointwise)


class LPOPolicyLoss(nn.Module):
    """The LPO objective in ``PolicyLoss``'s calling convention (Eq. 4, 10, 11; core/loss.py).

    ``forward(log_probs, old_log_probs, advantages, action_mask, rollout_log_probs, dp_size,
    batch_num_tokens, global_batch_size, *, micro_batch) -> (loss, clip_ratio, ppo_kl, None, None)``;
    ``advantages`` and the token/sample normalisers are ignored (LPO normalises by groups). The stock
    ``training_step`` calls ``actor_loss_fn`` without ``micro_batch``: the trainer binds it for that one call.
    ``last`` holds the last call's :class:`ListwiseTerms` (s and c of that micro-batch).
    """

    def __init__(self, clip_eps_low: float, clip_eps_high: float, correction: Optional[BehaviourCorrection] = None,
                 score: str = "mean_clip"):
        super().__init__()
        self.clip_eps = (clip_eps_low, clip_eps_high)
        self.correction = correction
        self.score = score
        self.last: Optional[ListwiseTerms] = None

    def forward(self, log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor = None,
                action_mask: Optional[torch.Tensor] = None, rollout_log_probs: Optional[torch.Tensor] = None,
                dp_size: int = 1, batch_num_tokens=None, global_batch_size=None, *,
                micro_batch: Optional[LPOMicroBatch] = None):
        ctx = micro_batch
        if ctx is None:
            raise RuntimeError("LPOPolicyLoss needs its micro_batch argument (LPOActorTrainer binds it)")
        mask = action_mask if action_mask is not None else torch.ones_like(log_probs, dtype=torch.bool)
        terms = listwise_micro_loss(log_probs, old_log_probs, mask, ctx.target, ctx.group_size, ctx.divergence,
                                    ctx.projection, self.clip_eps, prev=ctx.prev, coefficients=ctx.coefficients,
                                    rollout_log_probs=rollout_log_probs, correction=self.correction, score=self.score)
        self.last = terms
        loss = (terms.total / ctx.groups_norm * dp_size).to(log_probs.dtype)
        stats = token_statistics(log_probs, old_log_probs, mask, self.clip_eps)
        tokens = stats["tokens"].clamp(min=1.0)
        return loss, stats["out_of_band"] / tokens, stats["ppo_kl_sum"] / tokens, None, None


class MeteredLoss(nn.Module):
    """The trainer's loss (``LPOPolicyLoss``, or upstream's ``PolicyLoss`` / ``ExtendedPolicyLoss`` of a
    policy-gradient estimator) unchanged, plus core/loss.py's token statistics of each call in ``last_stats``."""

    def __init__(self, inner: nn.Module, clip_eps, correction_band=None):
        super().__init__()
        self.inner = inner
        self.clip_eps = tuple(clip_eps)
        self.correction_band = correction_band
        self.last_stats: Dict[str, torch.Tensor] = {}

    @property
    def token_level_loss(self) -> bool:
        return bool(getattr(self.inner, "token_level_loss", True))

    def forward(self, log_probs, old_log_probs, advantages=None, action_mask=None, rollout_log_probs=None, dp_size=1,
                batch_num_tokens=None, global_batch_size=None, **kwargs):
        out = self.inner(log_probs, old_log_probs, advantages, action_mask=action_mask,
                         rollout_log_probs=rollout_log_probs, dp_size=dp_size, batch_num_tokens=batch_num_tokens,
                         global_batch_size=global_batch_size, **kwargs)
        mask = action_mask if action_mask is not None else torch.ones_like(log_probs, dtype=torch.bool)
        self.last_stats = token_statistics(log_probs, old_log_probs, mask, self.clip_eps, rollout_log_probs,
                                           self.correction_band)
        return out


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


def _pop_lpo_info(info: dict) -> None:
    for key in LPO_INFO_KEYS:
        info.pop(key, None)


def _item_float(items, key: str) -> torch.Tensor:
    return torch.tensor([float(it.info[key]) for it in items], dtype=torch.float64)


def update_batch(items, listwise_fields: bool) -> UpdateBatch:
    """The :class:`UpdateBatch` of the replay buffer's single-sample items (the listwise fields when present)."""
    lengths = [int(it.total_length.reshape(-1)[0].item()) for it in items]
    info = metric_set.experience_info(items)
    if not (listwise_fields and all("lpo_target" in it.info for it in items)):
        return UpdateBatch(lengths=lengths, info=info)
    has = all("lpo_reward" in it.info for it in items)
    return UpdateBatch(lengths=lengths, gids=[int(it.info["lpo_gid"]) for it in items],
                       target=_item_float(items, "lpo_target"), prev=_item_float(items, "lpo_prev_log_ratio"),
                       reward=_item_float(items, "lpo_reward") if has else None,
                       tau=_item_float(items, "lpo_tau") if has else None, info=info)


# ----------------------------------------------------------------------------- the engine


class DeepSpeedEngine(UpdateEngine):
    """core.update's engine over one rank's replay buffer: each micro-batch through the stock ``training_step``."""

    def __init__(self, trainer: "LPOActorTrainer", items, batch: UpdateBatch, kl_ctl: float):
        self.t = trainer
        self.items = items
        self.batch = batch
        self.kl_ctl = kl_ctl
        prev = batch.prev
        self.prev = prev if prev is not None and bool(prev.abs().max() > 0) else None
        self.micro_step = 0

    def update_index(self) -> int:
        return self.t._update_index()

    def all_reduce(self, values: List[float], op: str) -> List[float]:
        return self.t._all_reduce(values, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                                              "min": dist.ReduceOp.MIN}[op])

    def forward_s(self, micro_batches: List[List[int]], extra: int = 0) -> torch.Tensor:
        return self.t._log_ratios(self.items, micro_batches, self.prev, extra)

    def prepare(self, plans: List[WindowPlan]) -> None:
        if self.t.args.train.dynamic_batch_enable:  # read by the stock training_step, per micro-batch
            flags, scales = [], []
            for p in plans:
                n = sum(len(mb) for mb in p.micro_batches)
                flags += [0] * (len(p.micro_batches) - 1) + [1]
                scales += [len(mb) / n for mb in p.micro_batches]
            self.t.replay_buffer.dynamic_optimizer_step = flags
            self.t.replay_buffer.dynamic_sample_loss_scale = scales

    def step(self, window: Window) -> StepResult:
        t, plan = self.t, window.plan
        lpo = plan.mode is not None
        gas, dp = t._gas(), t._dp_size()
        loss_norm = t._loss_norm(self.items, plan.indices, gas, dp)
        bnt = float(loss_norm["batch_num_tokens"])
        norm = bnt if t.actor_loss_fn.token_level_loss else float(loss_norm["global_batch_size"])
        sums = {k: 0.0 for k in metric_set.STEP_SUMS}
        s_parts, offset, last = [], 0, {}
        for m, mb in enumerate(plan.micro_batches):
            exp = t._collate(self.items, mb)
            sel = torch.tensor(mb)
            ctx = None
            if lpo:
                ctx = LPOMicroBatch(
                    target=self.batch.target[sel], groups_norm=plan.groups / gas, group_size=t.args.rollout.n_samples_per_prompt,
                    divergence=window.divergence, projection=t.lpo.projection,
                    prev=None if self.prev is None else self.prev[sel],
                    coefficients=None if window.coefficients is None else window.coefficients[offset:offset + len(mb)])
            offset += len(mb)
            t._mark_boundary(m == len(plan.micro_batches) - 1)
            status = t._step_with(ctx, exp, self.kl_ctl, self.micro_step, loss_norm)
            self.micro_step += 1
            metrics = status["metrics"]
            last = metrics
            for k, v in t.actor_loss_fn.last_stats.items():
                sums[k] += float(v)
            if "entropy_loss" in metrics:  # upstream's token-level aggregate with loss_norm: the sum * dp / bnt
                sums["entropy_sum"] += _scalar(metrics["entropy_loss"]) * bnt / dp
            if t.update.kl_loss and "kl" in metrics:
                sums["kl_loss_sum"] += _scalar(metrics["kl"]) * bnt / dp
            if lpo:
                s_parts.append(t.lpo_loss.last.s.detach().cpu())
            else:
                sums["loss_sum"] += _scalar(metrics["policy_loss"]) * norm / dp
                mask = exp.action_mask
                sums["loss_count"] += float(mask.sum() if t.actor_loss_fn.token_level_loss
                                            else (mask.reshape(mask.shape[0], -1).sum(-1) > 0).sum())
        return StepResult(sums=sums, grad_norm=_scalar(last.get("actor_grad_norm", 0.0)),
                          lr=_scalar(last.get("actor_lr", 0.0)), s=torch.cat(s_parts) if lpo else None)


def _scalar(v) -> float:
    return float(v.float().mean()) if isinstance(v, torch.Tensor) else float(v)


# ----------------------------------------------------------------------------- trainer


class LPOActorTrainer(ActorPPOTrainer):
    """ActorPPOTrainer whose ``ppo_train`` is core.update's loop (see module doc)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.is_lpo = self.args.algo.advantage.estimator == "lpo"
        self.lpo = LPOConfig.from_args(self.args)
        self.update = UpdateSettings.from_args(self.args, self._dp_size())
        self.divergence = self.lpo.divergence  # this trainer's; --lpo.divergence_schedule moves it (set_divergence)
        self.correction = correction_from_args(self.args) if self.is_lpo else None
        lo, hi = self.args.actor.eps_clip_low_high
        self.lpo_loss = LPOPolicyLoss(lo, hi, correction=self.correction, score=self.lpo.score) if self.is_lpo else None
        adv = self.args.algo.advantage
        band = tuple(adv.is_correction_threshold) if adv.is_correction_level != "off" else None
        self.actor_loss_fn = MeteredLoss(self.lpo_loss or self.actor_loss_fn, (lo, hi), band)
        self.last_update: Optional[UpdateRecord] = None
        self.pass_shapes: List[List[int]] = []  # tokens per no-grad forward of each pass (the budget checks)
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

    def _step_with(self, micro_batch: Optional[LPOMicroBatch], experience, kl_ctl, step: int, loss_norm):
        """The stock ``training_step`` on one micro-batch, its ``actor_loss_fn`` call given ``micro_batch`` (LPO)."""
        if micro_batch is None:
            return self.training_step(experience, kl_ctl, step, loss_norm)
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
        return log_ratio(log_probs, experience.action_log_probs, experience.action_mask,
                         experience.rollout_log_probs, prev, tuple(self.args.actor.eps_clip_low_high),
                         self.correction, self.lpo.score).cpu()

    def _collate(self, items, indices):
        exp = make_experience_batch([items[i] for i in indices], self.args.ds.packing_samples)
        _pop_lpo_info(exp.info)
        exp.to_device(self._device())
        return exp

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
            exp = self._collate(items, ids)
            s = self._log_ratio(exp, None if prev is None else prev[torch.tensor(ids)]).double()
            if m < len(micro_batches):
                out[lo:lo + len(ids)] = s
                lo += len(ids)
        self.pass_shapes.append([sum(int(items[i].total_length.reshape(-1)[0]) for i in ids) for ids in micro_batches])
        return out

    def training_step(self, experience, kl_ctl, step, loss_batch_info=None):
        if self.args.actor.entropy_coef == 0:
            # entropy is only logged: no [B, T, V] softmax kept for backward
            with mock.patch.object(_actor_module, "compute_entropy", detached_entropy):
                return super().training_step(experience, kl_ctl, step, loss_batch_info)
        return super().training_step(experience, kl_ctl, step, loss_batch_info)

    # -- planning
    def _loss_norm(self, items, indices: List[int], gas: int, dp: int) -> Dict[str, object]:
        """Stock normalisers of one window (policy-gradient, KL and entropy terms): global response tokens and
        non-empty samples of the window, divided by gas (DeepSpeed divides each backward by its gas)."""
        masks = [items[i].action_mask for i in indices]
        tokens = float(sum(int(m.sum()) for m in masks))
        samples = float(sum(int(m.sum() > 0) for m in masks))
        tokens, samples = self._all_reduce([tokens, samples])
        device = self._device()
        return {"dp_size": dp, "batch_num_tokens": torch.tensor(tokens / gas, dtype=torch.float32, device=device),
                "global_batch_size": torch.tensor(samples / gas, dtype=torch.float32, device=device)}

    # -- main loop
    def ppo_train(self, kl_ctl: float):
        items = self.replay_buffer.items
        if not items and self.is_lpo:
            raise RuntimeError("LPO: this rank received no samples for the update (the experience maker deals "
                               "every rank whole groups in equal counts)")
        batch = update_batch(items, self.is_lpo or self.lpo.end_kl)
        self.pass_shapes = []
        engine = DeepSpeedEngine(self, items, batch, kl_ctl)
        status, self.last_update = run_update(batch, self.update, engine, divergence=self.divergence)
        self._ppo_calls += 1
        return status
