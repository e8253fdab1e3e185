"""The update plan both backends call (core/update.py): windows of whole groups, the mode table, the
window shuffle's RNG rule and the coefficients of each mode against float64 autograd."""

import pytest
import torch

from openrlhf_lpo import listwise
from openrlhf_lpo.core import update
from openrlhf_lpo.core.update import WindowMode


def test_windows_hold_whole_groups_and_cover_everything():
    gids = [3, 1, 3, 0, 1, 2, 0, 2]
    wins = update.group_windows(gids, 2, 2, update.window_generator(0, 0, 0))
    assert len(wins) == 2 and sorted(i for w in wins for g in w for i in g) == list(range(8))
    for w in wins:
        assert len(w) == 2 and all(gids[g[0]] == gids[g[1]] for g in w)
    with pytest.raises(ValueError, match="n_samples_per_prompt 2"):
        update.group_windows([0, 0, 0, 1], 2, 1, None)  # a group with 3 members, one with 1
    with pytest.raises(ValueError, match="--train.batch_size 12 .* multiple of 8"):
        update.groups_per_window(12, 2, 4)
    assert update.groups_per_window(16, 2, 4) == 2


def test_the_shuffle_is_a_function_of_seed_step_and_epoch():
    """One rule on both backends: the same (seed, optimizer steps before the update, epoch) gives the same
    windows (a resumed run restores the step count), another step or epoch another order."""
    gids = [g for g in range(16) for _ in range(4)]
    def order(seed, step, epoch):
        return [g[0] for w in update.group_windows(gids, 4, 2, update.window_generator(seed, step, epoch)) for g in w]
    assert order(7, 3, 1) == order(7, 3, 1)
    assert len({tuple(order(7, st, ep)) for st in range(3) for ep in range(2)}) == 6
    expected = torch.randperm(16, generator=torch.Generator().manual_seed(7 * 1000003 + 3 * 1009 + 1)).tolist()
    assert order(7, 3, 1) == [4 * g for g in expected]


def test_window_count_guard_names_the_mismatch():
    update.check_window_count(3, lambda v: v)  # one rank: equal
    with pytest.raises(RuntimeError, match=r"different numbers of optimizer windows \(2 vs 3\)"):
        update.check_window_count(2, lambda v: [3.0, -2.0])  # another rank holds 3


@pytest.mark.parametrize("projection,whole,first,force,mode", [
    ("pointwise", True, True, False, "pointwise"),
    ("listwise", True, False, False, "one_pass"),
    ("listwise", True, True, True, "pre_pass"),
    ("listwise", False, True, False, "shortcut"),
    ("listwise", False, False, False, "pre_pass"),
])
def test_mode_table(projection, whole, first, force, mode):
    got = update.choose_mode(projection, whole, first, force)
    assert got is WindowMode(mode) and got == mode and f"{got}" == mode


@pytest.mark.parametrize("divergence", ["fwd", "rev", "js", "alpha:0.5"])
def test_coefficients_equal_autograd_of_the_divergence_with_shuffled_groups(divergence):
    """c_k = dD(w*, softmax(s_g))/ds_k for members in any row order (gids), float64 autograd reference."""
    K, G = 4, 3
    gen = torch.Generator().manual_seed(1)
    s = (0.3 * torch.randn(G * K, generator=gen, dtype=torch.float64))
    w = torch.softmax(torch.randn(G, K, generator=gen, dtype=torch.float64), -1).reshape(-1)
    perm = torch.randperm(G * K, generator=gen)
    gids = [int(i) // K for i in perm]
    c = update.window_coefficients(WindowMode.PRE_PASS, w[perm], divergence, "listwise", K, s=s[perm], gids=gids)
    leaf = s.clone().requires_grad_(True)
    total = listwise.listwise_divergence(leaf.view(G, K), w.view(G, K), divergence).sum()
    (grad,) = torch.autograd.grad(total, leaf)
    torch.testing.assert_close(c, grad[perm], rtol=1e-10, atol=1e-12)
    # members already K consecutive: the same without gids
    c2 = update.window_coefficients(WindowMode.SHORTCUT, w, divergence, "listwise", K, s=s)
    torch.testing.assert_close(c2, grad, rtol=1e-10, atol=1e-12)


def test_pointwise_and_one_pass_coefficients():
    w = torch.tensor([0.1, 0.9, 0.5, 0.5], dtype=torch.float64)
    assert torch.equal(update.window_coefficients("pointwise", w, "fwd", "pointwise", 2), -w)
    assert update.window_coefficients(WindowMode.ONE_PASS, w, "fwd", "listwise", 2) is None
    with pytest.raises(ValueError, match="shortcut window: its coefficients need s"):
        update.window_coefficients(WindowMode.SHORTCUT, w, "fwd", "listwise", 2)
