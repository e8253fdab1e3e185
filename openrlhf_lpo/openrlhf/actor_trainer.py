"""LPO actor trainer: group-level shuffle, whole-group optimizer windows, exact listwise gradient.

Public names (stable):
    LPOActorTrainer    subclass of openrlhf's ActorPPOTrainer (0.11.2); owns ``ppo_train`` for
                       ``--algo.advantage.estimator lpo``, stock behaviour for every other estimator
    LPOPolicyLoss      drop-in for ``PolicyLoss`` (same call signature, same 5-tuple) used by the
                       stock ``training_step``; reads the micro-batch's ``LPOMicroBatch`` context
    LPOMicroBatch      per-micro-batch context: targets, optional detached coefficients, normaliser
    plan_windows(gids, K, micro, gas, generator=None) -> list of windows of micro-batches of
                       replay-buffer indices (group-level shuffle, windows of whole groups)
    lpo_group_stats(s[G,K], w*[G,K]) -> dict of per-group KL / entropies (Figure 5 metrics)

Every other estimator runs the stock ``ppo_train``; with ``--lpo.end_kl`` a group estimator
(GRPO, Dr.GRPO, MaxRL, ...) also logs lpo/kl_start, lpo/kl_end, lpo/entropy_p_end and
lpo/entropy_target for the target w* of its paired temperature (metrics only, after the update).

Exactness (the listwise gradient sum_k c_k grad s_k needs every c_k from all K members at the
current parameters; s_t and w* are fixed for the rollout batch):

* each DP rank holds whole groups (LPOExperienceMaker's split) and every optimizer window
  (``gas`` micro-batches = train.batch_size/dp samples) is made of whole groups;
* parameters are constant inside a window (DeepSpeed steps at the accumulation boundary);
* one pass: when every micro-batch holds whole groups (micro_batch_size % K == 0) the loss
  sum_g D_g(w*, softmax(s_g)) is differentiated directly inside the stock training_step;
* two passes otherwise (or ``--lpo.force_two_pass``): a no-grad forward over the window's
  micro-batches gives s for every member, c = dD/ds per group in closed form, then each
  micro-batch back-propagates the detached surrogate sum_k c_k s_k;
* normalisation: every micro-batch loss is divided by the global number of groups in the
  window / gas and multiplied by dp (DeepSpeed divides by gas and averages over DP), so one
  optimizer step follows the gradient of the listwise loss averaged over the window's groups.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.nn as nn

from openrlhf.models.utils import masked_mean
from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer
from openrlhf.utils.loss_utils import iter_grad_accum_global_norm

from openrlhf_lpo import listwise
from openrlhf_lpo.metrics import distributed_listwise_stats, listwise_update_metrics
from openrlhf_lpo.openrlhf.experience_maker import LPO_INFO_KEYS
from openrlhf_lpo.openrlhf.vlm import mm_forward_kwargs

__all__ = ["LPOActorTrainer", "LPOPolicyLoss", "LPOMicroBatch", "plan_windows", "lpo_group_stats"]


# ----------------------------------------------------------------------------- loss


@dataclass
class LPOMicroBatch:
    """What the loss needs besides the stock arguments, for one micro-batch (B samples)."""

    target: torch.Tensor  # [B] w*_k, members of a group contiguous when coefficients is None
    groups_norm: float  # global groups in the optimizer window / gas
    group_size: int
    coefficients: Optional[torch.Tensor] = None  # [B] detached c_k (two-pass / pointwise)
    record: Dict[str, torch.Tensor] = field(default_factory=dict)  # s, c of this pass (detached)


class LPOPolicyLoss(nn.Module):
    """The LPO objective in ``PolicyLoss``'s calling convention (Eq. 4, 10, 11).

    ``forward(log_probs, old_log_probs, advantages, action_mask, rollout_log_probs, dp_size,
    batch_num_tokens, global_batch_size) -> (loss, clip_ratio, ppo_kl, None, None)``;
    ``advantages`` and the token/sample normalisers are ignored (LPO normalises by groups).
    """

    def __init__(self, divergence: str, projection: str, clip_eps_low: float, clip_eps_high: float):
        super().__init__()
        self.divergence = divergence
        self.projection = projection
        self.clip_eps = (clip_eps_low, clip_eps_high)
        self.context: Optional[LPOMicroBatch] = None

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
    ):
        ctx = self.context
        if ctx is None:
            raise RuntimeError("LPOPolicyLoss needs a micro-batch context (set by LPOActorTrainer.ppo_train)")
        # LPO math in float64 (B scalars): the listwise softmax is exact whatever the layout.
        s = listwise.sequence_log_ratio(log_probs.double(), old_log_probs.double(), action_mask, self.clip_eps)
        if ctx.coefficients is None:
            K = ctx.group_size
            s_g = s.view(-1, K)
            w_g = ctx.target.to(s.device).view(-1, K)
            total = listwise.listwise_loss(s_g, w_g, self.divergence, self.projection) * s_g.shape[0]
            coef = listwise.listwise_coefficients(s_g, w_g, self.divergence).reshape(-1)
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


# ----------------------------------------------------------------------------- planning


def plan_windows(
    gids: List[int], K: int, micro: int, gas: int, generator: Optional[torch.Generator] = None
) -> List[List[List[int]]]:
    """Windows (optimizer steps) of micro-batches of indices into ``gids``.

    Groups (equal gid) are kept whole and shuffled as units when ``generator`` is given; the
    flattened group sequence is cut into windows of micro*gas samples, each into gas
    micro-batches of ``micro`` samples.
    """
    groups: "OrderedDict[int, List[int]]" = OrderedDict()
    for i, g in enumerate(gids):
        groups.setdefault(int(g), []).append(i)
    bad = {g: len(m) for g, m in groups.items() if len(m) != K}
    if bad:
        raise ValueError(
            f"groups {sorted(bad)[:5]} have {sorted(set(bad.values()))} members on this rank, expected "
            f"--rollout.n_samples_per_prompt {K}: a group was split across ranks or truncated"
        )
    members = list(groups.values())
    if generator is not None:
        perm = torch.randperm(len(members), generator=generator).tolist()
        members = [members[p] for p in perm]
    order = [i for m in members for i in m]
    window = micro * gas
    if window % K or len(order) % window:
        raise ValueError(
            f"{len(order)} samples on this rank cannot form optimizer windows of whole groups: window = "
            f"--train.micro_batch_size {micro} x gas {gas} = {window} samples must be a multiple of K={K} "
            f"and divide the rank's samples (check --train.batch_size and --rollout.batch_size)"
        )
    return [
        [order[w + m : w + m + micro] for m in range(0, window, micro)] for w in range(0, len(order), window)
    ]


def lpo_group_stats(s: torch.Tensor, target: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Per-group [G] KL(w*||P), H(P), H(w*) for P = softmax(s) (float64)."""
    s = s.double()
    w = target.double()
    log_p = torch.log_softmax(s, dim=-1)
    p = log_p.exp()
    h_p = -(p * log_p).sum(-1)
    h_w = -torch.where(w > 0, w * torch.log(w), torch.zeros_like(w)).sum(-1)
    kl = listwise.listwise_divergence(s, w, "fwd")
    return {"kl": kl, "entropy_p": h_p, "entropy_target": h_w}


