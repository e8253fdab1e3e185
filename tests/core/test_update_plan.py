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


def _settings(**kw):
    base = dict(group_size=4, batch_size=8, dp=1, epochs=1, seed=0, micro_batch_size=2, max_tokens=None,
                listwise=False, clip_eps=(0.2, 0.2))
    base.update(kw)
    return update.UpdateSettings(**base)


def test_policy_gradient_windows_cover_every_sample_once_and_agree_over_ranks():
    """A policy-gradient estimator's windows: --train.batch_size / dp samples shuffled from the seed; when the ranks
    hold different numbers (a stock partial batch, 10 here vs 12 elsewhere), every rank runs the largest window
    count any rank needs, its samples split evenly over them (each optimizer step is collective)."""
    batch = update.UpdateBatch(lengths=[5] * 10)
    same = update.plan_update(batch, _settings(), lambda v, op: list(v), 0)
    assert [len(p.indices) for p in same] == [8, 2]
    assert sorted(i for p in same for i in p.indices) == list(range(10))
    assert all(p.mode is None and p.groups == 0 for p in same)

    def other_rank_holds_17(values, op):  # this rank 10 samples (2 windows), the other 17 (3 windows)
        if op == "max" and len(values) == 3:
            return [3.0, 17.0, -10.0]
        return list(values)

    agreed = update.plan_update(batch, _settings(), other_rank_holds_17, 0)
    assert [len(p.indices) for p in agreed] == [4, 3, 3]
    assert sorted(i for p in agreed for i in p.indices) == list(range(10))
    # the same seed and update index give the same windows (the rule both backends use); another index, others
    again = update.plan_update(batch, _settings(), lambda v, op: list(v), 0)
    assert [p.indices for p in again] == [p.indices for p in same]
    assert [p.indices for p in update.plan_update(batch, _settings(), lambda v, op: list(v), 1)] != \
        [p.indices for p in same]


def test_token_budget_micro_batches_respect_the_budget_and_agree():
    """One budget rule on both backends: first-fit counts agreed over the ranks (the largest), no micro-batch over
    the budget unless it holds a single sample."""
    lengths = [30, 10, 25, 5, 40, 12, 8, 20]
    batch = update.UpdateBatch(lengths=lengths, gids=[0, 0, 0, 0, 1, 1, 1, 1],
                               target=torch.full((8,), 0.25, dtype=torch.float64))
    settings = _settings(listwise=True, max_tokens=45, batch_size=8, micro_batch_size=1)

    def more_elsewhere(values, op):  # another rank needs 6 micro-batches
        if op == "max" and len(values) == 1:
            return [max(values[0], 6.0)]
        return list(values)

    plans = update.plan_update(batch, settings, more_elsewhere, 0)
    assert len(plans) == 1 and len(plans[0].micro_batches) == 6
    for mb in plans[0].micro_batches:
        assert len(mb) == 1 or sum(lengths[i] for i in mb) <= 45, mb
    assert plans[0].mode is WindowMode.SHORTCUT  # groups split: the first window takes c from s_t
