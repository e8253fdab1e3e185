"""The one metric set of a policy update: the same keys with one meaning for every method on both backends.

The actor's ``fit`` / ``ppo_train`` returns these (OpenRLHF logs them as ``train/<key>``); docs/metrics.md lists
each key with its formula. Token quantities are means over every response token of the update's training
passes (all windows, all epochs, all data-parallel ranks); experience quantities are means over the rollout
batch's samples; step quantities are per optimizer step.

    policy_loss       mean over the update's optimizer steps of the window's objective: LPO the mean over the
                      window's groups of the projection's loss at the training pass (D(w*, softmax(s)), or
                      -sum w* s for the pointwise projection); a policy-gradient estimator its loss as its
                      aggregation normalises it (token-mean: per token; seq-mean-token-mean, GSPO: per response)
    actor_grad_norm   mean over the update's optimizer steps of the global gradient norm before clipping
    actor_lr          the learning rate after the update's last step
    optimizer_steps   optimizer steps of the update
    response_entropy  token mean of the policy's entropy H(pi_theta(.|context)) at the training pass
    clip_ratio        token fraction whose log pi_theta - log pi_old lies outside [log(1-eps_low), log(1+eps_high)]
                      (--actor.eps_clip_low_high), at the training pass
    ppo_kl            token mean of log pi_old - log pi_theta at the training pass
    kl                with --algo.kl.use_loss (and --algo.kl.init_coef > 0): token mean of the KL estimator of the
                      loss; else the sample mean of each response's token-mean KL to the reference (0 without a
                      reference model). OpenRLHF's KL controller reads this key.
    reward, return, response_length, total_length, truncated, group_reward_std, logprobs_diff
                      sample means over the rollout batch (return: the shaped sequence reward the estimator used);
                      also every other per-sample value of the experiences' info (the reward function's
                      extra_logs, e.g. reward/error_frac; score), the same keys for every method of a task
    vllm_kl, is_filter_ratio   with --algo.advantage.is_correction_level: token mean of log mu - log pi_old, and the
                      token fraction whose train/rollout ratio pi_old/mu lies outside --algo.advantage.is_correction_threshold
    lpo/*             LPO: core/listwise_metrics.update_metrics; a policy-gradient estimator with --lpo.end_kl: the
                      listwise geometry of its paired target (PAIRED_LISTWISE_KEYS)

Public names (stable):
    STEP_SUMS, EXPERIENCE_KEYS, TRAIN_KEYS, CORRECTION_KEYS, LISTWISE_KEYS, PAIRED_LISTWISE_KEYS
    experience_info(experiences) -> per-sample tensors of EXPERIENCE_KEYS
    update_status(...) -> the status of one update (core/update.run_update calls it)
    paired_listwise_metrics(batch, prev, s_end, K, reduce) -> lpo/* of a policy-gradient estimator
    expected_keys(listwise, end_kl, correction) -> the keys an update logs (the metric contract)
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Set

import torch

__all__ = ["STEP_SUMS", "EXPERIENCE_KEYS", "TRAIN_KEYS", "CORRECTION_KEYS", "LISTWISE_KEYS", "PAIRED_LISTWISE_KEYS",
           "experience_info", "update_status", "paired_listwise_metrics", "expected_keys"]

Reduction = Callable[[List[float], str], List[float]]

# what a backend's step returns, summed over its micro-batches (rank-local)
STEP_SUMS = ("tokens", "entropy_sum", "out_of_band", "ppo_kl_sum", "kl_loss_sum", "vllm_kl_sum", "filtered",
             "loss_sum", "loss_count")
# per-sample values of the rollout batch (Experience.info, or an episode field of Experience)
EXPERIENCE_KEYS = ("reward", "return", "response_length", "total_length", "truncated", "group_reward_std",
                   "logprobs_diff", "kl")
TRAIN_KEYS = ("policy_loss", "actor_grad_norm", "actor_lr", "optimizer_steps", "response_entropy", "clip_ratio",
              "ppo_kl") + EXPERIENCE_KEYS
CORRECTION_KEYS = ("vllm_kl", "is_filter_ratio")
LISTWISE_KEYS = ("lpo/kl_start", "lpo/kl_last", "lpo/entropy_p_start", "lpo/entropy_p_last", "lpo/entropy_target",
                 "lpo/degenerate_frac", "lpo/tau_mean", "lpo/tau_max", "lpo/tau_min", "lpo/abs_coef_mean",
                 "lpo/two_pass", "lpo/groups", "lpo/divergence_start", "lpo/divergence_last",
                 "lpo/one_pass_windows", "lpo/shortcut_windows", "lpo/pre_pass_windows", "lpo/pointwise_windows")
LISTWISE_END_KEYS = ("lpo/kl_end", "lpo/entropy_p_end", "lpo/divergence_end")
BEHAVIOUR_KEYS = ("lpo/behaviour_abs_mean", "lpo/behaviour_abs_max", "lpo/behaviour_ess")
PAIRED_LISTWISE_KEYS = ("lpo/kl_start", "lpo/kl_end", "lpo/entropy_p_start", "lpo/entropy_p_end",
                        "lpo/entropy_target", "lpo/groups")
_EPISODE_FIELDS = ("response_length", "total_length", "truncated")


def experience_info(experiences: Iterable) -> Dict[str, torch.Tensor]:
    """Per-sample float64 values from OpenRLHF ``Experience`` objects (batched or single-sample), in their order: the
    episode fields of EXPERIENCE_KEYS and every numeric per-sample ``info`` entry (the reward function's
    ``extra_logs`` included) except the listwise fields (``lpo_*``); a key that some experience lacks is left out."""
    parts: Dict[str, List[torch.Tensor]] = {}
    n = 0
    for exp in experiences:
        mask = exp.action_mask
        b = 1 if mask.dim() == 1 else int(mask.shape[0])  # a replay-buffer item has no batch dimension
        n += 1
        values = {k: getattr(exp, k, None) for k in _EPISODE_FIELDS}
        values.update({k: v for k, v in (exp.info or {}).items() if not k.startswith("lpo_")})
        for k, v in values.items():
            if v is None or isinstance(v, (str, bytes)):
                continue
            try:
                v = torch.as_tensor(v).detach().reshape(-1).to("cpu", torch.float64)
            except (TypeError, ValueError, RuntimeError):
                continue
            if v.numel() == b:
                parts.setdefault(k, []).append(v)
    return {k: torch.cat(v) for k, v in parts.items() if len(v) == n}


def update_status(sums: Dict[str, float], window_loss: List[float], window_count: List[float],
                  grad_norms: List[float], lr: float, info: Dict[str, torch.Tensor], settings,
                  reduce: Reduction) -> Dict[str, float]:
    """The non-``lpo/*`` keys of one update from the rank's sums (module doc); one all-reduce."""
    keys = list(STEP_SUMS)
    info_keys = sorted(info)
    local = [float(sums.get(k, 0.0)) for k in keys] + [float(v) for v in window_loss] + \
        [float(v) for v in window_count] + [float(info[k].sum()) for k in info_keys] + \
        [float(len(next(iter(info.values())))) if info else 0.0]
    total = reduce(local, "sum")
    g = dict(zip(keys, total[:len(keys)]))
    n_w = len(window_loss)
    losses = total[len(keys):len(keys) + n_w]
    counts = total[len(keys) + n_w:len(keys) + 2 * n_w]
    info_sums = dict(zip(info_keys, total[len(keys) + 2 * n_w:-1]))
    n_samples = max(total[-1], 1.0)
    tokens = max(g["tokens"], 1.0)
    means = [loss / count for loss, count in zip(losses, counts) if count > 0]
    status = {
        "policy_loss": sum(means) / len(means) if means else 0.0,
        "actor_grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else 0.0,
        "actor_lr": float(lr),
        "optimizer_steps": float(len(grad_norms)),
        "response_entropy": g["entropy_sum"] / tokens,
        "clip_ratio": g["out_of_band"] / tokens,
        "ppo_kl": g["ppo_kl_sum"] / tokens,
    }
    status.update({k: v / n_samples for k, v in info_sums.items()})
    if settings.kl_loss:
        status["kl"] = g["kl_loss_sum"] / tokens
    status.setdefault("kl", 0.0)
    if settings.correction:
        status["vllm_kl"] = g["vllm_kl_sum"] / tokens
        status["is_filter_ratio"] = g["filtered"] / tokens
    return status


def paired_listwise_metrics(batch, prev: torch.Tensor, s_end: torch.Tensor, group_size: int,
                            reduce: Reduction) -> Dict[str, float]:
    """PAIRED_LISTWISE_KEYS of a policy-gradient update (``--lpo.end_kl``): KL(w*||P) and H(P) of its paired target
    at the start (s_t) and the end of the update, H(w*) and the groups (a group may straddle ranks)."""
    from openrlhf_lpo.core.listwise_metrics import listwise_update_metrics

    return listwise_update_metrics(torch.tensor(batch.gids, dtype=torch.long), prev, s_end, batch.target,
                                   group_size, reduce)


def expected_keys(listwise: bool, end_kl: bool, correction: bool, estimator_has_targets: bool = True) -> Set[str]:
    """The keys one update logs (the metric contract): TRAIN_KEYS, CORRECTION_KEYS with the correction, and the
    ``lpo/*`` keys of LPO (with the end-of-update ones under ``--lpo.end_kl`` and the behaviour ones under the
    correction) or of a policy-gradient estimator's paired target under ``--lpo.end_kl``."""
    keys = set(TRAIN_KEYS)
    if correction:
        keys |= set(CORRECTION_KEYS)
    if listwise:
        keys |= set(LISTWISE_KEYS)
        if end_kl:
            keys |= set(LISTWISE_END_KEYS)
        if correction:
            keys |= set(BEHAVIOUR_KEYS)
    elif end_kl and estimator_has_targets:
        keys |= set(PAIRED_LISTWISE_KEYS)
    return keys
