"""The four registries of openrlhf_lpo.listwise (temperature, divergence, projection, PG estimator):
a new entry works end to end (the core functions, lpo-train's flags, lpo-explain, the two-pass
coefficients), a duplicate name is rejected and an unknown name's error lists the valid ones."""

import contextlib

import numpy as np
import pytest
import torch

from openrlhf_lpo import listwise as lw

T = lambda x: torch.tensor(np.asarray(x, dtype=np.float64))  # noqa: E731
R = np.array([[1.0, 0.0, 0.5, 0.0], [0.2, 0.9, 0.9, 0.1], [3.0, 3.0, 3.0, 3.0]])
S = np.random.default_rng(0).normal(scale=0.3, size=R.shape)


@contextlib.contextmanager
def registered(registry, register, name, fn):
    register(name)(fn)
    try:
        yield fn
    finally:
        registry.pop(name, None)


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _lpo_argv(*extra):
    return ["--actor.model_name_or_path", "unused", "--reward.remote_url", "http://unused", "--actor.num_gpus_per_node",
            "1", "--rollout.n_samples_per_prompt", "4", "--rollout.batch_size", "2", "--train.batch_size", "8",
            "--train.micro_batch_size", "4", "--algo.advantage.estimator", "lpo", *extra]


def test_new_temperature_end_to_end(capsys):
    from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse
    from openrlhf_lpo.cli.explain import main as explain

    def reward_range(rewards):  # tau = max - min (degenerate groups give 0; gibbs_target handles them)
        return rewards.amax(1, keepdim=True) - rewards.amin(1, keepdim=True)

    with registered(lw.TEMPERATURES, lw.register_temperature, "test_range", reward_range):
        tau = lw.group_temperature(T(R), "test_range")
        np.testing.assert_array_equal(tau.numpy()[:, 0], R.max(1) - R.min(1))
        w = lw.gibbs_target(T(R), tau, T(S))
        want = _softmax(R[:2] / (R.max(1) - R.min(1))[:2, None] + S[:2])
        np.testing.assert_allclose(w.numpy()[:2], want, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(w.numpy()[2], _softmax(S[2]), rtol=1e-12)  # equal rewards: softmax(s_t)
        assert lw.parse_temperature("test_range") == "test_range"
        args = build_parser_and_parse(_lpo_argv("--lpo.temperature", "test_range"))
        assert args.lpo.temperature == "test_range"
        explain(["--rewards", "1", "0", "0.5", "0", "--temperature", "test_range"])
        out = capsys.readouterr().out
        assert "temperature='test_range' -> tau=1" in out and "A_k(PG)" not in out  # no paired PG estimator
        with pytest.raises(ValueError, match="temperature 'test_range' is already registered"):
            lw.register_temperature("test_range")(reward_range)
        with pytest.raises(ValueError, match="valid: batch_std, loo, mean, one, std, test_range or a positive number"):
            lw.group_temperature(T(R), "median")
    with pytest.raises(SystemExit) as e:  # gone again: the CLI names the flag and the valid modes
        build_parser_and_parse(_lpo_argv("--lpo.temperature", "test_range"))
    assert e.value.code == 2 and "--lpo.temperature: unknown temperature 'test_range'; valid: batch_std, loo, mean, one, std" in (
        capsys.readouterr().err)


def test_new_divergence_end_to_end(capsys):
    """Registered before lpo-train builds its parser, a divergence is a --lpo.divergence choice; its
    coefficients (autograd) equal the gradient of the one-pass loss, so the two-pass path is exact."""
    from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse

    def sq_hellinger(log_p, target):
        return ((log_p.exp().sqrt() - target.sqrt()) ** 2).sum(-1)

    with registered(lw.DIVERGENCES, lw.register_divergence, "test_hellinger", sq_hellinger):
        args = build_parser_and_parse(_lpo_argv("--lpo.divergence", "test_hellinger"))
        assert args.lpo.divergence == "test_hellinger"
        w = lw.gibbs_target(T(R), "std")
        s = T(S).requires_grad_(True)
        lw.listwise_loss(s, w, "test_hellinger").backward()  # mean over the G groups
        c = lw.listwise_coefficients(T(S), w, "test_hellinger")
        torch.testing.assert_close(s.grad * R.shape[0], c, rtol=1e-12, atol=1e-15)
        p = _softmax(S)  # independent: d/ds of sum (sqrt P - sqrt w)^2
        dldp = 1 - np.sqrt(w.numpy() / p)
        np.testing.assert_allclose(c.numpy(), p * (dldp - (p * dldp).sum(-1, keepdims=True)), rtol=1e-10, atol=1e-13)
        with pytest.raises(ValueError, match="divergence 'test_hellinger' is already registered"):
            lw.register_divergence("test_hellinger")(sq_hellinger)
        with pytest.raises(ValueError, match="valid: fwd, hellinger, js, rev, test_hellinger, tv or alpha:<a>"):
            lw.listwise_divergence(T(S), w, "chi2")
    with pytest.raises(SystemExit) as e:  # gone again: the CLI names the flag and the valid names
        build_parser_and_parse(_lpo_argv("--lpo.divergence", "test_hellinger"))
    assert e.value.code == 2 and ("--lpo.divergence: unknown divergence 'test_hellinger'; valid: fwd, hellinger, js, "
                                  "rev, tv or alpha:<a> (any real a)") in capsys.readouterr().err


@pytest.mark.parametrize("projection", ["listwise", "pointwise", "test_l2"])
def test_projection_coefficients_give_the_projection_gradient(projection):
    """The two-pass surrogate's c for every projection (built-in or registered) is d(per-group loss)/ds:
    pointwise gives -w* (not the divergence's P - w*)."""

    def l2(log_ratio, target, divergence):  # a registered projection: squared distance of P to w*
        return ((torch.softmax(log_ratio, -1) - target) ** 2).sum(-1)

    ctx = registered(lw.PROJECTIONS, lw.register_projection, "test_l2", l2) if projection == "test_l2" \
        else contextlib.nullcontext()
    with ctx:
        w = lw.gibbs_target(T(R), "std")
        for div in ("fwd", "rev"):
            s = T(S).requires_grad_(True)
            (lw.listwise_loss(s, w, div, projection) * R.shape[0]).backward()
            c = lw.projection_coefficients(T(S), w, div, projection)
            torch.testing.assert_close(c, s.grad, rtol=1e-12, atol=1e-15)
            assert not c.requires_grad
        if projection == "pointwise":
            np.testing.assert_array_equal(c.numpy(), -w.numpy())
            assert (c - lw.listwise_coefficients(T(S), w, "fwd")).abs().max() > 0.1  # not the divergence's


def test_new_projection_registry_and_cli(capsys):
    from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse

    def l1(log_ratio, target, divergence):
        return (torch.softmax(log_ratio, -1) - target).abs().sum(-1)

    with registered(lw.PROJECTIONS, lw.register_projection, "test_l1", l1):
        w = lw.gibbs_target(T(R), "one")
        got = lw.listwise_loss(T(S), w, "fwd", "test_l1")
        assert float(got) == pytest.approx(np.abs(_softmax(S) - w.numpy()).sum(-1).mean(), rel=1e-12)
        args = build_parser_and_parse(_lpo_argv("--lpo.projection", "test_l1"))
        assert args.lpo.projection == "test_l1"
        with pytest.raises(ValueError, match="projection 'test_l1' is already registered"):
            lw.register_projection("test_l1")(l1)
        with pytest.raises(ValueError, match="valid: listwise, pointwise, test_l1"):
            lw.listwise_loss(T(S), w, "fwd", "ranked")
        with pytest.raises(ValueError, match="valid: listwise, pointwise, test_l1"):
            lw.projection_coefficients(T(S), w, "fwd", "ranked")
    with pytest.raises(SystemExit) as e:
        build_parser_and_parse(_lpo_argv("--lpo.projection", "test_l1"))
    assert e.value.code == 2 and "invalid choice: 'test_l1'" in capsys.readouterr().err


def test_new_pg_estimator():
    def loo(rewards):  # RLOO: R_k - mean of the others
        k = rewards.shape[1]
        return (rewards - (rewards.sum(1, keepdim=True) - rewards) / (k - 1))

    with registered(lw.PG_ESTIMATORS, lw.register_pg_estimator, "test_rloo", loo):
        k = R.shape[1]
        want = R - (R.sum(1, keepdims=True) - R) / (k - 1)
        np.testing.assert_allclose(lw.pg_advantages(T(R), "test_rloo").numpy(), want, rtol=1e-12, atol=1e-15)
        with pytest.raises(ValueError, match="PG estimator 'test_rloo' is already registered"):
            lw.register_pg_estimator("test_rloo")(loo)
        with pytest.raises(ValueError, match="valid: dr_grpo, grpo, maxrl, reinforce_pp, rloo, test_rloo"):
            lw.pg_advantages(T(R), "ppo")
        with pytest.raises(ValueError, match="rewards"):  # the registry keeps the input checks
            lw.pg_advantages(T(R[:, :1]), "test_rloo")
    with pytest.raises(ValueError, match="unknown PG estimator 'test_rloo'"):
        lw.pg_advantages(T(R), "test_rloo")
