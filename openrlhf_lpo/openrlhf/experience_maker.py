"""LPO experience maker: groups dealt whole to the data-parallel ranks, group ids and Gibbs
targets per sample, the behaviour correction s_t.

Public names (stable):
    LPOExperienceMaker          subclass of openrlhf's RemoteExperienceMaker (0.11.2)
    LPO_INFO_KEYS               per-sample ``Experience.info`` keys it writes (all shape [B]):
        lpo_gid       int64   prompt-group id inside the rollout batch (K members each)
        lpo_reward    float   reward after OpenRLHF's length penalties (what w* is built from)
        lpo_target    float   w*_k = softmax(R/tau + s_t)_k of its group (Eq. 8)
        lpo_prev_log_ratio    s_t = delta_k, the start point against the behaviour policy
                              (offpolicy.py; 0 unless --algo.advantage.is_correction_level is on), plus
                              with --lpo.anchor old the group-centred l_old_k (listwise.sequence_anchor)
        lpo_tau       float   the group temperature (nan for groups with all-equal rewards)
    rank_experiences(experiences, dp) -> dp experiences, one per rank (each rank's run merged)

Behaviour per ``--algo.advantage.estimator``:
    lpo     rewards are clipped (--reward.clip_range) and, with a KL penalty in the reward
            (--algo.kl.init_coef > 0, no --algo.kl.use_loss), reduced by kl_coef * sum_t KL_t: the
            sequence reward OpenRLHF's per-token shaping sums to. The rollout batch's groups are dealt to the dp ranks in equal counts (a partial batch
            whose group count does not divide by dp drops the remainder, with a warning;
            layout.py), Karmarkar-Karp balanced by tokens under dynamic batching, contiguous
            otherwise; each rank's samples are cut into the same number of forward chunks of
            ``--rollout.micro_batch_size`` samples (or ``--rollout.max_tokens_per_gpu`` tokens),
            so OpenRLHF's ceil(E/dp) chunking gives every rank exactly its groups while the
            old-log-prob forward stays at the stock micro-batch size. Advantages and returns are
            set to the on-policy listwise signal w*_k - 1/K per token (logged only; the LPO actor
            trainer builds its loss from lpo_target).
    maxrl   A = (R - mean)/mean per group (all-zero groups 0), then OpenRLHF's per-token
            returns (reward shaping with the KL penalty, cumulative returns) like group_norm.
    other   the stock RemoteExperienceMaker code, untouched.
With ``--lpo.end_kl`` a group policy-gradient estimator (group_norm, dr_grpo, maxrl, rloo,
reinforce_baseline) also gets the LPO_INFO_KEYS (gid = index // K, w* with ``--lpo.temperature``)
after its own advantages, for the logged KL(w*||P) only; its advantages stay stock.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, fields
from typing import Dict, List

import torch

from openrlhf.models.utils import compute_reward
from openrlhf.trainer.ppo_utils.experience import Experience, remove_padding_in_sequences, split_experience_batch
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
from openrlhf.trainer.ppo_utils.length_penalty import apply_length_penalties
from openrlhf.utils.logging_utils import init_logger

from openrlhf_lpo import listwise
from openrlhf_lpo.core import layout
from openrlhf_lpo.core.config import LPOConfig, dp_size, listwise_metrics_enabled
from openrlhf_lpo.core.offpolicy import UNTRUNCATED, behaviour_log_ratio, behaviour_stats, correction_from_args
from openrlhf_lpo.openrlhf.replay import REPLAY_INFO_KEYS, fingerprint
from openrlhf_lpo.openrlhf.vlm import group_key

__all__ = ["LPOExperienceMaker", "LPO_INFO_KEYS", "rank_experiences"]

logger = init_logger(__name__)

LPO_INFO_KEYS = ("lpo_gid", "lpo_reward", "lpo_target", "lpo_prev_log_ratio", "lpo_tau") + REPLAY_INFO_KEYS


def _as_sample(item: Experience) -> Experience:
    """A split-off batch row back in the single-sample layout the rollout makes (batch dim 1): step
    tensors [1, T], episode tensors and info values [1]; it can be concatenated again."""
    for f in fields(Experience):
        value = getattr(item, f.name)
        if isinstance(value, torch.Tensor):
            setattr(item, f.name, value.unsqueeze(0))
    item.info = {k: (v.reshape(1) if isinstance(v, torch.Tensor) else v) for k, v in item.info.items()}
    return item


def _fingerprint_rows(rows, indices) -> float:
    """``replay.fingerprint`` of the dealt samples ``indices`` (``rows``: sample index -> (experience, row))."""
    return fingerprint((rows[i][0].sequences[rows[i][1]], rows[i][0].attention_mask[rows[i][1]]) for i in indices)


def rank_experiences(experiences: List[Experience], dp: int) -> List[Experience]:
    """Merge each rank's run of ``len/dp`` consecutive experiences into one (dynamic batching hands
    each rank one experience; stock ``balance_experiences`` would scatter the groups)."""
    if len(experiences) % dp:
        raise ValueError(f"{len(experiences)} experiences for {dp} ranks: the LPO layout gives each rank a run")
    per = len(experiences) // dp
    from openrlhf.trainer.ppo_utils.experience import make_experience_batch, split_experience_batch

    out = []
    for r in range(dp):
        items = [it for exp in experiences[r * per:(r + 1) * per] for it in split_experience_batch(exp)]
        out.append(make_experience_batch(items))
    return out


@dataclass
class ReplayDraw:
    """What :meth:`LPOExperienceMaker.replay_samples` hands :meth:`~LPOExperienceMaker.after_replay_forward`:
    the fresh groups as the rollout made them (what the buffer keeps), the replayed groups drawn and trimmed for
    the layout, and whether the rollout carried behaviour log-probs."""

    snapshot: List[List[Experience]]
    drawn: int
    trimmed: int
    fresh_has_behaviour: bool


class LPOExperienceMaker(RemoteExperienceMaker):
    """RemoteExperienceMaker with LPO (group-aligned split, w* per sample) and MaxRL."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.replay = None  # ReplayBuffer, set by the trainer with --lpo.replay_batches (replay.py)
        self.replay_step = 0  # the global step of the batch being made (set by the trainer)
        self.last_replay_stats: Dict[str, float] = {}  # of the last batch made (read by the trainer)

    # ------------------------------------------------------------------ split

    def _canonical_groups(self, rollout_samples) -> List[List[Experience]]:
        """The rollout's prompt groups (K consecutive samples sharing a prompt), in a canonical order."""
        K = self.args.rollout.n_samples_per_prompt
        n = len(rollout_samples)
        if n % K:
            raise ValueError(
                f"{n} rollout samples is not a multiple of --rollout.n_samples_per_prompt {K}; "
                "LPO needs every prompt's K responses"
            )
        groups = [list(rollout_samples[g * K:(g + 1) * K]) for g in range(n // K)]
        for g, members in enumerate(groups):
            if len({group_key(m) for m in members}) != 1:  # prompt text and images
                raise ValueError(
                    f"rollout samples {g * K}..{g * K + K - 1} do not share one prompt (text and images); LPO expects each "
                    "prompt's K responses to be consecutive (as OpenRLHF's SamplesGenerator returns them)"
                )
        # groups arrive in completion order (ray.wait): a canonical order makes the layout, and so the
        # update, independent of which prompt finished first (reproducible runs and resumes)
        groups.sort(key=lambda members: (str(group_key(members[0])), str(members[0].labels)))
        return groups

    def _ranked(self, groups: List[List[Experience]]) -> List[List[Experience]]:
        """The first groups that divide evenly over the data-parallel ranks (the rest dropped, warned)."""
        dp = dp_size(self.args)
        used, dropped = layout.ranked_groups(len(groups), dp)
        if used == 0:
            raise ValueError(f"{len(groups)} prompt groups cannot give each of the {dp} data-parallel ranks one")
        if dropped:
            logger.warning(
                f"LPO: partial rollout batch of {len(groups)} prompts for {dp} data-parallel ranks; training on "
                f"{used} and dropping the last {dropped} (groups stay whole and equal per rank)"
            )
        return groups[:used]

    def _deal(self, groups: List[List[Experience]]) -> List[Experience]:
        """Group ids in order, the groups dealt to the ranks in equal counts (token-balanced under dynamic
        batching), each rank's samples cut into the same number of forward chunks (layout.py)."""
        args = self.args
        K = args.rollout.n_samples_per_prompt
        samples = [m for members in groups for m in members]
        for i, sample in enumerate(samples):
            sample.index = [i]
            sample.info["lpo_gid"] = torch.tensor([i // K], dtype=torch.long)
        lengths = [int(s.total_length.reshape(-1)[0].item()) for s in samples]
        dynamic = bool(args.train.dynamic_batch_enable)
        n = len(groups)
        ranks = layout.assign_groups([sum(lengths[g * K:(g + 1) * K]) for g in range(n)], dp_size(args), balance=dynamic)
        per_rank = [[g * K + k for g in gs for k in range(K)] for gs in ranks]
        if dynamic:
            chunks = layout.forward_chunks(per_rank, lengths=lengths, budget=int(args.rollout.max_tokens_per_gpu))
        else:
            chunks = layout.forward_chunks(per_rank, micro=int(args.rollout.micro_batch_size))
        pad = self.tokenizer.pad_token_id
        return [Experience.concat_experiences([samples[i] for i in chunk], pad)
                for rank_chunks in chunks for chunk in rank_chunks]

    def split_rollout_samples(self, rollout_samples):
        if self.advantage_estimator != "lpo":
            return super().split_rollout_samples(rollout_samples)
        return self._deal(self._ranked(self._canonical_groups(rollout_samples)))

    # ------------------------------------------------------------------ listwise replay
    def make_experience_batch(self, rollout_samples) -> List[Experience]:
        if self.advantage_estimator != "lpo" or self.replay is None:
            return super().make_experience_batch(rollout_samples)
        samples_list, draw = self.replay_samples(rollout_samples)
        experiences = self.make_experience(samples_list)
        experiences = self.after_replay_forward(experiences, draw)
        return self.compute_advantages_and_returns(experiences)

    def replay_samples(self, rollout_samples):
        """Fresh groups plus ``round down(ratio x fresh groups)`` replayed ones (trimmed so that the total
        divides over the ranks), dealt like a rollout batch. Returns (forward chunks, the :class:`ReplayDraw` that
        :meth:`after_replay_forward` finishes)."""
        args = self.args
        dp = dp_size(args)
        fresh = self._ranked(self._canonical_groups(rollout_samples))
        want = int(math.floor(float(LPOConfig.from_args(args).replay_ratio) * len(fresh)))
        drawn = self.replay.draw(want, self.replay_step)
        keep = len(drawn) - (len(fresh) + len(drawn)) % dp
        n_drawn = len(drawn)
        drawn = drawn[:keep]
        behaviour = all(m.rollout_log_probs is not None for g in fresh for m in g)
        snapshot = copy.deepcopy(fresh)  # as the rollout made them: what the buffer keeps
        for g in fresh:
            for m in g:
                m.info["lpo_replayed"] = torch.zeros(1)
                m.info["lpo_replay_age"] = torch.zeros(1)
                if not behaviour:  # filled with pi_t's log-probs after the forward (the sampling policy in sync mode)
                    m.rollout_log_probs = torch.zeros(m.action_mask.shape, dtype=torch.float32)
        return self._deal(fresh + drawn), ReplayDraw(snapshot, n_drawn, n_drawn - keep, behaviour)

    @torch.no_grad()
    def after_replay_forward(self, experiences: List[Experience], draw: "ReplayDraw") -> List[Experience]:
        """After the old-log-prob forward: the fresh groups' behaviour log-probs go into the buffer (the
        engine's when the rollout has them, else the start-of-update actor's), each replayed group's s_t
        is measured against its own behaviour log-probs, groups with any |s_t| above
        ``--lpo.replay_max_abs_s`` are dropped (with more replayed groups if the ranks need equal counts),
        and the survivors are dealt again. Sets ``last_replay_stats``."""
        args = self.args
        K = args.rollout.n_samples_per_prompt
        snapshot = draw.snapshot
        n_fresh = len(snapshot)
        rows = {}  # sample index -> (experience, row)
        for exp in experiences:
            for r, i in enumerate(exp.index):
                rows[i] = (exp, r)
        if not draw.fresh_has_behaviour:
            for exp in experiences:
                fresh_rows = exp.info["lpo_replayed"].reshape(-1) == 0
                exp.rollout_log_probs[fresh_rows] = exp.action_log_probs[fresh_rows].to(exp.rollout_log_probs.dtype)
        for g, members in enumerate(snapshot):
            for k, m in enumerate(members):
                exp, r = rows[g * K + k]
                width = m.action_mask.shape[-1]
                m.rollout_log_probs = exp.rollout_log_probs[r:r + 1, :width].float().clone()
                m.info.pop("lpo_gid", None)
        self.replay.add(snapshot, self.replay_step)

        n_groups = len(rows) // K
        correction = correction_from_args(args) or UNTRUNCATED
        delta = torch.zeros(n_groups * K, dtype=torch.float64)
        age = torch.zeros(n_groups * K, dtype=torch.float64)
        for exp in experiences:
            d = behaviour_log_ratio(exp.action_log_probs, exp.rollout_log_probs, exp.action_mask, correction)
            idx = torch.tensor(exp.index)
            delta[idx] = d.to(delta.dtype)
            age[idx] = exp.info["lpo_replay_age"].reshape(-1).double()
        d_rep = delta.view(n_groups, K)[n_fresh:]
        limit = LPOConfig.from_args(args).replay_max_abs_s
        stale = (d_rep.abs().amax(-1) > limit) if limit else torch.zeros(d_rep.shape[0], dtype=torch.bool)
        keep = [g for g in range(n_fresh, n_groups) if not bool(stale[g - n_fresh])]
        extra = (n_fresh + len(keep)) % dp_size(args)
        trimmed = keep[len(keep) - extra:] if extra else []
        keep = keep[:len(keep) - extra]
        kept = torch.tensor(keep, dtype=torch.long) - n_fresh
        d_kept = d_rep[kept] if len(keep) else d_rep[:0]
        stats = {
            "lpo/replay_groups": float(len(keep)),
            "lpo/replay_drawn": float(draw.drawn),
            "lpo/replay_dropped_stale": float(stale.sum()),
            "lpo/replay_dropped_layout": float(draw.trimmed + len(trimmed)),
            "lpo/replay_buffer_groups": float(self.replay.num_groups),
            "lpo/replay_fresh_groups": float(n_fresh),
        }
        if d_rep.numel():
            stats["lpo/replay_abs_s_mean"] = float(d_rep.abs().mean())
            stats["lpo/replay_abs_s_max"] = float(d_rep.abs().max())
        if len(keep):
            b = behaviour_stats(d_kept)
            stats["lpo/replay_ess"] = b["ess_sum"] / b["groups"]
            stats["lpo/replay_age_mean"] = float(age.view(n_groups, K)[torch.tensor(keep), 0].mean())
        if len(keep) == n_groups - n_fresh:
            survivors = experiences
            stats["lpo/replay_fingerprint"] = _fingerprint_rows(rows, range(n_fresh * K, n_groups * K))
        else:  # deal the surviving groups again (fresh first, then the replayed ones in draw order)
            items = {}
            for exp in experiences:
                index = list(exp.index)
                for item, i in zip(remove_padding_in_sequences(split_experience_batch(copy.deepcopy(exp))), index):
                    items[i] = _as_sample(item)
            groups = [[items[g * K + k] for k in range(K)] for g in list(range(n_fresh)) + keep]
            stats["lpo/replay_fingerprint"] = fingerprint((m.sequences, m.attention_mask) for g in groups[n_fresh:]
                                                          for m in g)
            survivors = self._deal(groups)
        self.last_replay_stats = stats
        return survivors

    # ------------------------------------------------------------------ advantages
    @torch.no_grad()
    def compute_advantages_and_returns(self, experiences: List[Experience]) -> List[Experience]:
        est = self.advantage_estimator
        if est not in ("lpo", "maxrl"):
            experiences = super().compute_advantages_and_returns(experiences)
            if listwise_metrics_enabled(self.strategy.args):
                _attach_targets(experiences, self.strategy.args)
            return experiences
        args = self.strategy.args
        K = args.rollout.n_samples_per_prompt
        for exp in experiences:
            exp.rewards = exp.rewards.to(torch.promote_types(exp.rewards.dtype, torch.float32))
        apply_length_penalties(experiences, args)

        lengths = [len(exp.index) for exp in experiences]
        order = torch.tensor([i for exp in experiences for i in exp.index], dtype=torch.long)
        flat = torch.cat([exp.rewards for exp in experiences])
        if order.numel() % K or sorted(order.tolist()) != list(range(order.numel())):
            raise ValueError(
                f"experience indices must cover 0..N-1 with N a multiple of --rollout.n_samples_per_prompt {K}"
            )
        grouped = torch.empty_like(flat)
        grouped[order] = flat
        rewards = grouped.view(-1, K)  # [G, K], prompt-major like the rollout

        group_std = rewards.std(dim=1, keepdim=True).expand(-1, K).reshape(-1)[order].split(lengths)
        for exp, std in zip(experiences, group_std):
            exp.info["group_reward_std"] = std

        if est == "maxrl":
            adv = listwise.pg_advantages(rewards, "maxrl").to(flat.dtype).reshape(-1)[order].split(lengths)
            for exp, a in zip(experiences, adv):
                shaped = compute_reward(
                    a, self.kl_ctl.value, exp.kl, action_mask=exp.action_mask, reward_clip_range=args.reward.clip_range
                )
                exp.returns = self.get_cumulative_returns(shaped, exp.action_mask, 1.0)
                exp.advantages = exp.returns.clone()
                exp.info["return"] = shaped.sum(dim=-1)
                exp.kl = None
            if listwise_metrics_enabled(args):
                _attach_targets(experiences, args)
            return experiences

        # ---- lpo: the Gibbs target of every group (Theorem 1, Eq. 8) from the sequence reward that
        # OpenRLHF's per-token shaping sums to: clip(R) - kl_coef * sum_t KL_t (KL in the reward,
        # --algo.kl.init_coef > 0 without --algo.kl.use_loss; with use_loss exp.kl is zero here).
        beta = max(float(self.kl_ctl.value), 0.0)
        for exp in experiences:
            r = exp.rewards.double()  # targets are float64 from here on
            if args.reward.clip_range:
                r = r.clamp(min=args.reward.clip_range[0], max=args.reward.clip_range[1])
            if beta > 0 and exp.kl is not None:
                penalty = (exp.kl.to(r.dtype) * exp.action_mask.to(r.dtype)).sum(-1)
                exp.info["lpo_kl_penalty"] = beta * penalty
                r = r - beta * penalty
            exp.rewards = r
        _attach_targets(experiences, args)
        for exp in experiences:
            signal = (exp.info["lpo_target"] - 1.0 / K).to(torch.float32)
            exp.advantages = signal.unsqueeze(1) * exp.action_mask.float()
            exp.returns = exp.advantages.clone()
            exp.info["return"] = exp.info["lpo_reward"].clone()
            exp.kl = None
        return experiences


def _old_anchor(experiences: List[Experience], order: torch.Tensor, shape, score: str) -> torch.Tensor:
    """--lpo.anchor old: l_old [G,K] of every sample (log pi_old of its response, aggregated as ``score``
    aggregates, listwise.sequence_anchor), less its group's largest (listwise.group_anchor)."""
    flat = torch.cat([listwise.sequence_anchor(exp.action_log_probs.double(), exp.action_mask, score)
                      for exp in experiences])
    anchor = torch.empty(shape, dtype=torch.float64)
    anchor.view(-1)[order] = flat.cpu().double()
    return listwise.group_anchor(anchor)


@torch.no_grad()
def _attach_targets(experiences: List[Experience], args) -> None:
    """Write LPO_INFO_KEYS into every experience: w* = softmax(R/tau + s_t) of its group (Eq. 8)
    from ``exp.rewards`` (after length penalties) and ``--lpo.temperature``; s_t = delta, the
    behaviour correction (offpolicy.py) for lpo, 0 for the metrics of PG estimators; with ``--lpo.anchor old``
    s_t also holds l_old (Target Policy Optimization's p_old = softmax(l_old), q = softmax(l_old + u/eta))."""
    K = args.rollout.n_samples_per_prompt
    lengths = [len(exp.index) for exp in experiences]
    order = torch.tensor([i for exp in experiences for i in exp.index], dtype=torch.long)
    if order.numel() % K or sorted(order.tolist()) != list(range(order.numel())):
        raise ValueError(
            f"experience indices must cover 0..N-1 with N a multiple of --rollout.n_samples_per_prompt {K}"
        )
    flat = torch.cat([exp.rewards.reshape(-1) for exp in experiences]).double()  # float64 targets
    rewards = torch.empty_like(flat)
    rewards[order] = flat
    rewards = rewards.view(-1, K)  # [G, K], prompt-major like the rollout
    tokens = torch.empty_like(flat)
    tokens[order] = torch.cat([exp.action_mask.reshape(len(exp.index), -1).sum(-1) for exp in experiences]).to(flat.dtype)
    lpo = args.algo.advantage.estimator == "lpo"
    settings = LPOConfig.from_args(args)
    # the response token counts: batch_std whitens token-weighted, as OpenRLHF's reinforce_baseline does
    tau = listwise.group_temperature(rewards, settings.temperature, weights=tokens.view(-1, K))
    if lpo:  # --lpo.temperature_scale: tau x scale for any temperature mode
        tau = tau * float(settings.temperature_scale)
    prev = torch.zeros_like(rewards)
    correction = correction_from_args(args) if lpo else None
    replayed = torch.cat([exp.info["lpo_replayed"].reshape(-1) > 0 if "lpo_replayed" in exp.info else
                          torch.zeros(len(exp.index), dtype=torch.bool) for exp in experiences])
    if correction is not None or bool(replayed.any()):
        # s_t = delta against each sample's behaviour log-probs: the configured correction, and for replayed
        # groups without one the untruncated log-ratio (replay.py)
        delta = torch.cat([behaviour_log_ratio(exp.action_log_probs, exp.rollout_log_probs, exp.action_mask,
                                               correction) for exp in experiences]) if correction is not None \
            else torch.zeros(replayed.numel(), dtype=torch.float64)
        if correction is None:
            rep = torch.cat([behaviour_log_ratio(exp.action_log_probs, exp.rollout_log_probs, exp.action_mask,
                                                 UNTRUNCATED) for exp in experiences])
            delta = torch.where(replayed, rep, delta)
        prev.view(-1)[order] = delta.to(prev.dtype)
    if lpo and settings.anchor == "old":
        prev = prev + _old_anchor(experiences, order, rewards.shape, settings.score)
    target = listwise.gibbs_target(rewards, tau, prev_log_ratio=prev)
    degenerate = listwise.degenerate_groups(rewards)
    tau_logged = torch.where(degenerate.unsqueeze(1), torch.full_like(tau, float("nan")), tau)

    def per_sample(x):
        return x.expand(-1, K).reshape(-1)[order].split(lengths)

    for exp, r, w, s_t, t in zip(
        experiences, per_sample(rewards), per_sample(target), per_sample(prev), per_sample(tau_logged)
    ):
        exp.info["lpo_gid"] = torch.tensor([i // K for i in exp.index], dtype=torch.long)
        exp.info["lpo_reward"] = r.float()
        exp.info["lpo_target"] = w  # float64: exact targets, cast on use
        exp.info["lpo_prev_log_ratio"] = s_t
        exp.info["lpo_tau"] = t.float()
