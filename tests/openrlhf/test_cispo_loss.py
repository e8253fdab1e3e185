"""CISPO as ``--actor.policy_loss_type cispo`` (openrlhf_lpo/openrlhf/cispo.py, patch point policy-loss-types)
against a hand-written float64 formula, through upstream's own classes: ``PolicyLoss`` as the stock
``ActorPPOTrainer`` builds it (inside the scoped swap), one real ``ppo_train`` step of the stock trainer, the
Megatron actor's pg loss and the lpo-train CLI.

CISPO (MiniMax-M1, arXiv 2506.13585, Eq. 4): loss = -(1/N) sum_t sg(clip(r_t, 1 - lo, 1 + hi)) A_t log pi(y_t).
"""

import copy
import math

import numpy as np
import pytest
import torch

from lpo_fixtures import (CPUStrategy, cpu_cuda_queries, make_actor, make_experiences, make_rollout_samples,
                          make_trainer, max_abs, max_abs_diff, parse_args, rollout_sample, run_lpo_step,
                          equal_length_samples)
from openrlhf.models import PolicyLoss
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
from openrlhf.trainer.ray import ppo_actor
from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

import openrlhf_lpo.cli.policy_loss_types  # noqa: F401  (the flag group; lpo-train imports it as a plugin)
from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse
from openrlhf_lpo.openrlhf.cispo import POLICY_LOSS_TYPES, ExtendedPolicyLoss, policy_loss_types

K, G = 4, 4


def ref_cispo(lp, old, adv, mask, lo, hi, token_mean=True, n_tokens=None, dp=1):
    """The loss, d loss / d log pi and the clip fraction, float64 numpy, written from the paper's Eq. 4."""
    lp, old, adv, mask = (np.asarray(x, dtype=np.float64) for x in (lp, old, adv, mask))
    r = np.exp(lp - old)
    weight = np.minimum(np.maximum(r, max(1.0 - lo, 0.0)), 1.0 + hi)
    per_token = -weight * adv * lp
    if token_mean:
        n = mask.sum() if n_tokens is None else n_tokens
        loss = (per_token * mask).sum() / n * dp
        grad = -weight * adv * mask / n * dp
    else:  # every response weighs the same; upstream's aggregate_loss divides by (token count + 1e-8)
        counts = mask.sum(axis=1, keepdims=True) + 1e-8
        rows = (counts[:, 0] > 1e-8).sum()
        loss = ((per_token * mask).sum(axis=1) / counts[:, 0]).sum() / rows
        grad = -weight * adv * mask / counts / rows
    outside = ((r < 1.0 - lo) | (r > 1.0 + hi)).astype(np.float64)
    return loss, grad, (outside * mask).sum() / mask.sum()


def _tensors(seed=0, b=5, t=7, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3 - 0.05
    old = lp + spread * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t).clone()
    mask = (torch.rand(b, t, generator=g) > 0.25).double()
    mask[:, 0] = 1.0
    return lp, old, adv, mask


def _stock_kwargs(lo, hi, token_level=True, kind="cispo"):  # what ActorPPOTrainer.__init__ passes
    return dict(clip_eps_low=lo, clip_eps_high=hi, dual_clip=None, token_level_loss=token_level,
                policy_loss_type=kind, is_correction_level="off", is_correction_mode="mask",
                is_correction_gating="ratio", is_correction_threshold=[0.5, 5.0])


