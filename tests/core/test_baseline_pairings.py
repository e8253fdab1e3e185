"""The 2025 baselines' LPO pairings (docs/lpo_flags.md, "Baselines and their LPO pairs") against float64
references written here, never through the product's own advantage or temperature functions:

* RLOO: A = R - mean of the other K-1 rewards = K/(K-1) (R - mean), so tau = (K-1)/K (``loo``);
* REINFORCE++-baseline: A = (R - group mean - m)/sigma with m, sigma the batch mean and std of R - group mean
  (OpenRLHF's whitening; m = 0 with every response weighing 1), so tau = sigma for every group (``batch_std``);
* DAPO, GSPO, CISPO: GRPO's advantage (R - mean)/std, so tau = std (``std``);
* Prop. 1 for every pairing: at the on-policy point s = 0 the gradient of LPO-rev (mean over prompts of
  KL(P||w*), the product's loss) equals the paired policy gradient, computed in closed form (numpy, float64)
  on a tabular softmax policy: d log pi(y_t)/d theta_t = e_{y_t} - softmax(theta_t).
"""

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_lpo import listwise as lw

REPO = Path(__file__).resolve().parents[2]
T = lambda a: torch.tensor(np.asarray(a, dtype=np.float64))  # noqa: E731


# ------------------------------------------------------------------ float64 references (numpy)


def flat(r):
    return r.max(axis=1) == r.min(axis=1)


def ref_rloo(r):
    """RLOO's leave-one-out baseline (Ahmadian et al. 2024; OpenRLHF ``rloo``)."""
    k = r.shape[1]
    out = np.zeros_like(r)
    for g in range(r.shape[0]):
        for i in range(k):
            others = [r[g, j] for j in range(k) if j != i]
            out[g, i] = r[g, i] - sum(others) / (k - 1)
    return out


def ref_reinforce_pp(r, weights=None):
    """REINFORCE++-baseline (Hu et al. 2025; OpenRLHF ``reinforce_baseline``): group-centred rewards whitened
    over the batch with per-response weights (OpenRLHF: token counts; None: 1 each), variance floored at 1e-8."""
    a = r - r.mean(axis=1, keepdims=True)
    w = np.ones_like(a) if weights is None else np.asarray(weights, dtype=np.float64)
    m = float((w * a).sum() / w.sum())
    var = float((w * (a - m) ** 2).sum() / w.sum())
    return (a - m) / math.sqrt(max(var, 1e-8)), math.sqrt(max(var, 1e-8))


def ref_grpo(r):
    std = r.std(axis=1, ddof=1, keepdims=True)
    return np.where(flat(r)[:, None], 0.0, (r - r.mean(axis=1, keepdims=True)) / np.where(std > 0, std, 1.0))


@st.composite
def batches(draw, min_k=2, max_k=12):
    g = draw(st.integers(1, 5))
    k = draw(st.integers(min_k, max_k))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    kind = draw(st.sampled_from(["binary", "uniform", "with_flat"]))
    if kind == "binary":
        r = rng.integers(0, 2, size=(g, k)).astype(np.float64)
    else:
        r = rng.uniform(-1, 2, size=(g, k))
    if kind == "with_flat":
        r[0] = 0.5  # one group with equal rewards
    return r


# ------------------------------------------------------------------ the temperatures


@settings(max_examples=80, deadline=None)
@given(batches())
def test_loo_temperature_is_rloo_leave_one_out_scaling(r):
    g, k = r.shape
    tau = lw.group_temperature(T(r), "loo").numpy()
    assert tau.shape == (g, 1) and np.all(tau == (k - 1) / k)
    a = lw.pg_advantages(T(r), "rloo").numpy()
    ref = ref_rloo(r)
    np.testing.assert_allclose(a, ref, rtol=1e-12, atol=1e-13)
    # Dr.GRPO's form with tau = (K-1)/K
    np.testing.assert_allclose(ref, k / (k - 1) * (r - r.mean(axis=1, keepdims=True)), rtol=1e-10, atol=1e-13)
    assert np.all(a[flat(r)] == 0.0)  # equal rewards: exactly 0