# ----------------------------------------------------------------------------- trainer


def _pop_lpo_info(info: dict) -> Dict[str, torch.Tensor]:
    out = {}
    for key in LPO_INFO_KEYS:
        value = info.pop(key, None)
        if value is None:
            continue
        out[key] = torch.stack([torch.as_tensor(v) for v in value]) if isinstance(value, list) else value
    return out


class LPOActorTrainer(ActorPPOTrainer):
    """ActorPPOTrainer whose ``ppo_train`` implements LPO (see module doc); stock otherwise."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.is_lpo = self.args.algo.advantage.estimator == "lpo"
        if self.is_lpo:
            lo, hi = self.args.actor.eps_clip_low_high
            self.actor_loss_fn = LPOPolicyLoss(self.args.lpo.divergence, self.args.lpo.projection, lo, hi)
        self.last_window_plan: List[List[List[int]]] = []  # for inspection/tests

    # -- helpers
    def _device(self) -> torch.device:
        return next(self.actor.parameters()).device

    def _dp_size(self) -> int:
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        return world // max(self.args.ds.ring_attn_size, 1) // max(self.args.ds.tensor_parallel_size, 1)

    @torch.no_grad()
    def _sequence_log_ratio(self, experience) -> torch.Tensor:
        log_probs = self.actor(
            experience.sequences,
            experience.action_mask,
            attention_mask=experience.attention_mask,
            ring_attn_group=self.strategy.ring_attn_group,
            **mm_forward_kwargs(self.actor, experience),  # VLM: the images (else s is wrong)
        )
        return listwise.sequence_log_ratio(
            log_probs.double(), experience.action_log_probs.double(), experience.action_mask,
            tuple(self.args.actor.eps_clip_low_high),
        )

    def _collate(self, items, indices):
        exp = self.replay_buffer.collate_fn([items[i] for i in indices])
        meta = _pop_lpo_info(exp.info)
        exp.to_device(self._device())
        return exp, meta

    def _end_log_ratios(self, items) -> torch.Tensor:
        """s of every replay-buffer item at the current parameters (no grad)."""
        s_end = torch.zeros(len(items), dtype=torch.float64)
        self.actor.train()
        micro = self.micro_train_batch_size
        for lo in range(0, len(items), micro):
            ids = list(range(lo, min(lo + micro, len(items))))
            exp, _ = self._collate(items, ids)
            s_end[torch.tensor(ids)] = self._sequence_log_ratio(exp).double().cpu()
        return s_end

    def _pg_ppo_train(self, kl_ctl: float):
        """Stock ppo_train; with --lpo.end_kl, the listwise KL of the paired target after it."""
        items = self.replay_buffer.items
        meta = [{k: it.info.pop(k) for k in LPO_INFO_KEYS if k in it.info} for it in items]
        status = super().ppo_train(kl_ctl)
        if not (items and self.args.lpo.end_kl and all("lpo_target" in m for m in meta)):
            return status
        gids = torch.tensor([int(m["lpo_gid"]) for m in meta])
        target = torch.tensor([float(m["lpo_target"]) for m in meta], dtype=torch.float64)
        prev = torch.tensor([float(m["lpo_prev_log_ratio"]) for m in meta], dtype=torch.float64)
        status.update(listwise_update_metrics(gids, prev, self._end_log_ratios(items), target,
                                              self.args.rollout.n_samples_per_prompt, device=self._device()))
        return status

    # -- main loop
    def ppo_train(self, kl_ctl: float):
        if not self.is_lpo:
            return self._pg_ppo_train(kl_ctl)

        args = self.args
        K = args.rollout.n_samples_per_prompt
        items = self.replay_buffer.items
        if not items:
            return {}
        gas = max(int(self.strategy.accumulated_gradient), 1)
        micro = self.micro_train_batch_size
        dp = self._dp_size()
        div, proj = self.actor_loss_fn.divergence, self.actor_loss_fn.projection
        two_pass = proj == "listwise" and (micro % K != 0 or args.lpo.force_two_pass)

        # per-sample constants of the rollout batch
        gids = [int(it.info["lpo_gid"]) for it in items]
        target = torch.tensor([float(it.info["lpo_target"]) for it in items], dtype=torch.float64)
        prev = torch.tensor([float(it.info["lpo_prev_log_ratio"]) for it in items], dtype=torch.float64)
        reward = torch.tensor([float(it.info["lpo_reward"]) for it in items], dtype=torch.float64)
        tau = torch.tensor([float(it.info["lpo_tau"]) for it in items], dtype=torch.float64)
        groups_per_window = micro * gas // K
        groups_norm = groups_per_window * dp / gas

        last_s = torch.zeros(len(items), dtype=torch.float64)
        sums: Dict[str, float] = {}
        weights: Dict[str, str] = {}
        last: Dict[str, float] = {}
        counts = {"_n_samples": 0.0, "_n_tokens": 0.0}
        abs_coef_sum, coef_count = 0.0, 0

        step = 0
        for epoch in range(self.max_epochs):
            plan = plan_windows(gids, K, micro, gas, generator=torch.Generator().manual_seed(
                int(args.train.seed) * 1000003 + self._ppo_calls * 1009 + epoch))
            self.last_window_plan = plan
            for window in plan:
                batches = [self._collate(items, mb) for mb in window]
                coefficients = [None] * len(window)
                if two_pass:
                    self.actor.train()
                    s_win = torch.cat([self._sequence_log_ratio(exp).double().cpu() for exp, _ in batches])
                    idx = torch.tensor([i for mb in window for i in mb])
                    # groups are contiguous in the window's flattened order
                    c = listwise.listwise_coefficients(s_win.view(-1, K), target[idx].view(-1, K), div).reshape(-1)
                    coefficients = list(c.split([len(mb) for mb in window]))
                elif proj == "pointwise":
                    coefficients = [-target[torch.tensor(mb)] for mb in window]
                normed = iter_grad_accum_global_norm(
                    iter([exp for exp, _ in batches]), self.strategy, gas, lambda e: e.action_mask
                )
                for (exp, _), (_, loss_info), mb, coef in zip(batches, normed, window, coefficients):
                    ctx = LPOMicroBatch(
                        target=target[torch.tensor(mb)],
                        groups_norm=groups_norm,
                        group_size=K,
                        coefficients=coef,
                    )
                    self.actor_loss_fn.context = ctx
                    status = self.training_step(exp, kl_ctl, step, loss_info)
                    self.actor_loss_fn.context = None
                    step += 1
                    last_s[torch.tensor(mb)] = ctx.record["s"].double().cpu()
                    abs_coef_sum += float(ctx.record["c"].abs().sum())
                    coef_count += len(mb)
                    self._accumulate(status, sums, weights, last, counts)

        status = self._reduce(sums, weights, last, counts)
        status.update(self._lpo_metrics(items, gids, target, prev, reward, tau, last_s, abs_coef_sum, coef_count, two_pass))
        self._ppo_calls += 1
        return status

    _ppo_calls = 0

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
        packed = dict(sums)
        packed.update(counts)
        reduced = self.strategy.all_reduce(packed, op="sum") if torch.distributed.is_initialized() else packed
        n_tok, n_smp = float(reduced["_n_tokens"]), float(reduced["_n_samples"])
        out = {}
        for k in sums:
            denom = n_tok if weights[k] == "token" else n_smp
            out[k] = float(reduced[k]) / max(denom, 1e-12)
        out.update(last)
        if "entropy_loss" in out:
            out["response_entropy"] = out["entropy_loss"]
        return out

    def _lpo_metrics(self, items, gids, target, prev, reward, tau, last_s, abs_coef_sum, coef_count, two_pass):
        K = self.args.rollout.n_samples_per_prompt
        order = sorted(range(len(gids)), key=lambda i: (gids[i], i))
        idx = torch.tensor(order)
        w = target[idx].view(-1, K)
        start = lpo_group_stats(prev[idx].view(-1, K), w)
        lastst = lpo_group_stats(last_s[idx].view(-1, K), w)
        r = reward[idx].view(-1, K)
        degenerate = listwise.degenerate_groups(r).double()
        t = tau[idx].view(-1, K)[:, 0]
        finite = torch.isfinite(t)
        sums = {
            "groups": float(w.shape[0]),
            "kl_start": float(start["kl"].sum()),
            "kl_last": float(lastst["kl"].sum()),
            "entropy_p_start": float(start["entropy_p"].sum()),
            "entropy_p_last": float(lastst["entropy_p"].sum()),
            "entropy_target": float(start["entropy_target"].sum()),
            "degenerate": float(degenerate.sum()),
            "tau_sum": float(t[finite].sum()),
            "tau_count": float(finite.sum()),
            "abs_coef_sum": abs_coef_sum,
            "coef_count": float(coef_count),
        }
        end = None
        if self.args.lpo.end_kl:
            end = distributed_listwise_stats(torch.tensor(gids), self._end_log_ratios(items), target, K,
                                             device=self._device())
        tau_max = float(t[finite].max()) if bool(finite.any()) else 0.0
        tau_neg_min = float(-t[finite].min()) if bool(finite.any()) else 0.0
        if torch.distributed.is_initialized():
            sums = self.strategy.all_reduce(sums, op="sum")
            ext = self.strategy.all_reduce({"tau_max": tau_max, "tau_neg_min": tau_neg_min}, op="max")
            tau_max, tau_neg_min = float(ext["tau_max"]), float(ext["tau_neg_min"])
        sums = {k: float(v) for k, v in sums.items()}
        G = max(sums["groups"], 1.0)
        out = {
            "lpo/kl_start": sums["kl_start"] / G,
            "lpo/kl_last": sums["kl_last"] / G,
            "lpo/entropy_p_start": sums["entropy_p_start"] / G,
            "lpo/entropy_p_last": sums["entropy_p_last"] / G,
            "lpo/entropy_target": sums["entropy_target"] / G,
            "lpo/degenerate_frac": sums["degenerate"] / G,
            "lpo/tau_mean": sums["tau_sum"] / max(sums["tau_count"], 1.0),
            "lpo/tau_max": tau_max,
            "lpo/tau_min": -tau_neg_min,
            "lpo/abs_coef_mean": sums["abs_coef_sum"] / max(sums["coef_count"], 1.0),
            "lpo/two_pass": float(two_pass),
            "lpo/groups": sums["groups"],
        }
        if end is not None:
            out["lpo/kl_end"] = end["kl"]
            out["lpo/entropy_p_end"] = end["entropy_p"]
        return out