@pytest.mark.parametrize("lo,hi,token_level", [(0.2, 0.28, True), (1.0, 3.0, True), (0.1, 0.1, False)])
def test_cispo_through_the_stock_trainers_policy_loss_name(lo, hi, token_level):
    """Inside the scoped swap, ``ppo_actor.PolicyLoss`` (the name ActorPPOTrainer looks up) computes CISPO:
    value, gradient, clip fraction and ppo_kl equal the float64 formula, with upstream's global normalisers."""
    stock = ppo_actor.PolicyLoss
    with policy_loss_types():
        fn = ppo_actor.PolicyLoss(**_stock_kwargs(lo, hi, token_level))
    assert ppo_actor.PolicyLoss is stock and isinstance(fn, ExtendedPolicyLoss) and isinstance(fn, PolicyLoss)
    lp, old, adv, mask = _tensors(seed=1 if token_level else 2)
    x = lp.clone().requires_grad_(True)
    n_global, dp = float(mask.sum()) * 3, 2  # this rank's share of a larger window, as training_step passes
    kw = dict(dp_size=dp, batch_num_tokens=torch.tensor(n_global), global_batch_size=torch.tensor(5.0)) \
        if token_level else {}
    loss, clip_ratio, ppo_kl, vllm_kl, filtered = fn(x, old, adv, action_mask=mask, rollout_log_probs=None, **kw)
    loss.backward()
    want, grad, frac = ref_cispo(lp, old, adv, mask, lo, hi, token_level,
                                 n_tokens=n_global if token_level else None, dp=dp if token_level else 1)
    assert float(loss.detach()) == pytest.approx(want, rel=1e-12)
    np.testing.assert_allclose(x.grad.numpy(), grad, rtol=1e-12, atol=1e-15)
    assert float(clip_ratio) == pytest.approx(frac, rel=1e-12)
    if lo < 1.0:
        assert 0.0 < frac < 1.0  # both kinds of tokens present: the clip is exercised
    assert float(ppo_kl) == pytest.approx(float(((old - lp) * mask).sum() / mask.sum()), rel=1e-12)
    assert vllm_kl is None and filtered is None


def test_cispo_keeps_the_gradient_that_ppo_clips_away():
    """A token with r > 1 + hi and A > 0: PPO's clipped objective gives it zero gradient, CISPO gives it
    -(1 + hi) A / N (the weight is capped, the token is kept)."""
    lp = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    old = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)  # r = e^0.5 = 1.65 > 1.28; r = 1
    adv, mask = torch.full((1, 2), 2.0, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)
    grads = {}
    for kind in ("ppo", "cispo"):
        x = lp.clone().requires_grad_(True)
        ExtendedPolicyLoss(**_stock_kwargs(0.2, 0.28, kind=kind))(x, old, adv, action_mask=mask)[0].backward()
        grads[kind] = x.grad[0].tolist()
    assert grads["ppo"][0] == 0.0 and grads["cispo"][0] == pytest.approx(-1.28 * 2.0 / 2)
    assert grads["ppo"][1] == pytest.approx(-2.0 / 2) and grads["cispo"][1] == pytest.approx(-2.0 / 2)


@pytest.mark.parametrize("mode", ["clip", "mask"])
def test_cispo_with_the_token_level_train_rollout_correction(mode):
    """--algo.advantage.is_correction_level token: each token's weight is clip(r) x c_t with c_t = clip(pi_old/mu)
    (clip) or pi_old/mu inside [low, high], else 0 (mask): the float64 formula; and at r = 1 the gradient,
    vllm_kl and filter fraction are upstream PPO's own correction (its implementation, not ours)."""
    lp, old, adv, mask = _tensors(seed=6)
    g = torch.Generator().manual_seed(7)
    rollout = old + 0.6 * torch.randn(old.shape, generator=g, dtype=torch.float64)
    kw = _stock_kwargs(0.2, 0.28)
    kw.update(is_correction_level="token", is_correction_mode=mode, is_correction_threshold=[0.7, 1.5])
    x = lp.clone().requires_grad_(True)
    loss, _, _, vllm_kl, filtered = ExtendedPolicyLoss(**kw)(x, old, adv, action_mask=mask, rollout_log_probs=rollout)
    loss.backward()
    r, c = np.exp((lp - old).numpy()), np.exp((old - rollout).numpy())
    out = (c < 0.7) | (c > 1.5)
    coef = np.clip(c, 0.7, 1.5) if mode == "clip" else np.where(out, 0.0, c)
    weight = np.clip(r, 0.8, 1.28) * coef
    m, a = mask.numpy(), adv.numpy()
    assert float(loss.detach()) == pytest.approx(float((-weight * a * lp.numpy() * m).sum() / m.sum()), rel=1e-12)
    np.testing.assert_allclose(x.grad.numpy(), -weight * a * m / m.sum(), rtol=1e-12, atol=1e-15)
    assert float(filtered) == pytest.approx(float((out * m).sum() / m.sum()), rel=1e-12) and 0 < float(filtered) < 1
    # on-policy (r = 1): upstream's PPO with the same correction has the same gradient and statistics
    grads, stats = [], []
    for kind in ("ppo", "cispo"):
        x = old.clone().requires_grad_(True)
        kw["policy_loss_type"] = kind
        out_k = ExtendedPolicyLoss(**kw)(x, old, adv, action_mask=mask, rollout_log_probs=rollout)
        out_k[0].backward()
        grads.append(x.grad)
        stats.append((float(out_k[3]), float(out_k[4])))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-12, atol=1e-15)
    assert stats[0] == pytest.approx(stats[1], rel=1e-12)