@settings(max_examples=80, deadline=None)
@given(batches())
def test_batch_std_temperature_is_reinforce_pp_whitening(r):
    ref, sigma = ref_reinforce_pp(r)
    tau = lw.group_temperature(T(r), "batch_std").numpy()
    assert tau.shape == (r.shape[0], 1)
    np.testing.assert_allclose(tau, sigma, rtol=1e-12)
    a = lw.pg_advantages(T(r), "reinforce_pp").numpy()
    np.testing.assert_allclose(a, ref, rtol=1e-10, atol=1e-10)
    assert np.all(a[flat(r)] == 0.0)


@settings(max_examples=60, deadline=None)
@given(batches(), st.integers(0, 2**31 - 1))
def test_batch_std_with_token_weights_is_openrlhf_token_whitening(r, seed):
    """``weights`` = response token counts: OpenRLHF's token-weighted sigma; its mean m != 0 then, a shift
    that a group softmax cannot carry (what the docs say about unequal lengths)."""
    w = np.random.default_rng(seed).integers(1, 40, size=r.shape).astype(np.float64)
    _, sigma = ref_reinforce_pp(r, w)
    got = lw.batch_std_temperature(T(r), T(w)).numpy()
    np.testing.assert_allclose(got, sigma, rtol=1e-12)


def test_batch_std_is_a_batch_level_temperature():
    """One value for the whole batch: a group's tau depends on the other groups (so the experience maker must
    pass every group of the rollout batch at once, as _attach_targets does)."""
    r = np.array([[1.0, 0.0, 0.0, 0.0], [3.0, 0.0, 1.0, 2.0], [0.2, 0.2, 0.2, 0.2]])
    whole = lw.group_temperature(T(r), "batch_std").numpy()[:, 0]
    alone = lw.group_temperature(T(r[:1]), "batch_std").numpy()[0, 0]
    assert np.all(whole == whole[0]) and abs(whole[0] - alone) > 0.2
    # every group flat: the variance floor, and the target is softmax(s_t) whatever tau is
    flat_r = T(np.full((2, 3), 0.7))
    assert float(lw.group_temperature(flat_r, "batch_std")[0, 0]) == pytest.approx(1e-4)
    np.testing.assert_array_equal(lw.gibbs_target(flat_r, "batch_std").numpy(), np.full((2, 3), 1 / 3))


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from(["loo", "batch_std", "std"]))
def test_prop1_on_policy_reverse_coefficients(r, temperature):
    """Prop. 1 at the level of c: at s = s_t = 0, c_rev = -A/K with A the baseline's own advantage."""
    g, k = r.shape
    ref = {"loo": ref_rloo(r), "batch_std": ref_reinforce_pp(r)[0], "std": ref_grpo(r)}[temperature]
    w = lw.gibbs_target(T(r), temperature)
    c = lw.listwise_coefficients(torch.zeros(g, k, dtype=torch.float64), w, "rev").numpy()
    np.testing.assert_allclose(c, -ref / k, rtol=1e-9, atol=1e-10)


# ------------------------------------------------------------------ Prop. 1 on a tabular policy


def _policy(G, K, lengths, V=5, seed=0):
    rng = np.random.default_rng(seed)
    B, Tm = G * K, max(lengths)
    theta = rng.normal(0.0, 1.0, size=(B, Tm, V))
    tokens = rng.integers(0, V, size=(B, Tm))
    mask = np.zeros((B, Tm))
    for b, n in enumerate(lengths):
        mask[b, :n] = 1.0
    return theta, tokens, mask


def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def ref_pg_gradient(theta, tokens, mask, adv, aggregation):
    """d/d theta of the policy-gradient loss at pi_theta = pi_old (ratio 1), closed form:
    seq-mean-token-mean: -(1/B) sum_k A_k (1/n_k) sum_t (e_{y_kt} - softmax(theta_kt));
    token-mean:          -(1/N) sum_k A_k sum_t (e_{y_kt} - softmax(theta_kt)).
    (PPO's clipped surrogate, GSPO's sequence ratio exp(mean_t log ratio) and CISPO's detached clipped weight
    all have d(loss)/d log pi_t = -A_k x that weight at ratio 1.)"""
    B, Tm, V = theta.shape
    onehot = np.eye(V)[tokens]
    dlogp = onehot - _softmax(theta)  # [B, T, V]
    n = mask.sum(axis=1)
    a = adv.reshape(B)
    if aggregation == "seq":
        weight = (a / n / B)[:, None] * mask
    else:
        weight = a[:, None] * mask / mask.sum()
    return -weight[:, :, None] * dlogp


