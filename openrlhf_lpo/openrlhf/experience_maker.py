"""LPO experience maker: group-aligned DP split, group ids and Gibbs targets per sample.

Public names (stable):
    LPOExperienceMaker          subclass of openrlhf's RemoteExperienceMaker (0.11.2)
    LPO_INFO_KEYS               per-sample ``Experience.info`` keys it writes (all shape [B]):
        lpo_gid       int64   prompt-group id inside the rollout batch (K members each)
        lpo_reward    float   reward after OpenRLHF's length penalties (what w* is built from)
        lpo_target    float   w*_k = softmax(R/tau + s_t)_k of its group (Eq. 8)
        lpo_prev_log_ratio    s_t: the target's log-ratio at the pre-update policy; 0 here,
                              because old log-probs are computed by the actor that generated
                              the rollout batch's update (on-policy start of the update)
        lpo_tau       float   the group temperature (nan for groups with all-equal rewards)
    group_dp_layout(n_groups, dp, groups_per_chunk) -> list of group-index lists

Behaviour per ``--algo.advantage.estimator``:
    lpo     rollout samples are split into experiences that hold whole groups, E a multiple of
            dp with E/dp experiences per rank, so OpenRLHF's contiguous ceil(E/dp) chunking
            (launcher.async_run_method_batch) puts every group on exactly one rank. Advantages
            and returns are set to the on-policy listwise signal w*_k - 1/K per token (logged
            only; the LPO actor trainer builds its loss from lpo_target).
    maxrl   A = (R - mean)/mean per group (all-zero groups 0), then OpenRLHF's per-token
            returns (reward shaping with the KL penalty, cumulative returns) like group_norm.
    other   the stock RemoteExperienceMaker code, untouched.
With ``--lpo.end_kl`` a group policy-gradient estimator (group_norm, dr_grpo, maxrl, rloo,
reinforce_baseline) also gets the LPO_INFO_KEYS (gid = index // K, w* with ``--lpo.temperature``)
after its own advantages, for the logged KL(w*||P) only; its advantages stay stock.
"""

from __future__ import annotations

import math
from typing import List

import torch

from openrlhf.models.utils import compute_reward
from openrlhf.trainer.ppo_utils.experience import Experience
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
from openrlhf.trainer.ppo_utils.length_penalty import apply_length_penalties

from openrlhf_lpo import listwise
from openrlhf_lpo.openrlhf.vlm import group_key

__all__ = ["LPOExperienceMaker", "LPO_INFO_KEYS", "group_dp_layout"]

LPO_INFO_KEYS = ("lpo_gid", "lpo_reward", "lpo_target", "lpo_prev_log_ratio", "lpo_tau")


def _effective_dp(args) -> int:
    return (
        args.actor.num_nodes
        * args.actor.num_gpus_per_node
        // max(args.ds.ring_attn_size, 1)
        // max(args.ds.tensor_parallel_size, 1)
    )


def group_dp_layout(n_groups: int, dp: int, groups_per_chunk: int) -> List[List[int]]:
    """Group indices of each experience so that rank r receives groups [r*G/dp, (r+1)*G/dp).

    Returns dp * ceil((G/dp)/groups_per_chunk) chunks; OpenRLHF hands rank r the r-th run of
    len/dp consecutive chunks, which are exactly its groups.
    """
    if n_groups % dp:
        raise ValueError(
            f"{n_groups} prompt groups cannot be split evenly over {dp} data-parallel ranks; "
            "make --rollout.batch_size a multiple of the actor DP size (and do not let dynamic "
            "filtering change the number of groups)"
        )
    per_rank = n_groups // dp
    if per_rank == 0:
        raise ValueError(f"{n_groups} prompt groups for {dp} data-parallel ranks: every rank needs one")
    groups_per_chunk = max(1, min(groups_per_chunk, per_rank))
    chunks_per_rank = math.ceil(per_rank / groups_per_chunk)
    layout = []
    for r in range(dp):
        first = r * per_rank
        for c in range(chunks_per_rank):
            lo = first + c * groups_per_chunk
            hi = min(first + (c + 1) * groups_per_chunk, first + per_rank)
            layout.append(list(range(lo, hi)))
    return layout


class LPOExperienceMaker(RemoteExperienceMaker):
    """RemoteExperienceMaker with LPO (group-aligned split, w* per sample) and MaxRL."""

    # ------------------------------------------------------------------ split
    def split_rollout_samples(self, rollout_samples):
        if self.advantage_estimator != "lpo":
            return super().split_rollout_samples(rollout_samples)
        K = self.args.rollout.n_samples_per_prompt
        n = len(rollout_samples)
        if n % K:
            raise ValueError(
                f"{n} rollout samples is not a multiple of --rollout.n_samples_per_prompt {K}; "
                "LPO needs every prompt's K responses"
            )
        n_groups = n // K
        for i, sample in enumerate(rollout_samples):
            sample.index = [i]
            sample.info["lpo_gid"] = torch.tensor([i // K], dtype=torch.long)
        for g in range(n_groups):
            prompts = {group_key(rollout_samples[g * K + k]) for k in range(K)}  # text and images
            if len(prompts) != 1:
                raise ValueError(
                    f"rollout samples {g * K}..{g * K + K - 1} do not share one prompt (text and images); LPO expects each "
                    "prompt's K responses to be consecutive (as OpenRLHF's SamplesGenerator returns them)"
                )
        groups_per_chunk = max(1, self.args.rollout.micro_batch_size // K)
        layout = group_dp_layout(n_groups, _effective_dp(self.args), groups_per_chunk)
        pad = self.tokenizer.pad_token_id
        return [
            Experience.concat_experiences([rollout_samples[g * K + k] for g in chunk for k in range(K)], pad)
            for chunk in layout
        ]

    # ------------------------------------------------------------------ advantages
    @torch.no_grad()
    def compute_advantages_and_returns(self, experiences: List[Experience]) -> List[Experience]:
        est = self.advantage_estimator
        if est not in ("lpo", "maxrl"):
            experiences = super().compute_advantages_and_returns(experiences)
            if _listwise_metrics(self.strategy.args):
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
            if _listwise_metrics(args):
                _attach_targets(experiences, args)
            return experiences

        # ---- lpo: the Gibbs target of every group (Theorem 1, Eq. 8)
        _attach_targets(experiences, args)
        for exp in experiences:
            signal = (exp.info["lpo_target"] - 1.0 / K).to(torch.float32)
            exp.advantages = signal.unsqueeze(1) * exp.action_mask.float()
            exp.returns = exp.advantages.clone()
            exp.info["return"] = exp.info["lpo_reward"].clone()
            exp.kl = None
        return experiences


def _listwise_metrics(args) -> bool:
    from openrlhf_lpo.cli.flags import listwise_metrics_enabled

    return listwise_metrics_enabled(args)


@torch.no_grad()
def _attach_targets(experiences: List[Experience], args) -> None:
    """Write LPO_INFO_KEYS into every experience: w* = softmax(R/tau + s_t) of its group (Eq. 8)
    from ``exp.rewards`` (after length penalties) and ``--lpo.temperature``; s_t = 0."""
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
    tau = listwise.group_temperature(rewards, args.lpo.temperature)
    prev = torch.zeros_like(rewards)
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