@pytest.mark.parametrize("kind,token_level", [("ppo", True), ("ppo", False), ("gspo", False)])
def test_stock_types_go_to_the_stock_forward_unchanged(kind, token_level):
    lp, old, adv, mask = _tensors(seed=3)
    outs = []
    for cls in (PolicyLoss, ExtendedPolicyLoss):
        x = lp.clone().requires_grad_(True)
        out = cls(**_stock_kwargs(0.2, 0.28, token_level, kind))(x, old, adv, action_mask=mask)
        out[0].backward()
        outs.append((out, x.grad))
    (a, ga), (b, gb) = outs
    assert torch.equal(a[0], b[0]) and torch.equal(ga, gb) and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])


def test_megatron_pg_loss_computes_cispo_as_a_sum():
    """The Megatron actor's pg loss (LossSpec.policy_loss_type cispo): the masked token sum of Eq. 4 and the
    token count (megatron divides by the global count), or per-response means and the response count."""
    from openrlhf_lpo.megatron.losses import LossSpec, count_key, get_policy_loss

    lp, old, adv, mask = _tensors(seed=4)
    for agg in ("token-mean", "seq-mean-token-mean"):
        spec = LossSpec(name="pg", clip_eps=(0.2, 0.28), loss_agg_mode=agg, policy_loss_type="cispo")
        x = lp.clone().requires_grad_(True)
        mb = {"action_mask": mask, "advantages": adv[:, 0].clone(), "old_log_probs": old}
        total, count, stats = get_policy_loss("pg")(x, mb, spec)
        total.backward()
        _, grad, frac = ref_cispo(lp, old, adv, mask, 0.2, 0.28, agg == "token-mean")
        if agg == "token-mean":
            n = float(mask.sum())
            assert int(count) == n and count_key(spec) == "n_tokens"
            np.testing.assert_allclose(x.grad.numpy(), grad * n, rtol=1e-12, atol=1e-15)
            # the clip ratio every method logs (core/loss.py token_statistics, computed beside the loss by the actor):
            # CISPO's capped tokens are the tokens outside the band
            from openrlhf_lpo.core.loss import token_statistics

            band = token_statistics(lp, old, mask, (0.2, 0.28))
            assert float(band["out_of_band"]) == pytest.approx(frac * n, rel=1e-12)
        else:
            rows = int((mask.sum(-1) > 0).sum())
            assert int(count) == rows and count_key(spec) == "n_nonempty"
            np.testing.assert_allclose(x.grad.numpy(), grad * rows, rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match="--actor.dual_clip"):
        get_policy_loss("pg")(lp, mb, LossSpec(name="pg", policy_loss_type="cispo", dual_clip=3.0))
    # the token-level train/rollout correction, as on the DeepSpeed actor
    rollout = old + 0.5 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    spec = LossSpec(name="pg", clip_eps=(0.2, 0.28), loss_agg_mode="token-mean", policy_loss_type="cispo",
                    is_correction=("token", "clip", "ratio", (0.7, 1.5)))
    x = lp.clone().requires_grad_(True)
    total, _, stats = get_policy_loss("pg")(x, dict(mb, rollout_log_probs=rollout), spec)
    total.backward()
    c = np.clip(np.exp((old - rollout).numpy()), 0.7, 1.5)
    weight = np.clip(np.exp((lp - old).numpy()), 0.8, 1.28) * c
    np.testing.assert_allclose(x.grad.numpy(), -weight * adv.numpy() * mask.numpy(), rtol=1e-12, atol=1e-15)
    from openrlhf_lpo.core.loss import token_statistics

    tok = token_statistics(lp, old, mask, (0.2, 0.28), rollout, (0.7, 1.5))
    assert float(tok["vllm_kl_sum"]) == pytest.approx(float(((rollout - old) * mask).sum()), rel=1e-12)
    assert float(tok["filtered"]) == float((((old - rollout).exp() < 0.7) | ((old - rollout).exp() > 1.5)).double()
                                           .mul(mask).sum())
    with pytest.raises(ValueError, match="--algo.advantage.is_correction_level seq"):
        get_policy_loss("pg")(lp, mb, LossSpec(name="pg", policy_loss_type="cispo",
                                               is_correction=("seq", "mask", "ratio", (0.5, 5.0))))