def lpo_rev_gradient(theta, tokens, mask, rewards, temperature, clip_eps, per_response_scale=None):
    """The product's LPO-rev loss (sequence_log_ratio, gibbs_target, listwise_loss) at pi_theta = pi_old,
    differentiated by autograd; ``per_response_scale`` multiplies each response's coefficient (the surrogate
    sum_k stopgrad(scale_k c_k) s_k / G)."""
    G, K = rewards.shape
    th = T(theta).requires_grad_(True)
    logp = torch.log_softmax(th, dim=-1).gather(-1, torch.tensor(tokens)[..., None])[..., 0]
    s = lw.sequence_log_ratio(logp, logp.detach(), T(mask), clip_eps).view(G, K)
    w = lw.gibbs_target(T(rewards), temperature)
    if per_response_scale is None:
        loss = lw.listwise_loss(s, w, "rev")
    else:
        c = lw.listwise_coefficients(s.detach(), w, "rev") * T(per_response_scale).view(G, K)
        loss = lw.listwise_surrogate(s, c).sum() / G
    (grad,) = torch.autograd.grad(loss, th)
    return grad.numpy()


PAIRINGS = [  # (baseline, temperature, reference advantage, aggregation, LPO clip of s)
    ("rloo", "loo", ref_rloo, "seq", 0.2),
    ("reinforce_pp", "batch_std", lambda r: ref_reinforce_pp(r)[0], "seq", 0.2),
    ("grpo", "std", ref_grpo, "seq", 0.2),
    ("gspo", "std", ref_grpo, "seq", 0.2),  # GSPO's sequence ratio: the seq-mean form at ratio 1
    ("dapo", "std", ref_grpo, "token", (0.2, 0.28)),  # clip-higher on s: inactive at s = 0
    ("cispo", "std", ref_grpo, "token", 0.2),
]


@pytest.mark.parametrize("baseline,temperature,ref_adv,aggregation,clip", PAIRINGS, ids=[p[0] for p in PAIRINGS])
def test_prop1_lpo_rev_gradient_equals_the_paired_pg_gradient(baseline, temperature, ref_adv, aggregation, clip):
    G, K = 4, 5
    rng = np.random.default_rng(7)
    rewards = rng.integers(0, 2, size=(G, K)).astype(np.float64)
    rewards[0] = [1, 0, 0, 0, 0]
    rewards[1] = [0.3, 0.9, 0.1, 0.6, 0.6]
    rewards[3] = 1.0  # a flat group contributes nothing to either
    # token-mean baselines (DAPO, CISPO) weigh a response by its length: the identity needs equal lengths
    lengths = [6] * (G * K) if aggregation == "token" else list(rng.integers(1, 9, size=G * K))
    theta, tokens, mask = _policy(G, K, lengths, seed=3)
    got = lpo_rev_gradient(theta, tokens, mask, rewards, temperature, clip)
    want = ref_pg_gradient(theta, tokens, mask, ref_adv(rewards), aggregation)
    scale = np.abs(want).max()
    assert scale > 1e-3
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12 * max(scale, 1.0))


@pytest.mark.parametrize("temperature", ["std"])
def test_prop1_token_mean_baselines_with_unequal_lengths(temperature):
    """DAPO / CISPO (token-level aggregation) with unequal lengths: the on-policy gradient is LPO-rev's with
    each response's coefficient scaled by n_k B / N (its share of the tokens); plain LPO-rev differs."""
    G, K = 3, 4
    rng = np.random.default_rng(11)
    rewards = rng.uniform(0, 1, size=(G, K))
    lengths = list(rng.integers(1, 12, size=G * K))
    theta, tokens, mask = _policy(G, K, lengths, seed=5)
    want = ref_pg_gradient(theta, tokens, mask, ref_grpo(rewards), "token")
    n = mask.sum(axis=1)
    scaled = lpo_rev_gradient(theta, tokens, mask, rewards, temperature, 0.2, per_response_scale=n * len(n) / n.sum())
    np.testing.assert_allclose(scaled, want, rtol=0, atol=1e-12 * np.abs(want).max())
    plain = lpo_rev_gradient(theta, tokens, mask, rewards, temperature, 0.2)
    assert np.abs(plain - want).max() > 1e-3 * np.abs(want).max()


