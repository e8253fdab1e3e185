"""Listwise metrics of a rollout batch spread over data-parallel ranks.

Public names (stable):
    distributed_listwise_stats(gids, s, target, group_size, group=None, device=None)
        -> {"kl", "entropy_p", "entropy_target", "groups"}: means over the global batch's groups of
        KL(w*||P) (Eq. 10), H(P) and H(w*), P = softmax(s). Each rank passes its own samples
        (global group ids ``gids``); a group's members may sit on different ranks. Every rank of
        ``group`` (default: the world, when torch.distributed is initialised) must call it.
    listwise_update_metrics(gids, s_start, s_end, target, group_size, group=None, device=None)
        -> the logged ``lpo/kl_start``, ``lpo/kl_end``, ``lpo/entropy_p_end``, ``lpo/entropy_target``,
        ``lpo/groups`` of an update that moved s from ``s_start`` to ``s_end``.

Used by the DeepSpeed actor trainer and the Megatron actor for ``--lpo.end_kl``.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist

from openrlhf_lpo.listwise import listwise_group_sums, listwise_stats_from_sums

__all__ = ["distributed_listwise_stats", "listwise_update_metrics"]


def distributed_listwise_stats(gids: torch.Tensor, s: torch.Tensor, target: torch.Tensor, group_size: int,
                               group=None, device: Optional[torch.device] = None) -> Dict[str, float]:
    device = device if device is not None else s.device
    reduce = dist.is_available() and dist.is_initialized()
    n = torch.tensor([int(gids.max()) + 1 if gids.numel() else 0], dtype=torch.float64, device=device)
    if reduce:
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
    sums = listwise_group_sums(gids.to(device), s.to(device), target.to(device), int(n.item()))
    if reduce:
        dist.all_reduce(sums, group=group)
    return listwise_stats_from_sums(sums.cpu(), group_size)


def listwise_update_metrics(gids: torch.Tensor, s_start: torch.Tensor, s_end: torch.Tensor, target: torch.Tensor,
                            group_size: int, group=None, device: Optional[torch.device] = None) -> Dict[str, float]:
    start = distributed_listwise_stats(gids, s_start, target, group_size, group=group, device=device)
    end = distributed_listwise_stats(gids, s_end, target, group_size, group=group, device=device)
    return {"lpo/kl_start": start["kl"], "lpo/kl_end": end["kl"], "lpo/entropy_p_end": end["entropy_p"],
            "lpo/entropy_target": start["entropy_target"], "lpo/groups": start["groups"]}
