"""LPO core against an independent float64 reference, autograd and the paper's identities."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_lpo import listwise as lw

# ------------------------------------------------------------------ float64 reference (numpy)


from simplex_reference import finite_differences, softmax as ref_softmax  # noqa: E402


def ref_temperature(r, mode):
    if mode == "std":
        return r.std(axis=1, ddof=1, keepdims=True)
    if mode == "one":
        return np.ones((r.shape[0], 1))
    if mode == "mean":
        return r.mean(axis=1, keepdims=True)
    return np.full((r.shape[0], 1), float(mode))


def ref_target(r, mode, s_t=None):
    tau = ref_temperature(r, mode)
    flat = r.max(axis=1) == r.min(axis=1)
    a = np.zeros_like(r)
    for g in range(r.shape[0]):
        if not flat[g]:
            a[g] = (r[g] - r[g].mean()) / tau[g, 0]
    if s_t is not None:
        a = a + s_t
    return ref_softmax(a)


def ref_kl(p, q):
    out = np.zeros(p.shape[0])
    for g in range(p.shape[0]):
        for k in range(p.shape[1]):
            if p[g, k] > 0:
                out[g] += p[g, k] * (math.log(p[g, k]) - math.log(q[g, k]))
    return out


def ref_divergence(s, w, name):
    p = ref_softmax(s)
    if name == "fwd":
        return ref_kl(w, p)
    if name == "rev":
        return ref_kl(p, w)
    m = (p + w) / 2
    return 0.5 * (ref_kl(p, m) + ref_kl(w, m))


def ref_coefficients(s, w, name, h=1e-6):
    """Central finite differences of the reference divergence (float64)."""
    return finite_differences(lambda x: ref_divergence(x, w, name), s, h)


# ------------------------------------------------------------------ strategies


@st.composite
def groups(draw, min_k=2, max_k=32, binary=None):
    g = draw(st.integers(1, 4))
    k = draw(st.integers(min_k, max_k))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    is_binary = draw(st.booleans()) if binary is None else binary
    if is_binary:
        r = rng.integers(0, 2, size=(g, k)).astype(np.float64)
    else:
        r = rng.uniform(0, 1, size=(g, k))
    s = rng.normal(0, 0.5, size=(g, k))
    s_t = rng.normal(0, 0.3, size=(g, k))
    return r, s, s_t


MODES = ["std", "one", "mean", 0.7]
DIVS = ["fwd", "rev", "js"]
T = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731


# ------------------------------------------------------------------ target and divergence values


@settings(max_examples=60, deadline=None)
@given(groups(), st.sampled_from(MODES))
def test_target_matches_reference(data, mode):
    r, _, s_t = data
    got = lw.gibbs_target(T(r), mode, T(s_t)).numpy()
    np.testing.assert_allclose(got, ref_target(r, mode, s_t), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(got.sum(-1), 1.0, rtol=0, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(groups(), st.sampled_from(MODES), st.sampled_from(DIVS))
def test_divergence_matches_reference(data, mode, div):
    r, s, s_t = data
    w = ref_target(r, mode, s_t)
    got = lw.listwise_divergence(T(s), T(w), div).numpy()
    np.testing.assert_allclose(got, ref_divergence(s, w, div), rtol=1e-9, atol=1e-13)
    assert (got >= -1e-15).all()


# ------------------------------------------------------------------ coefficients


@settings(max_examples=60, deadline=None)
@given(groups(), st.sampled_from(MODES), st.sampled_from(DIVS))
def test_coefficients_equal_autograd_and_reference(data, mode, div):
    r, s, s_t = data
    w = T(ref_target(r, mode, s_t))
    s_var = T(s).requires_grad_(True)
    lw.listwise_divergence(s_var, w, div).sum().backward()
    c = lw.listwise_coefficients(T(s), w, div)
    torch.testing.assert_close(c, s_var.grad, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(c.numpy(), ref_coefficients(s, w.numpy(), div), rtol=1e-5, atol=1e-8)
    # zero-sum (a built-in control variate)
    np.testing.assert_allclose(c.sum(-1).numpy(), 0.0, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(groups(), st.sampled_from(MODES))
def test_forward_kl_coefficients_are_bounded(data, mode):
    r, s, s_t = data
    c = lw.listwise_coefficients(T(s), lw.gibbs_target(T(r), mode, T(s_t)), "fwd")
    assert c.abs().max() <= 1.0
    assert (c.abs().sum(-1) <= 2.0 + 1e-12).all()


@settings(max_examples=40, deadline=None)
@given(groups(), st.sampled_from(DIVS))
def test_coefficients_vanish_at_target(data, div):
    _, s, _ = data
    w = torch.softmax(T(s), -1)  # P = w*
    c = lw.listwise_coefficients(T(s), w, div)
    torch.testing.assert_close(c, torch.zeros_like(c), rtol=0, atol=1e-14)
    torch.testing.assert_close(lw.listwise_divergence(T(s), w, div), torch.zeros(s.shape[0], dtype=torch.float64), rtol=0, atol=1e-14)


def test_custom_divergence_uses_autograd():
    name = "test_squared_hellinger"

    @lw.register_divergence(name)
    def hellinger(log_p, target):
        return ((log_p.exp().sqrt() - target.sqrt()) ** 2).sum(-1)

    try:
        s = T(np.random.default_rng(0).normal(size=(3, 5)))
        w = torch.softmax(T(np.random.default_rng(1).normal(size=(3, 5))), -1)
        c = lw.listwise_coefficients(s, w, name)
        # independent: d/ds of sum (sqrt P - sqrt w)^2 with P = softmax(s)
        p = torch.softmax(s, -1)
        dldp = 1 - torch.sqrt(w / p)  # d/dP_j
        expect = p * (dldp - (p * dldp).sum(-1, keepdim=True))
        torch.testing.assert_close(c, expect, rtol=1e-10, atol=1e-13)
        with pytest.raises(ValueError, match="already registered"):
            lw.register_divergence(name)(hellinger)
    finally:
        lw.DIVERGENCES.pop(name)


# ------------------------------------------------------------------ paper identities


@settings(max_examples=60, deadline=None)
@given(groups(), st.sampled_from(MODES))
def test_on_policy_reverse_coefficients_are_minus_advantage_over_k(data, mode):
    """Prop. 1: at s = s_t = 0, c_rev = -A/K with A = (R - mean)/tau."""
    r, _, _ = data
    if mode == "mean":
        r = np.abs(r)
    g, k = r.shape
    w = lw.gibbs_target(T(r), mode)
    c = lw.listwise_coefficients(torch.zeros(g, k, dtype=torch.float64), w, "rev")
    tau = ref_temperature(r, mode)
    flat = r.max(1) == r.min(1)
    adv = np.where(flat[:, None], 0.0, (r - r.mean(1, keepdims=True)) / np.where(flat[:, None], 1.0, tau))
    np.testing.assert_allclose(c.numpy(), -adv / k, rtol=1e-10, atol=1e-13)
    # and the paired PG estimator gives the same A
    est = {"std": "grpo", "one": "dr_grpo", "mean": "maxrl"}.get(mode)
    if est:
        np.testing.assert_allclose(lw.pg_advantages(T(r), est).numpy(), adv, rtol=1e-12, atol=1e-14)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.floats(0.05, 5.0), st.integers(0, 1000))
def test_k2_forward_kl_is_soft_label_bce(g, tau, seed):
    """K=2: KL(w*||P) = BCE(s1 - s2, y) - H(w*), with y = sigma(+-1/tau) on-policy."""
    rng = np.random.default_rng(seed)
    s = T(rng.normal(size=(g, 2)))
    r = T(np.tile([[1.0, 0.0]], (g, 1)))
    w = lw.gibbs_target(r, tau)
    # on-policy target labels: one correct, one wrong
    torch.testing.assert_close(w[:, 0], torch.sigmoid(torch.tensor(1.0 / tau, dtype=torch.float64)).expand(g))
    delta = s[:, 0] - s[:, 1]
    y = w[:, 0]
    bce = torch.nn.functional.binary_cross_entropy_with_logits(delta, y, reduction="none")
    entropy = -(w * w.log()).sum(-1)
    torch.testing.assert_close(lw.listwise_divergence(s, w, "fwd"), bce - entropy, rtol=1e-12, atol=1e-13)
    c = lw.listwise_coefficients(s, w, "fwd")
    torch.testing.assert_close(c[:, 0], torch.sigmoid(delta) - y, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(c[:, 1], -(torch.sigmoid(delta) - y), rtol=1e-12, atol=1e-14)


@settings(max_examples=60, deadline=None)
@given(groups(), st.floats(0.1, 3.0))
def test_monotonic_improvement_identity(data, tau):
    """R(w*) - R(P_t) = tau (KL(w*||P_t) + KL(P_t||w*)) >= 0."""
    r, _, s_t = data
    w = lw.gibbs_target(T(r), tau, T(s_t))
    p_t = torch.softmax(T(s_t), -1)
    gain = ((w - p_t) * T(r)).sum(-1)
    jeffreys = lw.listwise_divergence(T(s_t), w, "fwd") + lw.listwise_divergence(T(s_t), w, "rev")
    torch.testing.assert_close(gain, tau * jeffreys, rtol=1e-9, atol=1e-13)
    assert (gain >= -1e-14).all()


# ------------------------------------------------------------------ degenerate groups and dtypes


@pytest.mark.parametrize("mode", ["std", "one", "mean", 2.5])
@pytest.mark.parametrize("value", [0.0, 1.0, 0.1])
def test_degenerate_groups_give_exactly_softmax_of_prev(mode, value):
    s_t = torch.tensor([[0.3, -0.2, 1e-9, 0.05]], dtype=torch.float64)
    r = torch.full((1, 4), value, dtype=torch.float64)
    w = lw.gibbs_target(r, mode, s_t)
    assert torch.equal(w, torch.softmax(s_t, -1))
    assert torch.isfinite(lw.pg_advantages(r.abs(), "maxrl")).all()
    assert torch.equal(lw.pg_advantages(r, "grpo"), torch.zeros_like(r))


def test_large_rewards_do_not_swamp_prev_log_ratio():
    """Centring before dividing keeps s_t exact when rewards are huge."""
    r = torch.tensor([[1e8, 1e8 + 1.0, 1e8, 1e8]], dtype=torch.float32)
    s_t = torch.tensor([[1e-3, 0.0, -1e-3, 0.0]], dtype=torch.float32)
    w = lw.gibbs_target(r, "one", s_t)
    expect = ref_target(r.double().numpy() - 1e8, "one", s_t.double().numpy())
    np.testing.assert_allclose(w.double().numpy(), expect, rtol=1e-6)


def test_bf16_inputs_give_float32_accurate_results():
    torch.manual_seed(0)
    s64 = torch.randn(64, 8, dtype=torch.float64)
    r = torch.randint(0, 2, (64, 8)).double()
    s16 = s64.to(torch.bfloat16)
    w = lw.gibbs_target(r, "std")
    for div in DIVS:
        got = lw.listwise_divergence(s16, w.to(torch.bfloat16), div)
        assert got.dtype == torch.float32
        ref = lw.listwise_divergence(s16.double(), w.to(torch.bfloat16).double(), div)
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
        c = lw.listwise_coefficients(s16, w.to(torch.bfloat16), div)
        assert c.dtype == torch.float32
        cref = lw.listwise_coefficients(s16.double(), w.to(torch.bfloat16).double(), div)
        torch.testing.assert_close(c.double(), cref, rtol=1e-5, atol=1e-6)


def test_zero_target_entries_are_safe():
    s = torch.tensor([[0.1, -0.3, 0.2]], dtype=torch.float64)
    w = torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64)
    fwd = lw.listwise_divergence(s, w, "fwd")
    js = lw.listwise_divergence(s, w, "js")
    assert torch.isfinite(fwd).all() and torch.isfinite(js).all()
    torch.testing.assert_close(fwd, -torch.log_softmax(s, -1)[:, 1])
    assert torch.isfinite(lw.listwise_coefficients(s, w, "fwd")).all()
    assert torch.isfinite(lw.listwise_coefficients(s, w, "js")).all()


# ------------------------------------------------------------------ sequence log-ratio


def test_sequence_log_ratio_is_length_normalised_and_clipped():
    eps = 0.2
    lp = torch.tensor([[-1.0, -2.0, -3.0, 0.0], [-1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    old = torch.tensor([[-1.1, -1.0, -3.5, 0.0], [-0.9, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    got = lw.sequence_log_ratio(lp, old, mask, eps)
    lo, hi = math.log(1 - eps), math.log(1 + eps)
    clip = lambda x: min(max(x, lo), hi)  # noqa: E731
    expect = [(clip(0.1) + clip(-1.0) + clip(0.5)) / 3, clip(-0.1), 0.0]
    np.testing.assert_allclose(got.numpy(), expect, rtol=1e-12)


def test_token_clipping_zeroes_gradient_outside_the_band_in_both_directions():
    eps = 0.2
    old = torch.zeros(1, 4, dtype=torch.float64)
    lp = torch.tensor([[0.5, -0.5, 0.05, -0.05]], dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 4)
    for sign in (1.0, -1.0):  # descend and ascend: clipped tokens get no gradient either way
        lp.grad = None
        (sign * lw.sequence_log_ratio(lp, old, mask, eps)).sum().backward()
        np.testing.assert_allclose(lp.grad.numpy(), [[0.0, 0.0, sign / 4, sign / 4]])


def test_asymmetric_clip():
    lp = torch.tensor([[0.3, -0.3]], dtype=torch.float64)
    got = lw.sequence_log_ratio(lp, torch.zeros_like(lp), torch.ones_like(lp), (0.2, 0.28))
    np.testing.assert_allclose(got.item(), (math.log(1.28) + math.log(0.8)) / 2)


# ------------------------------------------------------------------ losses


def test_listwise_loss_and_surrogate_have_the_same_gradient():
    torch.manual_seed(3)
    s = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    w = lw.gibbs_target(torch.randint(0, 2, (5, 8)).double(), "std", torch.randn(5, 8, dtype=torch.float64) * 0.1)
    for div in DIVS:
        (g1,) = torch.autograd.grad(lw.listwise_loss(s, w, div), s)
        c = lw.listwise_coefficients(s, w, div)
        (g2,) = torch.autograd.grad(lw.listwise_surrogate(s, c).mean(), s)
        torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-15)


def test_pointwise_projection_loss():
    s = torch.tensor([[0.1, 0.2], [0.3, -0.1]], dtype=torch.float64)
    w = torch.tensor([[0.25, 0.75], [0.5, 0.5]], dtype=torch.float64)
    expect = -((0.25 * 0.1 + 0.75 * 0.2) + (0.5 * 0.3 - 0.5 * 0.1)) / 2
    assert lw.pointwise_projection_loss(s, w).item() == pytest.approx(expect, rel=1e-12)
    assert lw.listwise_loss(s, w, projection="pointwise").item() == pytest.approx(expect, rel=1e-12)


def test_pg_advantages_reference():
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    a = r.numpy()
    mean = a.mean(1, keepdims=True)
    std = a.std(1, ddof=1, keepdims=True)
    np.testing.assert_allclose(lw.pg_advantages(r, "dr_grpo").numpy(), a - mean)
    grpo = np.where(std > 0, (a - mean) / np.where(std > 0, std, 1), 0)
    np.testing.assert_allclose(lw.pg_advantages(r, "grpo").numpy(), grpo)
    maxrl = np.where(mean > 0, (a - mean) / np.where(mean > 0, mean, 1), 0)
    np.testing.assert_allclose(lw.pg_advantages(r, "maxrl").numpy(), maxrl)
    # MaxRL weights the lone success of a hard prompt by (1 - 1/4)/(1/4) = 3
    assert lw.pg_advantages(r, "maxrl")[0, 0].item() == pytest.approx(3.0)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: lw.gibbs_target(torch.ones(3, 1), "std"), "K >= 2"),
        (lambda: lw.group_temperature(torch.ones(3, 1), "std"), "n_samples_per_prompt"),
        (lambda: lw.gibbs_target(torch.tensor([[1.0, float("nan")]]), "std"), "NaN or inf"),
        (lambda: lw.gibbs_target(torch.tensor([[1.0, float("inf")]]), "one"), "NaN or inf"),
        (lambda: lw.pg_advantages(torch.tensor([[float("nan"), 0.0]]), "grpo"), "NaN or inf"),
        (lambda: lw.gibbs_target(torch.ones(4), "std"), r"shape \[G, K\]"),
        (lambda: lw.gibbs_target(torch.ones(2, 3), "std", torch.zeros(2, 4)), "prev_log_ratio"),
        (lambda: lw.listwise_divergence(torch.zeros(2, 3), torch.full((2, 4), 0.25)), "target"),
        (lambda: lw.group_temperature(torch.ones(2, 3), -1.0), "positive"),
        (lambda: lw.group_temperature(torch.ones(2, 3), 0), "positive"),
        (lambda: lw.group_temperature(torch.ones(2, 3), float("nan")), "positive"),
        (lambda: lw.group_temperature(torch.ones(2, 3), "median"), "valid: batch_std, loo, mean, one, pop_std, std"),
        (lambda: lw.listwise_divergence(torch.zeros(2, 3), torch.full((2, 3), 1 / 3), "chi2"),
         r"valid: fwd, hellinger, js, rev, tv or alpha:<a> \(any real a\)"),
        (lambda: lw.listwise_coefficients(torch.zeros(2, 3), torch.full((2, 3), 1 / 3), "kl"), "valid: fwd, hellinger, js"),
        (lambda: lw.listwise_loss(torch.zeros(2, 3), torch.full((2, 3), 1 / 3), "fwd", "ranked"), "valid: listwise, pointwise"),
        (lambda: lw.pg_advantages(torch.ones(2, 3), "ppo"), "valid: dr_grpo, grpo, maxrl"),
        (lambda: lw.gibbs_target(torch.tensor([[-1.0, 0.0]]), "mean"), "non-negative"),
        (lambda: lw.sequence_log_ratio(torch.zeros(2, 3), torch.zeros(2, 4), None), "old_log_probs"),
        (lambda: lw.sequence_log_ratio(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 2)), "action_mask"),
        (lambda: lw.sequence_log_ratio(torch.zeros(2, 3), torch.zeros(2, 3), None, -0.1), "clip_eps"),  # eps_low >= 1 is allowed: no lower bound
        (lambda: lw.to_groups(torch.zeros(10), 4), "whole groups"),
        (lambda: lw.to_groups(torch.zeros(10), 1), "K >= 2"),
    ],
)
def test_bad_input_raises_clear_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