def test_reinforce_pp_with_token_weights_differs_from_its_pair_only_by_the_batch_shift():
    """OpenRLHF's token-weighted whitening (unequal lengths): A = (a - m)/sigma_w. With tau = sigma_w the LPO
    target is softmax(a/sigma_w) per group, so c_rev = -(A + m/sigma_w)/K: the pairing is exact up to a shift
    that is constant over the batch (zero in expectation, not per sample)."""
    rng = np.random.default_rng(2)
    r = rng.uniform(0, 1, size=(3, 4))
    lengths = rng.integers(1, 30, size=r.shape).astype(np.float64)
    adv, sigma = ref_reinforce_pp(r, lengths)
    a = r - r.mean(axis=1, keepdims=True)
    m = float((lengths * a).sum() / lengths.sum())
    tau = lw.batch_std_temperature(T(r), T(lengths))
    c = lw.listwise_coefficients(torch.zeros(3, 4, dtype=torch.float64), lw.gibbs_target(T(r), tau), "rev").numpy()
    np.testing.assert_allclose(c, -(adv + m / sigma) / 4, rtol=1e-10, atol=1e-12)
    assert abs(m) > 1e-3  # the shift is real with unequal lengths


# ------------------------------------------------------------------ docs, method files, errors


def test_pairing_table_lists_every_temperature_and_existing_method_files():
    """docs/lpo_flags.md's pairing table (Table 1 form) names every registered temperature, and every method
    file it names exists in configs/methods."""
    text = (REPO / "docs" / "lpo_flags.md").read_text()
    start = text.index("## Baselines and their LPO pairs")
    section = text[start:text.index("\n## ", start + 5)]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 11
    temps = {m for row in rows for m in re.findall(r"`--lpo\.temperature ([a-z_]+)`", row)}
    assert set(lw.TEMPERATURES) <= temps, set(lw.TEMPERATURES) - temps
    files = {f for row in rows for f in re.findall(r"`([a-z_]+\.sh)`", row)}
    assert {"rloo.sh", "reinforce_pp.sh", "dapo.sh", "gspo.sh", "cispo.sh", "lpo_rev_rloo.sh",
            "lpo_rev_reinforce_pp.sh", "lpo_rev_dapo.sh"} <= files
    missing = [f for f in files if not (REPO / "configs" / "methods" / f).exists()]
    assert not missing, missing


def test_new_method_files_set_one_method_with_a_sourced_comment():
    for name in ("dapo", "gspo", "rloo", "reinforce_pp", "cispo", "lpo_fwd_rloo", "lpo_rev_rloo",
                 "lpo_fwd_reinforce_pp", "lpo_rev_reinforce_pp", "lpo_fwd_dapo", "lpo_rev_dapo"):
        lines = (REPO / "configs" / "methods" / f"{name}.sh").read_text().splitlines()
        assert lines[0].startswith("# ") and sum(line.startswith("METHOD_ARGS=(") for line in lines) == 1, name
        if not name.startswith("lpo_"):
            assert re.search(r"arXiv \d{4}\.\d{5}", lines[0]), f"{name}.sh: the comment names its public source"


@pytest.mark.parametrize("call,match", [
    (lambda: lw.batch_std_temperature(T([[1.0, 0.0]]), T([[-1.0, 2.0]])), "weights"),
    (lambda: lw.batch_std_temperature(T([[1.0, 0.0]]), T([[1.0, 2.0, 3.0]])), "weights"),
    (lambda: lw.cispo_token_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), -0.1, 0.2),
     "--actor.eps_clip_low_high"),
    (lambda: lw.cispo_token_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), 0.2, 0.0),
     "--actor.eps_clip_low_high"),
])
def test_bad_input_names_what_to_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call()
