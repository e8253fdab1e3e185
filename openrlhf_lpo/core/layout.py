"""Where LPO's samples go: whole prompt groups per data-parallel rank, forward chunks, and
optimizer windows of whole groups cut into fixed-size or token-budget micro-batches.

The listwise gradient sum_k c_k grad s_k needs each c_k from all K members at the current
parameters, so a group must sit on one DP rank and inside one optimizer window. Nothing else
needs whole groups: the old-log-prob forward is per sample (its chunks follow
``--rollout.micro_batch_size``), and micro-batches may split groups (the trainer then takes c
from a no-grad pass, or from s_t in the first, on-policy window).

Public names (stable):
    ranked_groups(n_groups, dp) -> (n_used, n_dropped)     partial rollout batches (below)
    assign_groups(group_tokens, dp, balance) -> dp lists of group ids, equal counts
    forward_chunks(per_rank_samples, micro=None, lengths=None, budget=None) -> chunks per rank
    group_members(gids, K) -> list of member-index lists (validated: K members each)
    window_groups(members, groups_per_window, generator=None) -> windows of groups
    fixed_micro_batches(window, micro) -> micro-batches of sample indices
    budget_micro_count(window, lengths, budget) -> (whole_group_count or None, sample_count)
    budget_micro_batches(window, lengths, n_micro, whole_groups, budget=None) -> micro-batches
    budget_partition(weights, n_parts, budget) -> parts, none over the budget (unless a single item)

Partial rollout batches: OpenRLHF hands over a short last batch when the dataset is not a
multiple of ``--rollout.batch_size`` (MATH 7500 = 29 x 256 + 76), and dynamic filtering can
shorten a batch at the end of an episode. LPO trains on it: the groups are dealt to the ranks in
equal counts (the at most dp-1 groups that do not divide evenly are dropped, with a warning),
the optimizer windows hold ``--train.batch_size`` / K groups and the last one holds the rest;
every window is normalised by its own number of groups.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

import torch

__all__ = [
    "ranked_groups",
    "assign_groups",
    "forward_chunks",
    "group_members",
    "window_groups",
    "fixed_micro_batches",
    "budget_micro_count",
    "budget_micro_batches",
    "budget_partition",
    "first_fit_count",
]


def ranked_groups(n_groups: int, dp: int) -> Tuple[int, int]:
    """Groups that train when ``n_groups`` arrive for ``dp`` ranks: (used, dropped), used % dp == 0."""
    if dp < 1:
        raise ValueError(f"data-parallel size must be >= 1, got {dp}")
    used = n_groups - n_groups % dp
    return used, n_groups - used


def _partitions(weights: Sequence[int], k: int, equal_size: bool) -> List[List[int]]:
    """``k`` parts of item indices with near-equal weight sums: the largest differencing method
    (Karmarkar-Karp) for k-way partitioning. Each state is ``k`` subsets ordered by sum; the two states
    of largest spread (max - min) merge heaviest-with-lightest, until one state is left. With
    ``equal_size`` (``len(weights) % k == 0``) the initial states take k items of adjacent weight, one
    per subset, so every part ends with the same count."""
    import heapq

    n = len(weights)
    if k < 1 or n < k:
        raise ValueError(f"cannot cut {n} items into {k} parts")
    if k == 1:
        return [list(range(n))]
    if equal_size and n % k:
        raise ValueError(f"{n} items do not split into {k} parts of equal size")
    order = sorted(range(n), key=lambda i: (weights[i], i))
    if equal_size:
        seeds = [[[order[j + m]] for m in range(k)] for j in range(0, n, k)]
    else:
        seeds = [[[i]] + [[] for _ in range(k - 1)] for i in order]
    heap = []
    for tie, subsets in enumerate(seeds):
        sums = [sum(weights[i] for i in s) for s in subsets]
        ranked = sorted(zip(sums, subsets), key=lambda t: -t[0])
        heapq.heappush(heap, (-(ranked[0][0] - ranked[-1][0]), tie, ranked))
    tie = len(seeds)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # a's heaviest subset joins b's lightest, and so on down
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
        merged.sort(key=lambda t: -t[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
        tie += 1
    return [sorted(subset) for _, subset in heap[0][2]]


def assign_groups(group_tokens: Sequence[int], dp: int, balance: bool) -> List[List[int]]:
    """Group ids of each rank, the same count on every rank (``len(group_tokens) % dp == 0``).

    ``balance``: Karmarkar-Karp on the groups' token sums (equal counts), else contiguous runs.
    """
    n = len(group_tokens)
    if n % dp or n == 0:
        raise ValueError(f"{n} groups cannot be dealt evenly to {dp} data-parallel ranks")
    per = n // dp
    if not balance or dp == 1:
        return [list(range(r * per, (r + 1) * per)) for r in range(dp)]
    return _partitions(group_tokens, dp, equal_size=True)


def first_fit_count(lengths: Sequence[int], budget: int) -> int:
    """Bins needed by first fit for items of ``lengths`` under ``budget`` (an item over the
    budget gets a bin of its own)."""
    bins: List[int] = []
    for length in lengths:
        for i, used in enumerate(bins):
            if used + length <= budget:
                bins[i] += length
                break
        else:
            bins.append(length)
    return len(bins)


def forward_chunks(per_rank_samples: List[List[int]], micro: Optional[int] = None,
                   lengths: Optional[Sequence[int]] = None, budget: Optional[int] = None) -> List[List[List[int]]]:
    """Cut each rank's samples into the same number of chunks: ``micro`` samples each, or (with
    ``budget``) the max over ranks of the first-fit count under ``budget`` tokens, balanced by
    Karmarkar-Karp. OpenRLHF hands rank r the r-th run of ``len/dp`` consecutive experiences."""
    if budget is None:
        if not micro or micro < 1:
            raise ValueError("forward_chunks needs micro >= 1 or a token budget")
        n = max(len(s) for s in per_rank_samples)
        n_chunks = -(-n // micro)
        chunks = []
        for samples in per_rank_samples:
            mine = [samples[i:i + micro] for i in range(0, len(samples), micro)]
            if len(mine) != n_chunks:
                raise ValueError("ranks hold different numbers of samples; deal groups with assign_groups")
            chunks.append(mine)
        return chunks
    n_chunks = max(first_fit_count([lengths[i] for i in s], budget) for s in per_rank_samples)
    if n_chunks > min(len(s) for s in per_rank_samples):
        raise ValueError("ranks hold different numbers of samples; deal groups with assign_groups")
    return [[[samples[j] for j in p] for p in _partitions([lengths[i] for i in samples], n_chunks, False)]
            for samples in per_rank_samples]


def group_members(gids: Sequence[int], K: int) -> List[List[int]]:
    """Member indices of each group, in order of first appearance; every group must have K."""
    groups: "OrderedDict[int, List[int]]" = OrderedDict()
    for i, g in enumerate(gids):
        groups.setdefault(int(g), []).append(i)
    bad: Dict[int, int] = {g: len(m) for g, m in groups.items() if len(m) != K}
    if bad:
        raise ValueError(
            f"groups {sorted(bad)[:5]} have {sorted(set(bad.values()))} members on this rank, expected "
            f"--rollout.n_samples_per_prompt {K}: a group was split across ranks or truncated"
        )
    return list(groups.values())


def window_groups(members: List[List[int]], groups_per_window: int,
                  generator: Optional[torch.Generator] = None) -> List[List[List[int]]]:
    """Optimizer windows of ``groups_per_window`` groups (the last one may hold fewer), the
    groups shuffled as units when ``generator`` is given."""
    if groups_per_window < 1:
        raise ValueError(f"groups_per_window must be >= 1, got {groups_per_window}")
    if generator is not None and len(members) > 1:
        perm = torch.randperm(len(members), generator=generator).tolist()
        members = [members[p] for p in perm]
    return [members[i:i + groups_per_window] for i in range(0, len(members), groups_per_window)]


def fixed_micro_batches(window: List[List[int]], micro: int) -> List[List[int]]:
    """The window's samples (group after group) cut into micro-batches of ``micro`` samples."""
    flat = [i for group in window for i in group]
    return [flat[i:i + micro] for i in range(0, len(flat), micro)]


