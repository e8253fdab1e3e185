"""The divergence family of openrlhf_lpo.listwise (alpha:<a>, hellinger, tv, and fwd/rev/js beside them):
values against definitions written here in numpy, closed-form coefficients against autograd and
central finite differences (float64), the alpha limits, float32 with near one-hot targets, the
proven bounds on sum |c|, TV's subgradient, and the family registry."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_lpo import listwise as lw

T = lambda a: torch.tensor(np.asarray(a, dtype=np.float64))  # noqa: E731
ALPHAS = [-1.5, -0.5, 0.0, 1e-3, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0]
NAMES = ["fwd", "rev", "js", "hellinger", "tv"] + [f"alpha:{a:g}" for a in ALPHAS]


# ------------------------------------------------------------------ definitions (numpy, float64)


from simplex_reference import finite_differences, softmax as _softmax  # noqa: E402


def ref_divergence(s, w, name):
    """D(w, P) per group from its definition, P = softmax(s)."""
    p = _softmax(s)
    if name == "fwd":
        return (w * np.log(w / p)).sum(-1)
    if name == "rev":
        return (p * np.log(p / w)).sum(-1)
    if name == "js":
        m = (p + w) / 2
        return 0.5 * ((p * np.log(p / m)).sum(-1) + (w * np.log(w / m)).sum(-1))
    if name == "hellinger":
        return ((np.sqrt(w) - np.sqrt(p)) ** 2).sum(-1)
    if name == "tv":
        return 0.5 * np.abs(w - p).sum(-1)
    a = float(name.split(":")[1])
    if a == 1.0:
        return ref_divergence(s, w, "fwd")
    if a == 0.0:
        return ref_divergence(s, w, "rev")
    # sum_k w^a P^(1-a) - 1 = sum_k P (exp(a log(w/P)) - 1) (P sums to 1): the same value without the
    # cancellation that a near 0 or 1 divides by a(a - 1) and finite differences then divide by h again
    return (p * np.expm1(a * np.log(w / p))).sum(-1) / (a * (a - 1))


def ref_coefficients(s, w, name, h=1e-6):
    return finite_differences(lambda x: ref_divergence(x, w, name), s, h)


@st.composite
def groups(draw, max_k=16):
    g, k = draw(st.integers(1, 4)), draw(st.integers(2, max_k))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    s = rng.normal(0, 0.5, size=(g, k))
    w = _softmax(rng.normal(0, draw(st.sampled_from([0.3, 1.0, 3.0])), size=(g, k)))
    return s, w


# ------------------------------------------------------------------ values and coefficients, float64


@settings(max_examples=40, deadline=None)
@given(groups(), st.sampled_from(NAMES))
def test_values_match_the_definitions(data, name):
    s, w = data
    got = lw.listwise_divergence(T(s), T(w), name).numpy()
    np.testing.assert_allclose(got, ref_divergence(s, w, name), rtol=1e-9, atol=1e-13)
    assert (got >= -1e-13).all()


@settings(max_examples=40, deadline=None)
@given(groups(), st.sampled_from(NAMES))
def test_closed_form_coefficients_equal_autograd_and_finite_differences(data, name):
    s, w = data
    assert lw.resolve_divergence(name).coefficients is not None, "every built-in divergence has a closed form"
    c = lw.listwise_coefficients(T(s), T(w), name)
    x = T(s).requires_grad_(True)
    lw.listwise_divergence(x, T(w), name).sum().backward()
    torch.testing.assert_close(c, x.grad, rtol=1e-9, atol=1e-12)
    fd = ref_coefficients(s, w, name)
    np.testing.assert_allclose(c.numpy(), fd, rtol=1e-5, atol=1e-7 * max(1.0, np.abs(fd).max()))
    np.testing.assert_allclose(c.sum(-1).numpy(), 0.0, atol=1e-11 * max(1.0, np.abs(fd).max()))


@pytest.mark.parametrize("name", NAMES)
def test_coefficients_vanish_at_the_target(name):
    s = T(np.random.default_rng(0).normal(size=(3, 6)))
    w = torch.softmax(s, -1)
    assert lw.listwise_coefficients(s, w, name).abs().max() < 1e-12
    assert lw.listwise_divergence(s, w, name).abs().max() < 1e-12


def test_alpha_one_and_zero_are_forward_and_reverse_kl():
    s = T(np.random.default_rng(1).normal(size=(4, 8)))
    w = torch.softmax(T(np.random.default_rng(2).normal(size=(4, 8)) * 2), -1)
    for a, kl in (("1", "fwd"), ("1.0", "fwd"), ("0", "rev"), ("-0.0", "rev")):
        assert torch.equal(lw.listwise_divergence(s, w, f"alpha:{a}"), lw.listwise_divergence(s, w, kl))
        assert torch.equal(lw.listwise_coefficients(s, w, f"alpha:{a}"), lw.listwise_coefficients(s, w, kl))
    # alpha:0.5 = 4 (1 - BC) = 2 x squared Hellinger, value and coefficients
    torch.testing.assert_close(lw.listwise_divergence(s, w, "alpha:0.5"), 2 * lw.listwise_divergence(s, w, "hellinger"))
    torch.testing.assert_close(lw.listwise_coefficients(s, w, "alpha:0.5"),
                               2 * lw.listwise_coefficients(s, w, "hellinger"))


@pytest.mark.parametrize("limit, kl", [(0.0, "rev"), (1.0, "fwd")])
@pytest.mark.parametrize("offset", [1e-13, 1e-10, 1e-7, 1e-5])
def test_alpha_is_continuous_through_its_limits(limit, kl, offset):
    """Near a = 0 and a = 1 the expm1 forms follow the KL limits to O(|a - limit|): no 0/0, no lost digits."""
    s = T(np.random.default_rng(3).normal(size=(5, 8)))
    w = torch.softmax(T(np.random.default_rng(4).normal(size=(5, 8)) * 3), -1)
    d_kl, c_kl = lw.listwise_divergence(s, w, kl), lw.listwise_coefficients(s, w, kl)
    for a in (limit - offset, limit + offset):
        d = lw.listwise_divergence(s, w, f"alpha:{a!r}")
        c = lw.listwise_coefficients(s, w, f"alpha:{a!r}")
        tol = 50 * offset + 1e-14
        assert float((d - d_kl).abs().max()) < tol * float(d_kl.abs().max()), (a, d, d_kl)
        assert float((c - c_kl).abs().max()) < tol * float(c_kl.abs().max()), a
    if offset >= 1e-7:  # far enough for the plain definition to keep its digits: it agrees too
        a = limit + offset
        np.testing.assert_allclose(lw.listwise_divergence(s, w, f"alpha:{a!r}").numpy(),
                                   ref_divergence(s.numpy(), w.numpy(), f"alpha:{a!r}"), rtol=1e-6)


# ------------------------------------------------------------------ float32, near one-hot targets


@pytest.mark.parametrize("name", NAMES)
def test_float32_is_stable_for_near_one_hot_targets(name):
    """w* ~ one-hot (logit gaps up to 80: w_min ~ 1e-35, still a float32 normal): float32 values and
    coefficients, closed form and autograd alike, agree with float64 to float32 precision."""
    rng = np.random.default_rng(5)
    s = T(rng.normal(0, 0.2, size=(64, 8)))
    logits = np.zeros((64, 8))
    logits[:, 0] = np.linspace(5, 80, 64)
    w = torch.softmax(T(logits), -1)
    a = float(name.split(":")[1]) if name.startswith("alpha:") else None
    if a is not None and a < 0:  # (w/P)^a ~ e^(80|a|): float32 overflows where the value itself is > 1e38
        keep = slice(0, 64 if -a * 80 < 80 else 40)
        s, w = s[keep], w[keep]
    v64, c64 = lw.listwise_divergence(s, w, name), lw.listwise_coefficients(s, w, name)
    v32, c32 = lw.listwise_divergence(s.float(), w.float(), name), lw.listwise_coefficients(s.float(), w.float(), name)
    assert v32.dtype == c32.dtype == torch.float32
    assert torch.isfinite(v32).all() and torch.isfinite(c32).all()
    # per group, relative to its largest |c|: float32 rounds exp(y) to ~|y| eps, so negative a, whose
    # (w/P)^a reaches e^77 here, gets a looser (still float32-sized) tolerance
    rel = 2e-5 if a is not None and a < 0 else 2e-6
    scale = c64.abs().amax(-1, keepdim=True)
    assert bool(((c32.double() - c64).abs() <= rel * scale + 1e-7).all())
    np.testing.assert_allclose(v32.double().numpy(), v64.numpy(), rtol=rel, atol=1e-6)
    x = s.float().clone().requires_grad_(True)
    lw.listwise_divergence(x, w.float(), name).sum().backward()
    assert bool(((x.grad.double() - c64).abs() <= 2.5 * rel * scale + 1e-7).all())


def test_exact_zeros_in_the_target_stay_finite():
    """A float32 softmax underflows to exactly 0 for logit gaps > ~104: every divergence stays finite
    (log 0 is read as the smallest normal number), the bounded ones within their bounds."""
    s = torch.tensor([[0.1, -0.2, 0.05, 0.0]])
    w = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    for name in NAMES:
        if name.startswith("alpha:-"):
            continue  # (w/P)^a with w = 0 and a < 0 is +inf: the divergence is infinite
        d, c = lw.listwise_divergence(s, w, name), lw.listwise_coefficients(s, w, name)
        assert torch.isfinite(d).all() and torch.isfinite(c).all(), name
        bound = lw.resolve_divergence(name).bound
        if bound is not None:
            assert float(c.abs().sum()) <= bound + 1e-6, name


# ------------------------------------------------------------------ bounds


def _extreme_groups(rng, n=200):
    for _ in range(n):
        k = int(rng.integers(2, 17))
        s = rng.normal(0, rng.choice([0.1, 1.0, 5.0]), size=(1, k))
        logits = rng.normal(0, rng.choice([0.5, 3.0, 30.0]), size=(1, k))
        yield s, _softmax(logits)


@pytest.mark.parametrize("name, bound", [("fwd", 2.0), ("hellinger", 2.0), ("tv", 1.0), ("alpha:1", 2.0),
                                         ("alpha:0.5", 4.0), ("alpha:0.25", 8.0), ("alpha:0.8", 2.5)])
def test_bounded_divergences_keep_their_bound(name, bound):
    div = lw.resolve_divergence(name)
    assert div.bound == pytest.approx(bound)
    rng = np.random.default_rng(6)
    worst = 0.0
    for s, w in _extreme_groups(rng):
        worst = max(worst, float(lw.listwise_coefficients(T(s), T(w), name).abs().sum()))
    assert worst <= bound + 1e-12
    assert worst > 0.3 * bound, "the groups never came near the bound: the check would be vacuous"


@pytest.mark.parametrize("name", ["rev", "alpha:0", "alpha:2", "alpha:-0.5"])
def test_unbounded_divergences_claim_no_bound_and_indeed_grow(name):
    """rev and a <= 0 blow up as a target entry goes to 0 (log or a negative power of w*/P); a > 1 as a
    listwise probability goes to 0 under a spread target ((w*/P)^a)."""
    assert lw.resolve_divergence(name).bound is None
    if name == "alpha:2":
        cases = [(T([[x, -x]]), T([[0.5, 0.5]])) for x in (4.0, 8.0)]
    else:
        cases = [(T([[0.0, 0.0]]), T([[1 - eps, eps]])) for eps in (1e-4, 1e-12)]
    sums = [float(lw.listwise_coefficients(s, w, name).abs().sum()) for s, w in cases]
    assert sums[1] > 2 * sums[0] > 2.0, sums


# ------------------------------------------------------------------ TV's subgradient


def test_tv_subgradient_is_zero_where_p_equals_the_target():
    s_t = T(np.random.default_rng(7).normal(0, 0.3, size=(3, 5)))
    w = lw.gibbs_target(torch.ones(3, 5, dtype=torch.float64), "std", s_t)  # flat rewards: w* = softmax(s_t)
    c = lw.listwise_coefficients(s_t, w, "tv")
    assert torch.equal(c, torch.zeros_like(c))
    assert float(lw.listwise_divergence(s_t, w, "tv").abs().max()) == 0.0
    # the one-pass path (autograd of the value) agrees: zero gradient at P = w*
    x = s_t.clone().requires_grad_(True)
    lw.listwise_divergence(x, w, "tv").sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x.grad))
    # members that match get g = 0, the others +-1/2: c_k = P_k (g_k - E_P g)
    p = torch.softmax(T([[0.3, 0.0, -0.2, 0.1]]), -1)
    target = p.clone()
    target[0, 0] += 0.1
    target[0, 1] -= 0.1
    g = np.array([-0.5, 0.5, 0.0, 0.0])
    pn = p.numpy()[0]
    expect = pn * (g - (pn * g).sum())
    np.testing.assert_allclose(lw.listwise_coefficients(p.log(), target, "tv").numpy()[0], expect, rtol=1e-12,
                               atol=1e-15)


# ------------------------------------------------------------------ names and the family registry


@pytest.mark.parametrize("name, match", [
    ("alpha:nan", "a = nan must be a finite real number"),
    ("alpha:inf", "a = inf must be a finite real number"),
    ("alpha:", "is not a number"),
    ("alpha:half", "'half' is not a number"),
    ("alpha", r"unknown divergence 'alpha'; valid: fwd, hellinger, js, rev, tv or alpha:<a> \(any real a\)"),
    ("beta:2", "unknown divergence 'beta:2'"),
    ("", "unknown divergence ''"),
])
def test_bad_names_raise_clear_errors(name, match):
    with pytest.raises(ValueError, match=match):
        lw.listwise_divergence(torch.zeros(1, 3), torch.full((1, 3), 1 / 3), name)
    with pytest.raises(ValueError, match=match):
        lw.parse_divergence(name)


def test_a_new_family_works_everywhere_a_name_does(capsys):
    """A family registered with a parser: any parameter resolves, through the core functions,
    lpo-train's --lpo.divergence and lpo-explain; its bad parameters get the family's message."""
    from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse
    from openrlhf_lpo.cli.explain import main as explain

    def parse_power(text):
        p = float(text)
        if p <= 0:
            raise ValueError(f"p = {p} must be > 0")
        return p

    @lw.register_divergence_family("test_power", parse_power, "test_power:<p> (p > 0)")
    def power(name, p):  # sum_k |P_k - w_k|^(p+1) / (p+1), autograd coefficients
        return lw.Divergence(name, lambda log_p, w: ((log_p.exp() - w).abs() ** (p + 1)).sum(-1) / (p + 1))

    try:
        s = T([[0.2, -0.1, 0.4]])
        w = T([[0.5, 0.3, 0.2]])
        pnp, wnp = _softmax(s.numpy()), w.numpy()
        for p in (1.0, 2.5):
            got = lw.listwise_divergence(s, w, f"test_power:{p}")
            np.testing.assert_allclose(got.numpy(), (np.abs(pnp - wnp) ** (p + 1)).sum(-1) / (p + 1), rtol=1e-12)
            g = np.sign(pnp - wnp) * np.abs(pnp - wnp) ** p  # dD/dP, then through the softmax
            expect = pnp * (g - (pnp * g).sum(-1, keepdims=True))
            np.testing.assert_allclose(lw.listwise_coefficients(s, w, f"test_power:{p}").numpy(), expect, rtol=1e-10)
        assert "test_power:<p> (p > 0)" in lw.divergence_names()
        with pytest.raises(ValueError, match=r"divergence 'test_power:-1': p = -1.0 must be > 0"):
            lw.parse_divergence("test_power:-1")
        argv = ["--actor.model_name_or_path", "unused", "--reward.remote_url", "http://unused",
                "--actor.num_gpus_per_node", "1",
                "--rollout.n_samples_per_prompt", "4", "--rollout.batch_size", "2", "--train.batch_size", "8",
                "--train.micro_batch_size", "4", "--algo.advantage.estimator", "lpo"]
        assert build_parser_and_parse(argv + ["--lpo.divergence", "test_power:3"]).lpo.divergence == "test_power:3"
        explain(["--rewards", "1", "0", "0", "--divergence", "test_power:2"])
        assert "divergence=test_power:2" in capsys.readouterr().out
        with pytest.raises(SystemExit) as e:
            build_parser_and_parse(argv + ["--lpo.divergence", "test_power:0"])
        assert e.value.code == 2 and "--lpo.divergence: divergence 'test_power:0': p = 0.0 must be > 0" in (
            capsys.readouterr().err)
        with pytest.raises(ValueError, match="divergence family 'test_power' is already registered"):
            lw.register_divergence_family("test_power", parse_power, "x")(power)
    finally:
        lw.DIVERGENCE_FAMILIES.pop("test_power", None)
    with pytest.raises(ValueError, match="unknown divergence 'test_power:2'"):
        lw.parse_divergence("test_power:2")
    with pytest.raises(ValueError, match="must not contain ':'"):
        lw.register_divergence("a:b")(lambda log_p, w: log_p.sum(-1))


def test_plugins_are_imported_from_lpo_plugins(tmp_path, monkeypatch):
    (tmp_path / "lpo_test_plugin_mod.py").write_text(
        "from openrlhf_lpo.listwise import register_divergence\n"
        "@register_divergence('test_plugin_l2')\n"
        "def l2(log_p, target):\n"
        "    return ((log_p.exp() - target) ** 2).sum(-1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert lw.load_plugins("lpo_test_plugin_mod") == ["lpo_test_plugin_mod"]
        assert lw.listwise_divergence(torch.zeros(1, 2), torch.tensor([[1.0, 0.0]]), "test_plugin_l2").item() == \
            pytest.approx(0.5)
    finally:
        lw.DIVERGENCES.pop("test_plugin_l2", None)
    with pytest.raises(ImportError, match="LPO_PLUGINS names 'no_such_lpo_plugin'"):
        lw.load_plugins("no_such_lpo_plugin")