def _cispo_args(model_dir, *extra, micro=2, train_batch=None):
    return parse_args(model_dir, estimator="group_norm", micro=micro, train_batch=train_batch,
                      extra=["--actor.policy_loss_type", "cispo", *extra])


def test_cispo_step_of_the_stock_actor_trainer_equals_the_float64_reference(tiny_model_dir, gloo_world1):
    """One optimizer step of the stock ActorPPOTrainer.ppo_train (shuffled micro-batches of 2, global token
    mean) with old log-probs off the policy (ratios inside and outside the band [0.9, 1.1]): the gradient is
    that of -(1/N) sum sg(clip(r)) A log pi over the whole batch, by autograd of the formula on a fresh copy."""
    args = _cispo_args(tiny_model_dir, "--actor.eps_clip_low_high", "0.1", "0.1", "--actor.loss_agg_mode",
                       "token-mean")
    assert args.actor.policy_loss_type == "cispo"
    actor = make_actor(tiny_model_dir)
    state = copy.deepcopy(actor.model.state_dict())
    exps = make_experiences(args, CPUStrategy(args), actor, make_rollout_samples(G, K, seed=8), noise=0.3,
                            maker_cls=RemoteExperienceMaker)
    strategy = CPUStrategy(args)
    with policy_loss_types():
        trainer = make_trainer(ActorPPOTrainer, args, strategy, actor)
    assert type(trainer.actor_loss_fn) is ExtendedPolicyLoss and trainer.actor_loss_fn.policy_loss_type == "cispo"
    for e in exps:
        trainer.replay_buffer.append(copy.deepcopy(e))
    torch.manual_seed(0)
    with cpu_cuda_queries("cpu"):
        status = trainer.ppo_train(0.0)
    assert len(strategy.step_grads) == 1
    assert 0.05 < status["ppo_clip_ratio"] < 0.95  # the band is exercised

    # reference: autograd of the written-out formula, float64, the same parameters
    actor.model.load_state_dict(state)
    actor.model.zero_grad(set_to_none=True)
    n = sum(float(e.action_mask.sum()) for e in exps)
    total = 0.0
    for e in exps:
        lp = actor(e.sequences, e.action_mask, attention_mask=e.attention_mask)
        r = torch.exp(lp.detach() - e.action_log_probs)
        weight = torch.minimum(torch.maximum(r, torch.tensor(0.9, dtype=r.dtype)), torch.tensor(1.1, dtype=r.dtype))
        total = total - (weight * e.advantages * lp * e.action_mask).sum() / n
    total.backward()
    ref = [p.grad for p in actor.parameters() if p.requires_grad]
    scale = max_abs(ref)
    assert scale > 1e-3
    assert max_abs_diff(strategy.step_grads[0], ref) < 1e-10 * scale