def budget_micro_count(window: List[List[int]], lengths: Sequence[int], budget: int) -> Tuple[Optional[int], int]:
    """First-fit micro-batch counts under ``budget`` tokens: with whole groups as items (None when
    a group alone exceeds the budget) and with single samples as items."""
    group_tokens = [sum(lengths[i] for i in g) for g in window]
    whole = first_fit_count(group_tokens, budget) if max(group_tokens) <= budget else None
    samples = first_fit_count([lengths[i] for g in window for i in g], budget)
    return whole, samples


def _first_fit_bins(order: Sequence[int], weights: Sequence[int], budget: int) -> List[List[int]]:
    bins: List[List[int]] = []
    used: List[int] = []
    for j in order:
        for b, u in enumerate(used):
            if u + weights[j] <= budget:
                bins[b].append(j)
                used[b] += weights[j]
                break
        else:
            bins.append([j])
            used.append(weights[j])
    return bins


def budget_partition(weights: Sequence[int], n_parts: int, budget: int) -> List[List[int]]:
    """``n_parts`` parts of item indices, none over ``budget`` unless it is a single item: Karmarkar-Karp
    (balanced) when its parts fit, else first-fit bins split until there are ``n_parts``
    (``first_fit_count(weights, budget) <= n_parts <= len(weights)``)."""
    if not 1 <= n_parts <= len(weights):
        raise ValueError(f"cannot cut {len(weights)} items into {n_parts} micro-batches")
    parts = _partitions(weights, n_parts, False)
    if all(len(p) == 1 or sum(weights[j] for j in p) <= budget for p in parts):
        return parts
    bins = _first_fit_bins(range(len(weights)), weights, budget)
    if len(bins) > n_parts:
        raise ValueError(f"{len(bins)} micro-batches are needed for {budget} tokens each, only {n_parts} agreed")
    while len(bins) < n_parts:  # split the heaviest bin that holds more than one item (halves stay under budget)
        b = max((b for b in range(len(bins)) if len(bins[b]) > 1), key=lambda b: sum(weights[j] for j in bins[b]))
        half = len(bins[b]) // 2
        bins[b:b + 1] = [bins[b][:half], bins[b][half:]]
    return [sorted(p) for p in bins]


def budget_micro_batches(window: List[List[int]], lengths: Sequence[int], n_micro: int,
                         whole_groups: bool, budget: Optional[int] = None) -> List[List[int]]:
    """``n_micro`` token-balanced micro-batches (Karmarkar-Karp); with ``whole_groups`` the groups
    are indivisible and their members stay contiguous. ``n_micro`` is agreed across ranks (every
    rank must run the same number of forwards) and never exceeds the window's items. With ``budget``
    no micro-batch of more than one item exceeds it (:func:`budget_partition`)."""
    if whole_groups:
        weights = [sum(lengths[i] for i in g) for g in window]
        parts = budget_partition(weights, n_micro, budget) if budget else _partitions(weights, n_micro, False)
        return [[i for gi in p for i in window[gi]] for p in parts]
    flat = [i for g in window for i in g]
    weights = [lengths[i] for i in flat]
    parts = budget_partition(weights, n_micro, budget) if budget else _partitions(weights, n_micro, False)
    return [[flat[j] for j in p] for p in parts]
