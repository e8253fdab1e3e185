"""Listwise metrics of a rollout batch spread over data-parallel ranks.

Public names (stable):
    distributed_listwise_stats(gids, s, target, group_size, all_reduce)
        -> {"kl", "entropy_p", "entropy_target", "groups"}: means over the global batch's groups of
        KL(w*||P) (Eq. 10), H(P) and H(w*), P = softmax(s). Each rank passes its own samples
        (global group ids ``gids``); a group's members may sit on different ranks (a policy-gradient
        estimator's batch). ``all_reduce(values, op)`` reduces over the data-parallel ranks (every rank calls it).
    listwise_update_metrics(gids, s_start, s_end, target, group_size, all_reduce)
        -> the logged ``lpo/kl_start``, ``lpo/kl_end``, ``lpo/entropy_p_start``, ``lpo/entropy_p_end``,
        ``lpo/entropy_target``, ``lpo/groups`` of an update that moved s from ``s_start`` to ``s_end``.

    lpo_group_stats(s[G,K], w*[G,K]) -> per-group KL(w*||P), H(P), H(w*) (float64)
    update_metrics(...) -> the ``lpo/*`` metrics of one LPO update, the same on both backends (the
        backends hand in their data-parallel sums and maxima)

Used by the DeepSpeed actor trainer and the Megatron actor.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Mapping, Optional, Sequence

import torch

from openrlhf_lpo import listwise
from openrlhf_lpo.core.offpolicy import behaviour_stats
from openrlhf_lpo.listwise import listwise_group_sums, listwise_stats_from_sums

__all__ = ["distributed_listwise_stats", "listwise_update_metrics", "lpo_group_stats", "update_metrics"]

Reduce = Callable[[List[float]], List[float]]


def distributed_listwise_stats(gids: torch.Tensor, s: torch.Tensor, target: torch.Tensor, group_size: int,
                               all_reduce: Callable[[List[float], str], List[float]]) -> Dict[str, float]:
    gids = torch.as_tensor(gids, dtype=torch.long)
    n = int(all_reduce([float(int(gids.max()) + 1 if gids.numel() else 0)], "max")[0])
    sums = listwise_group_sums(gids, s.double().cpu(), target.double().cpu(), n)
    total = torch.tensor(all_reduce(sums.reshape(-1).tolist(), "sum"), dtype=torch.float64).view(5, n)
    return listwise_stats_from_sums(total, group_size)


def listwise_update_metrics(gids: torch.Tensor, s_start: torch.Tensor, s_end: torch.Tensor, target: torch.Tensor,
                            group_size: int, all_reduce: Callable[[List[float], str], List[float]]) -> Dict[str, float]:
    start = distributed_listwise_stats(gids, s_start, target, group_size, all_reduce)
    end = distributed_listwise_stats(gids, s_end, target, group_size, all_reduce)
    return {"lpo/kl_start": start["kl"], "lpo/kl_end": end["kl"], "lpo/entropy_p_start": start["entropy_p"],
            "lpo/entropy_p_end": end["entropy_p"], "lpo/entropy_target": start["entropy_target"],
            "lpo/groups": start["groups"]}


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


def update_metrics(gids: Sequence[int], target: torch.Tensor, prev: torch.Tensor, reward: torch.Tensor,
                   tau: torch.Tensor, last_s: torch.Tensor, abs_coef_sum: float, coef_count: int,
                   modes: Mapping[str, int], group_size: int, divergence: str, all_reduce_sum: Reduce,
                   all_reduce_max: Reduce, correction: bool = False,
                   s_end: Optional[torch.Tensor] = None) -> Dict[str, float]:
    """The ``lpo/*`` metrics of one update over the rank's whole groups (float64, per sample [N]):
    KL(w*||P) (Eq. 10) and H(P) at s_t (``prev``) and at each sample's last training pass (``last_s``),
    H(w*), the trained divergence at both (and at ``s_end`` when given), the degenerate-group fraction,
    tau's mean / min / max, the mean |c|, the window counts by mode and, with ``correction``, the
    behaviour policy's distance (offpolicy.behaviour_stats). ``s_end`` (``--lpo.end_kl``): s after the update,
    for KL(w*||P), H(P) and the trained divergence at the end. Every rank calls it (two sums, one maximum)."""
    K = group_size
    order = torch.tensor(sorted(range(len(gids)), key=lambda i: (int(gids[i]), i)), dtype=torch.long)
    w = target.double()[order].view(-1, K)
    s0, s1 = prev.double()[order].view(-1, K), last_s.double()[order].view(-1, K)
    start, last = lpo_group_stats(s0, w), lpo_group_stats(s1, w)
    degenerate = listwise.degenerate_groups(reward.double()[order].view(-1, K)).double()
    t = tau.double()[order].view(-1, K)[:, 0]
    finite = torch.isfinite(t)
    behaviour = behaviour_stats(s0)
    named = {
        "groups": float(w.shape[0]), "kl_start": float(start["kl"].sum()), "kl_last": float(last["kl"].sum()),
        "entropy_p_start": float(start["entropy_p"].sum()), "entropy_p_last": float(last["entropy_p"].sum()),
        "entropy_target": float(start["entropy_target"].sum()), "degenerate": float(degenerate.sum()),
        "tau_sum": float(t[finite].sum()), "tau_count": float(finite.sum()), "abs_coef_sum": float(abs_coef_sum),
        "coef_count": float(coef_count), "behaviour_abs": behaviour["abs_mean_sum"],
        "behaviour_ess": behaviour["ess_sum"],
        # the divergence being trained (any registered name or alpha:<a>)
        "div_start": float(listwise.listwise_divergence(s0, w, divergence).sum()),
        "div_last": float(listwise.listwise_divergence(s1, w, divergence).sum()),
    }
    if s_end is not None:
        s2 = s_end.double()[order].view(-1, K)
        end = lpo_group_stats(s2, w)
        named["div_end"] = float(listwise.listwise_divergence(s2, w, divergence).sum())
        named["kl_end"] = float(end["kl"].sum())
        named["entropy_p_end"] = float(end["entropy_p"].sum())
    sums = dict(zip(named, all_reduce_sum(list(named.values()))))
    any_finite = bool(finite.any())
    ext = all_reduce_max([float(t[finite].max()) if any_finite else -math.inf,
                          float(-t[finite].min()) if any_finite else -math.inf, behaviour["abs_max"]])
    G = max(sums["groups"], 1.0)
    out = {
        "lpo/kl_start": sums["kl_start"] / G,
        "lpo/kl_last": sums["kl_last"] / G,
        "lpo/entropy_p_start": sums["entropy_p_start"] / G,
        "lpo/entropy_p_last": sums["entropy_p_last"] / G,
        "lpo/entropy_target": sums["entropy_target"] / G,
        "lpo/degenerate_frac": sums["degenerate"] / G,
        "lpo/tau_mean": sums["tau_sum"] / max(sums["tau_count"], 1.0),
        "lpo/tau_max": ext[0] if math.isfinite(ext[0]) else 0.0,
        "lpo/tau_min": -ext[1] if math.isfinite(ext[1]) else 0.0,
        "lpo/abs_coef_mean": sums["abs_coef_sum"] / max(sums["coef_count"], 1.0),
        "lpo/two_pass": float(modes.get("pre_pass", 0) > 0),
        "lpo/groups": sums["groups"],
        "lpo/divergence_start": sums["div_start"] / G,
        "lpo/divergence_last": sums["div_last"] / G,
    }
    out.update({f"lpo/{mode}_windows": float(n) for mode, n in modes.items()})
    if "div_end" in sums:
        out["lpo/divergence_end"] = sums["div_end"] / G
        out["lpo/kl_end"] = sums["kl_end"] / G
        out["lpo/entropy_p_end"] = sums["entropy_p_end"] / G
    if correction:
        out["lpo/behaviour_abs_mean"] = sums["behaviour_abs"] / G
        out["lpo/behaviour_abs_max"] = ext[2]
        out["lpo/behaviour_ess"] = sums["behaviour_ess"] / G
    return out
