"""One LPO update's plan, shared by both backends (the DeepSpeed trainer and the Megatron actor).

The listwise gradient sum_k c_k grad s_k (Eq. 10/11) is exact only when every c_k comes from all K
members of its group at the current parameters. An update is cut into optimizer windows of whole
groups (shuffled as units) and, per window, c comes from one of four places (:class:`WindowMode`):

    one_pass    every micro-batch holds whole groups: the loss D(w*, softmax(s_g)) is differentiated
                directly, c is never materialised;
    shortcut    the first window of a rollout batch runs at the parameters that produced the old
                log-probs, so s = s_t exactly and c = dD/ds at s_t needs no forward;
    pre_pass    later windows whose micro-batches split groups: a no-grad forward gives s first;
    pointwise   the pointwise projection: c = -w* needs no forward.

The backends hand in their reductions (``all_reduce_max``: a list of floats in, the element-wise maximum
over the data-parallel ranks out) and their own counters; nothing here is collective by itself.

Public names (stable):
    WindowMode, window_generator(seed, update_index, epoch), groups_per_window(batch_size, dp, K),
    group_windows(gids, K, groups_per_window, generator), check_window_count(n, all_reduce_max),
    choose_mode(projection, whole_groups, first_window, force_two_pass),
    window_coefficients(mode, target, divergence, projection, K, s=None, gids=None)
"""

from __future__ import annotations

from enum import Enum
from typing import Callable, List, Optional, Sequence

import torch

from openrlhf_lpo import listwise
from openrlhf_lpo.core import layout

__all__ = ["WindowMode", "window_generator", "groups_per_window", "group_windows", "check_window_count",
           "choose_mode", "window_coefficients"]

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