def _equal_length_samples(seed, length=6):
    return equal_length_samples(seed, G, K, length)


def test_prop1_on_policy_cispo_equals_lpo_rev_with_the_grpo_temperature(tiny_model_dir, gloo_world1):
    """On-policy, equal lengths: the stock trainer's CISPO step (token mean) has the gradient of LPO-rev with
    tau = group std through the LPO trainer (Prop. 1; CISPO's advantage is GRPO's, its weight clip(1) = 1)."""
    samples = _equal_length_samples(seed=9)
    actor = make_actor(tiny_model_dir)
    state = copy.deepcopy(actor.model.state_dict())
    lpo_args = parse_args(tiny_model_dir, micro=2, extra=["--lpo.divergence", "rev", "--lpo.temperature", "std"])
    lpo_grads, _, _ = run_lpo_step(lpo_args, actor, make_experiences(lpo_args, CPUStrategy(lpo_args), actor, samples))

    actor.model.load_state_dict(state)
    args = _cispo_args(tiny_model_dir, "--actor.eps_clip_low_high", "1.0", "3.0", "--actor.loss_agg_mode",
                       "token-mean")
    exps = make_experiences(args, CPUStrategy(args), actor, samples, maker_cls=RemoteExperienceMaker)
    strategy = CPUStrategy(args)
    with policy_loss_types():
        trainer = make_trainer(ActorPPOTrainer, args, strategy, actor)
    for e in exps:
        trainer.replay_buffer.append(copy.deepcopy(e))
    with cpu_cuda_queries("cpu"):
        trainer.ppo_train(0.0)
    scale = max_abs(strategy.step_grads[0])
    assert scale > 1e-3
    # upstream's experience maker computes the advantages in float32 (and divides by std + 1e-9), LPO's target
    # is float64: agreement to float32 rounding
    assert max_abs_diff(lpo_grads[0], strategy.step_grads[0]) < 1e-6 * scale


def test_cli_accepts_cispo_and_names_the_flag_of_each_refusal(tiny_model_dir, capsys):
    assert sorted(POLICY_LOSS_TYPES) == ["cispo", "clip_cov", "kl_cov"]
    args = _cispo_args(tiny_model_dir, "--actor.eps_clip_low_high", "1.0", "3.0")
    assert args.actor.policy_loss_type == "cispo" and tuple(args.actor.eps_clip_low_high) == (1.0, 3.0)
    token = _cispo_args(tiny_model_dir, "--algo.advantage.is_correction_level", "token",
                        "--algo.advantage.is_correction_mode", "clip")  # the async recipe's correction
    assert token.algo.advantage.is_correction_level == "token"
    cases = [
        (["--actor.eps_clip_low_high", "-0.1", "0.2"], "--actor.eps_clip_low_high"),
        (["--actor.dual_clip", "3.0"], "--actor.dual_clip"),
        (["--algo.advantage.is_correction_level", "seq"], "--algo.advantage.is_correction_level seq"),
        (["--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_gating", "tv",
          "--algo.advantage.is_correction_threshold", "0.5"], "--algo.advantage.is_correction_gating tv"),
    ]
    for extra, flag in cases:
        with pytest.raises(SystemExit) as e:
            _cispo_args(tiny_model_dir, *extra)
        assert e.value.code == 2 and flag in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # lpo replaces the policy loss
        parse_args(tiny_model_dir, extra=["--actor.policy_loss_type", "cispo"])
    assert e.value.code == 2 and "--actor.policy_loss_type cispo is not supported with --algo.advantage.estimator " \
                                 "lpo" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _cispo_args(tiny_model_dir, "--actor.policy_loss_type", "ratio")
    assert "invalid choice: 'ratio'" in capsys.readouterr().err
    assert math.isfinite(args.actor.eps_clip_low_high[1])
