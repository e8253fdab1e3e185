"""Clip-Cov and KL-Cov (Cui et al. 2025, arXiv 2505.22617, Sec. 5) as ``--actor.policy_loss_type clip_cov | kl_cov``
(core/covariance.py, registered in core/policy_loss.py) against float64 numpy written from the paper:

    Cov_i = (log pi_i - mean log pi)(A_i - mean A)      over a micro-batch's response tokens
    Clip-Cov: max(floor(r N), 1) tokens drawn at random among those with omega_low < Cov < omega_high (and a ratio
              PPO does not clip) get loss 0; the rest keep max(-r_i A_i, -clip(r_i, 1 - lo, 1 + hi) A_i)
    KL-Cov:   every token -r_i A_i; the max(floor(k N), 1) tokens of largest Cov add beta |log r_i|

The selection against brute force; the loss and its gradient through upstream's PolicyLoss name (the DeepSpeed actor)
and the Megatron actor's pg loss, which select the same tokens for the same micro-batch, seed and step; one real
step of the stock ActorPPOTrainer with each method file's flags; the flags.
"""

import copy
import itertools
import math

import numpy as np
import pytest
import torch

from lpo_fixtures import (CPUStrategy, cpu_cuda_queries, make_actor, make_experiences, make_rollout_samples,
                          make_trainer, max_abs, max_abs_diff, parse_args)
from recipe_flags import method_flags
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
from openrlhf.trainer.ray import ppo_actor
from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

from openrlhf_lpo.core import covariance
from openrlhf_lpo.core.policy_loss import POLICY_LOSS_TYPES
from openrlhf_lpo.openrlhf.cispo import ExtendedPolicyLoss, bind_policy_loss, policy_loss_types

K, G = 4, 4


# ----------------------------------------------------------------------------- float64 references


def ref_cov(lp, adv, mask):
    lp, adv, m = (np.asarray(x, dtype=np.float64) for x in (lp, adv, mask))
    n = m.sum()
    return (lp - (lp * m).sum() / n) * (adv - (adv * m).sum() / n) * m


def ref_top(cov, mask, frac):
    """The max(floor(frac N), 1) masked tokens of largest Cov, ties to the earlier token (row-major), as a set."""
    flat = [(-float(c), i) for i, (c, m) in enumerate(zip(np.ravel(cov), np.ravel(mask))) if m]
    k = min(max(int(frac * len(flat)), 1), len(flat))
    return {i for _, i in sorted(flat)[:k]}


def ref_candidates(cov, mask, ppo_clipped, lower, upper):
    return {i for i, (c, m, p) in enumerate(zip(np.ravel(cov), np.ravel(mask), np.ravel(ppo_clipped)))
            if m and not p and lower < c < upper}


def _tensors(seed=0, b=6, t=9, spread=0.3, adv_scale=2.0):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 4 - 0.05
    old = lp + spread * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = (adv_scale * torch.randn(b, 1, generator=g, dtype=torch.float64)).expand(b, t).clone()
    mask = (torch.rand(b, t, generator=g) > 0.2).double()
    mask[:, 0] = 1.0
    return lp, old, adv, mask


def _stock_kwargs(kind, lo=0.2, hi=0.2, token_level=True, **kw):  # what ActorPPOTrainer.__init__ passes
    d = dict(clip_eps_low=lo, clip_eps_high=hi, dual_clip=None, token_level_loss=token_level, policy_loss_type=kind,
             is_correction_level="off", is_correction_mode="mask", is_correction_gating="ratio",
             is_correction_threshold=[0.5, 5.0])
    d.update(kw)
    return d


def _flat_set(mask_tensor):
    return set(mask_tensor.reshape(-1).nonzero().reshape(-1).tolist())


# ----------------------------------------------------------------------------- the selection


@pytest.mark.parametrize("seed,frac", [(1, 2e-3), (2, 0.05), (3, 0.3), (4, 1.0)])
def test_covariance_and_kl_cov_top_k_against_brute_force(seed, frac):
    lp, _, adv, mask = _tensors(seed)
    lp = lp.round(decimals=1)  # ties in Cov: the earlier token wins
    cov = covariance.token_covariance(lp, adv, mask)
    np.testing.assert_allclose(cov.numpy(), ref_cov(lp, adv, mask), rtol=1e-12, atol=1e-15)
    assert _flat_set(covariance.kl_cov_selection(cov, mask, frac)) == ref_top(cov.numpy(), mask.numpy(), frac)


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_clip_cov_draws_the_right_number_of_band_tokens_uniformly_and_reproducibly(seed):
    lp, _, adv, mask = _tensors(seed, b=8, t=12)
    cov = covariance.token_covariance(lp, adv, mask)
    eligible = mask.bool().clone()
    eligible[0, :3] = False  # tokens PPO clips are not candidates
    cands = ref_candidates(cov.numpy(), mask.numpy(), (~eligible).numpy() & mask.bool().numpy(), 1.0, 5.0)
    assert len(cands) >= 4, "the fixture needs candidates in the band"
    n = int(mask.sum())
    for ratio in (2e-4, 0.02, 0.5):
        want = min(max(int(ratio * n), 1), len(cands))
        draws = [_flat_set(covariance.clip_cov_selection(cov, eligible, n, ratio, 1.0, 5.0, 42, step))
                 for step in range(400)]
        assert all(len(d) == want and d <= cands for d in draws)
        # seeded: the same inputs, seed and step give the same tokens; steps differ
        assert draws[3] == _flat_set(covariance.clip_cov_selection(cov, eligible, n, ratio, 1.0, 5.0, 42, 3))
        if want < len(cands):
            assert len({frozenset(d) for d in draws}) >= min(10, math.comb(len(cands), want))
            # uniform over the candidates: each is drawn in want/|cands| of the steps (binomial, 5 sigma)
            p = want / len(cands)
            for c in cands:
                freq = sum(c in d for d in draws) / len(draws)
                assert abs(freq - p) < 5 * np.sqrt(p * (1 - p) / len(draws)), (c, freq, p)
    other = covariance.clip_cov_selection(cov, eligible, n, 0.02, 1.0, 5.0, 43, 3)  # another --train.seed
    empty = covariance.clip_cov_selection(cov, eligible, n, 0.5, 50.0, 60.0, 42, 0)  # no token in the band
    assert not empty.any() and (other.sum() == max(int(0.02 * n), 1))


# ----------------------------------------------------------------------------- the loss and its gradient


def _deepspeed_loss(kind, options, seed, step, **kw):
    with policy_loss_types():
        fn = ppo_actor.PolicyLoss(**_stock_kwargs(kind, **kw))
    assert isinstance(fn, ExtendedPolicyLoss)
    fn.options, fn.seed, fn.step_source = dict(options), seed, (lambda: step)
    return fn


@pytest.mark.parametrize("kind,lo,hi,options", [
    ("clip_cov", 0.2, 0.2, {"clip_cov_ratio": 0.05, "clip_cov_lb": 0.3, "clip_cov_ub": 5.0}),
    ("clip_cov", 1.0, 1.0, {"clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0}),  # clip_cov.sh's band
    ("kl_cov", 0.2, 0.2, {"kl_cov_ratio": 0.1, "kl_cov_coef": 1.0}),
    ("kl_cov", 0.2, 0.2, {"kl_cov_ratio": 2e-3, "kl_cov_coef": 0.5}),
])
def test_loss_and_gradient_on_both_backends_equal_the_float64_formula(kind, lo, hi, options):
    from openrlhf_lpo.megatron.losses import LossSpec, get_policy_loss

    lp, old, adv, mask = _tensors(seed=11)
    seed, step = 7, 3
    ds = _deepspeed_loss(kind, options, seed, step, lo=lo, hi=hi)
    x = lp.clone().requires_grad_(True)
    n_global, dp = float(mask.sum()) * 2, 2  # a larger window's token count, as training_step passes
    loss, clip_ratio, ppo_kl, vllm_kl, filtered = ds(x, old, adv, action_mask=mask, dp_size=dp,
                                                     batch_num_tokens=torch.tensor(n_global),
                                                     global_batch_size=torch.tensor(6.0))
    loss.backward()

    r = np.exp((lp - old).numpy())
    a, m = adv.numpy(), mask.numpy()
    cov = ref_cov(lp, adv, mask)
    sel = np.zeros(m.size, dtype=bool)
    if kind == "kl_cov":
        sel[list(ref_top(cov, m, options["kl_cov_ratio"]))] = True
        sel = sel.reshape(m.shape)
        beta = options["kl_cov_coef"]
        per_token = -a * r + beta * np.abs(np.log(r)) * sel
        dtoken = -a * r + beta * np.sign(np.log(r)) * sel
    else:
        plain, clipped = -a * r, -a * np.clip(r, 1 - lo, 1 + hi)
        ppo_clipped = (clipped > plain) & (m > 0)
        cands = ref_candidates(cov, m, ppo_clipped, options["clip_cov_lb"], options["clip_cov_ub"])
        drawn = _flat_set(covariance.clip_cov_selection(torch.tensor(cov), mask.bool() & ~torch.tensor(ppo_clipped),
                                                        int(m.sum()), options["clip_cov_ratio"],
                                                        options["clip_cov_lb"], options["clip_cov_ub"], seed, step))
        assert drawn <= cands and len(drawn) == min(max(int(options["clip_cov_ratio"] * m.sum()), 1), len(cands))
        assert drawn, "the fixture needs a band token"
        sel[list(drawn)] = True
        sel = sel.reshape(m.shape)
        per_token = np.where(sel, 0.0, np.maximum(plain, clipped))
        dtoken = np.where(sel | ppo_clipped, 0.0, -a * r)
    want = (per_token * m).sum() / n_global * dp
    assert float(loss.detach()) == pytest.approx(want, rel=1e-12)
    np.testing.assert_allclose(x.grad.numpy(), dtoken * m / n_global * dp, rtol=1e-12, atol=1e-15)
    assert float(clip_ratio) == pytest.approx((sel * m).sum() / m.sum(), rel=1e-12) and float(clip_ratio) > 0
    assert vllm_kl is None and filtered is None

    # the Megatron actor's pg loss: the masked token sum and the token count, the same tokens for the same step
    spec = LossSpec(name="pg", clip_eps=(lo, hi), loss_agg_mode="token-mean", policy_loss_type=kind,
                    type_options=tuple(options.items()), seed=seed)
    from openrlhf_lpo.megatron.losses import policy_loss_module

    x2 = lp.clone().requires_grad_(True)
    mb = {"action_mask": mask, "advantages": adv[:, 0].clone(), "old_log_probs": old,
          "_policy_loss_fn": policy_loss_module(spec, step=step)}
    total, count, stats = get_policy_loss("pg")(x2, mb, spec)
    total.backward()
    assert int(count) == int(m.sum())
    np.testing.assert_allclose(x2.grad.numpy(), dtoken * m, rtol=1e-12, atol=1e-15)


def test_clip_cov_selection_depends_on_the_step_and_the_seed_the_same_way_on_both_backends():
    """Per (--train.seed, step) the two backends' losses detach the same tokens of the same micro-batch; another
    step or seed draws other tokens (a wide band: many candidates)."""
    from openrlhf_lpo.megatron.losses import LossSpec, get_policy_loss, policy_loss_module

    lp, old, adv, mask = _tensors(seed=12, b=8, t=12, spread=0.05)
    options = {"clip_cov_ratio": 0.05, "clip_cov_lb": -100.0, "clip_cov_ub": 100.0}
    spec = LossSpec(name="pg", clip_eps=(1.0, 1.0), loss_agg_mode="token-mean", policy_loss_type="clip_cov",
                    type_options=tuple(options.items()))

    def zero_grad_tokens(fn, megatron):
        x = lp.clone().requires_grad_(True)
        if megatron:
            mb = {"action_mask": mask, "advantages": adv[:, 0].clone(), "old_log_probs": old, "_policy_loss_fn": fn}
            get_policy_loss("pg")(x, mb, spec)[0].backward()
        else:
            fn(x, old, adv, action_mask=mask)[0].backward()
        return _flat_set((x.grad == 0) & mask.bool())

    picks = {}
    for seed, step in itertools.product((1, 2), (0, 5)):
        ds = zero_grad_tokens(_deepspeed_loss("clip_cov", options, seed, step, lo=1.0, hi=1.0), False)
        mg = zero_grad_tokens(policy_loss_module(LossSpec(**{**spec.__dict__, "seed": seed}), step=step), True)
        assert ds == mg and len(ds) == max(int(0.05 * mask.sum()), 1)
        picks[seed, step] = ds
    assert len(set(map(frozenset, picks.values()))) == 4


def test_kl_cov_is_not_clipped_and_its_penalty_pulls_back():
    """KL-Cov keeps the gradient of a token PPO would clip; the selected token's |log r| term pulls its ratio back
    towards 1 (gradient +beta for r > 1), on top of -r A."""
    lp = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float64)
    old = torch.tensor([[-1.5, -2.0, -3.0]], dtype=torch.float64)  # r_0 = e^0.5 (PPO clips it at 1.2)
    adv = torch.tensor([[2.0, -1.0, 0.5]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    cov = ref_cov(lp, adv, mask)
    assert int(np.argmax(cov)) == 0  # the top token is the moved one
    x = lp.clone().requires_grad_(True)
    _deepspeed_loss("kl_cov", {"kl_cov_ratio": 0.1, "kl_cov_coef": 1.0}, 0, 0)(x, old, adv, action_mask=mask)[0].backward()
    r0 = np.exp(0.5)
    assert x.grad[0, 0].item() == pytest.approx((-2.0 * r0 + 1.0) / 3, rel=1e-12)
    assert x.grad[0, 1].item() == pytest.approx(1.0 / 3, rel=1e-12) and x.grad[0, 2].item() == pytest.approx(-0.5 / 3)


@pytest.mark.parametrize("mode", ["clip", "mask"])
def test_cov_types_with_the_token_level_train_rollout_correction(mode):
    """--algo.advantage.is_correction_level token: each token's loss times c_t = clip(pi_old/mu) (clip) or pi_old/mu
    inside [low, high], else 0 (mask), as for CISPO; vllm_kl and the filtered fraction as upstream reports them."""
    lp, old, adv, mask = _tensors(seed=13)
    rollout = old + 0.6 * torch.randn(old.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    c = np.exp((old - rollout).numpy())
    out = (c < 0.7) | (c > 1.5)
    coef = np.clip(c, 0.7, 1.5) if mode == "clip" else np.where(out, 0.0, c)
    for kind, options in (("kl_cov", {"kl_cov_ratio": 0.1, "kl_cov_coef": 1.0}),
                          ("clip_cov", {"clip_cov_ratio": 0.05, "clip_cov_lb": 0.3, "clip_cov_ub": 5.0})):
        grads = {}
        for level in ("off", "token"):
            fn = _deepspeed_loss(kind, options, 1, 1, is_correction_level=level, is_correction_mode=mode,
                                 is_correction_threshold=[0.7, 1.5])
            x = lp.clone().requires_grad_(True)
            res = fn(x, old, adv, action_mask=mask, rollout_log_probs=rollout)
            res[0].backward()
            grads[level] = x.grad.numpy()
        # the selection does not depend on mu: the corrected gradient is the plain one times c_t
        np.testing.assert_allclose(grads["token"], grads["off"] * coef, rtol=1e-12, atol=1e-15)
        m = mask.numpy()
        assert float(res[4]) == pytest.approx(float((out * m).sum() / m.sum()), rel=1e-12)
        assert float(res[3]) == pytest.approx(float(((rollout - old).numpy() * m).sum() / m.sum()), rel=1e-12)


# ----------------------------------------------------------------------------- one real step

# the Actor returns float32 log-probs and the per-token loss is computed in their dtype (as upstream's PPO is): the
# step agrees with the float64 formula to float32 rounding; a wrong token set is off by >= 1e-2 (measured 0.3)
TOL = 1e-6


@pytest.mark.parametrize("method", ["clip_cov", "kl_cov"])
def test_one_step_of_the_stock_actor_trainer_equals_the_float64_reference(tiny_model_dir, gloo_world1, method):
    """The method file's flags, the stock ActorPPOTrainer (one micro-batch holding the whole batch: the covariance
    set; token mean), old log-probs off the policy: the step's gradient is autograd of the written formula on a fresh
    copy. KL-Cov's top-k is order-free; Clip-Cov draws max(floor(2e-4 N), 1) = 1 token, and the step must equal PPO's
    gradient less that of exactly one band token (each candidate tried)."""
    # a random tiny model's token log-probs spread little: Cov stays below the paper's omega_low = 1, so the band
    # starts at 0.05 here (the method file's other settings as given)
    args = parse_args(tiny_model_dir, estimator="group_norm", micro=G * K,
                      extra=method_flags(method)[2:] + (["--actor.kl_cov_ratio", "0.05"] if method == "kl_cov" else
                                                        ["--actor.clip_cov_lb", "0.05"]))
    actor = make_actor(tiny_model_dir)
    state = copy.deepcopy(actor.model.state_dict())
    exps = make_experiences(args, CPUStrategy(args), actor, make_rollout_samples(G, K, seed=8), noise=0.3,
                            maker_cls=RemoteExperienceMaker)
    strategy = CPUStrategy(args)
    with policy_loss_types():
        trainer = make_trainer(ActorPPOTrainer, args, strategy, actor)
    bind_policy_loss(trainer, args)
    assert trainer.actor_loss_fn.options == {"clip_cov": {"clip_cov_ratio": 2e-4, "clip_cov_lb": 0.05, "clip_cov_ub": 5.0},
                                             "kl_cov": {"kl_cov_ratio": 0.05, "kl_cov_coef": 1.0}}[method]
    assert trainer.actor_loss_fn.seed == args.train.seed
    for e in exps:
        trainer.replay_buffer.append(copy.deepcopy(e))
    with cpu_cuda_queries("cpu"):
        status = trainer.ppo_train(0.0)
    assert len(strategy.step_grads) == 1 and status["ppo_clip_ratio"] > 0  # the rule selected tokens
    step = strategy.step_grads[0]

    # float64 reference over the batch's response tokens (flattened: the order of the micro-batch does not matter)
    actor.model.load_state_dict(state)
    params = [p for p in actor.parameters() if p.requires_grad]
    lp = torch.cat([actor(e.sequences, e.action_mask, attention_mask=e.attention_mask).double()[e.action_mask.bool()]
                    for e in exps])
    old = torch.cat([e.action_log_probs.double()[e.action_mask.bool()] for e in exps])
    adv = torch.cat([e.advantages.double()[e.action_mask.bool()] for e in exps])
    n = lp.numel()
    ones = np.ones(n)
    cov = ref_cov(lp.detach(), adv, ones)
    r = torch.exp(lp - old)
    if method == "kl_cov":
        sel = torch.zeros(n, dtype=torch.bool)
        sel[list(ref_top(cov, ones, 0.05))] = True
        ref = torch.autograd.grad(((-adv * r + 1.0 * (lp - old).abs() * sel).sum() / n), params)
        assert max_abs(ref) > 1e-4 and max_abs_diff(step, ref) < TOL * max_abs(ref)
        return
    plain, clipped = -adv * r, -adv * r.clamp(0.0, 2.0)  # clip_cov.sh: eps 1/1
    ppo = torch.maximum(plain, clipped) / n
    cands = sorted(ref_candidates(cov, ones, ((clipped > plain).detach().numpy()), 0.05, 5.0))
    assert round(status["ppo_clip_ratio"] * n) == 1 and len(cands) >= 2
    full = torch.autograd.grad(ppo.sum(), params, retain_graph=True)
    errors = []
    for t in cands:
        without = [a - b for a, b in zip(full, torch.autograd.grad(ppo[t], params, retain_graph=True))]
        errors.append(max_abs_diff(step, without) / max_abs(without))
    assert sorted(errors)[0] < TOL and sorted(errors)[1] > 1e-2, errors  # exactly one candidate explains the step


# ----------------------------------------------------------------------------- flags


def test_flags_defaults_refusals_and_method_lines(tiny_model_dir, capsys):
    from openrlhf_lpo.cli.plan import method_line

    def parse(*extra):
        return parse_args(tiny_model_dir, estimator="group_norm", extra=list(extra))

    clip = parse(*method_flags("clip_cov")[2:])
    assert (clip.actor.clip_cov_ratio, clip.actor.clip_cov_lb, clip.actor.clip_cov_ub) == (2e-4, 1.0, 5.0)
    assert tuple(clip.actor.eps_clip_low_high) == (1.0, 1.0) and clip.actor.loss_agg_mode == "token-mean"
    assert ("policy loss clip_cov: token ratio clipped to [1-1, 1+1]; Clip-Cov detaches max(1, 0.0002 x tokens) of "
            "each micro-batch, drawn among those with covariance in (1, 5), seeded by --train.seed and the step"
            ) in method_line(clip)
    kl = parse(*method_flags("kl_cov")[2:])
    assert (kl.actor.kl_cov_ratio, kl.actor.kl_cov_coef) == (2e-3, 1.0)
    assert ("policy loss kl_cov: token ratio unclipped; KL-Cov adds 1 x |log r| on the max(1, 0.002 x tokens) of "
            "largest covariance in each micro-batch; aggregation token-mean") in method_line(kl)
    assert "(paired LPO temperature std)" in method_line(kl)  # GRPO's advantage: tau = group std
    assert parse("--actor.policy_loss_type", "kl_cov").actor.kl_cov_ratio == 2e-3  # defaults without the flags
    cases = [
        (["--actor.policy_loss_type", "ppo", "--actor.kl_cov_ratio", "0.01"],
         "--actor.kl_cov_ratio only applies with --actor.policy_loss_type kl_cov (got ppo)"),
        (["--actor.policy_loss_type", "kl_cov", "--actor.clip_cov_lb", "0.5"],
         "--actor.clip_cov_lb only applies with --actor.policy_loss_type clip_cov (got kl_cov)"),
        (["--actor.policy_loss_type", "clip_cov", "--actor.clip_cov_ratio", "0"], "--actor.clip_cov_ratio 0.0"),
        (["--actor.policy_loss_type", "kl_cov", "--actor.kl_cov_ratio", "1.5"], "--actor.kl_cov_ratio 1.5"),
        (["--actor.policy_loss_type", "kl_cov", "--actor.kl_cov_coef", "-1"], "--actor.kl_cov_coef -1.0"),
        (["--actor.policy_loss_type", "clip_cov", "--actor.clip_cov_lb", "5", "--actor.clip_cov_ub", "1"],
         "--actor.clip_cov_lb 5.0 / --actor.clip_cov_ub 1.0"),
        (["--actor.policy_loss_type", "kl_cov", "--actor.eps_clip_low_high", "0.2", "0.28"],
         "--actor.eps_clip_low_high/--actor.eps_clip = (0.2, 0.28): --actor.policy_loss_type kl_cov has no ratio clip"),
        (["--actor.policy_loss_type", "clip_cov", "--actor.dual_clip", "3"], "--actor.dual_clip"),
        (["--actor.policy_loss_type", "kl_cov", "--algo.advantage.is_correction_level", "seq"],
         "--algo.advantage.is_correction_level seq"),
    ]
    for extra, msg in cases:
        with pytest.raises(SystemExit) as e:
            parse(*extra)
        err = capsys.readouterr().err
        assert e.value.code == 2 and msg in err, (extra, err[-400:])
    with pytest.raises(SystemExit) as e:  # lpo replaces the policy loss
        parse_args(tiny_model_dir, extra=["--actor.policy_loss_type", "kl_cov"])
    assert e.value.code == 2 and "--actor.policy_loss_type kl_cov is not supported with --algo.advantage.estimator " \
                                 "lpo" in capsys.readouterr().err
    assert sorted(POLICY_LOSS_TYPES) == ["cispo", "clip_cov", "kl_cov"]


@pytest.mark.parametrize("method", ["clip_cov", "cispo"])
def test_the_listwise_end_kl_of_a_run_whose_band_has_no_lower_bound(tiny_model_dir, gloo_world1, method):
    """--lpo.end_kl with clip_cov.sh's band (1.0, 1.0) or cispo.sh's (1.0, 3.0): eps_low >= 1 leaves s unbounded below
    (it crashed before: log(1 - 1)). KL(w*||P) after the update equals brute force with that band, lr 0.5 (found by
    the VLM e2e run)."""
    from openrlhf_lpo.openrlhf.actor_trainer import LPOActorTrainer

    args = parse_args(tiny_model_dir, estimator="group_norm", micro=K, extra=method_flags(method)[2:] + ["--lpo.end_kl"])
    lo, hi = args.actor.eps_clip_low_high
    assert lo >= 1.0
    actor = make_actor(tiny_model_dir)
    exps = make_experiences(args, CPUStrategy(args), actor, make_rollout_samples(G, K, seed=3))
    strategy = CPUStrategy(args)
    with policy_loss_types():  # as LPOPolicyActor builds it: the stock update with the registered type, then the metric
        trainer = make_trainer(LPOActorTrainer, args, strategy, actor, lr=0.5)
    bind_policy_loss(trainer, args)
    for e in exps:
        trainer.replay_buffer.append(copy.deepcopy(e))
    with cpu_cuda_queries("cpu"):
        status = trainer.ppo_train(0.0)
    kls = []
    for e in exps:  # brute force at the updated parameters, the run's band: clamp(log r, None, log(1 + hi))
        with torch.no_grad():
            lp = actor(e.sequences, e.action_mask, attention_mask=e.attention_mask).double()
        m = e.action_mask.double()
        s = ((lp - e.action_log_probs.double()).clamp(max=np.log1p(hi)) * m).sum(1) / m.sum(1)
        r = e.info["lpo_reward"].double()
        for g in range(len(s) // K):
            rg, sg = r[g * K:(g + 1) * K].numpy(), s[g * K:(g + 1) * K].numpy()
            logits = np.zeros(K) if rg.max() == rg.min() else (rg - rg.mean()) / rg.std(ddof=1)
            w, p = np.exp(logits - logits.max()), np.exp(sg - sg.max())
            w, p = w / w.sum(), p / p.sum()
            kls.append(float((w * np.log(w / p)).sum()))
    assert status["lpo/kl_end"] == pytest.approx(float(np.mean(kls)), abs=1e-9)
    assert status["lpo/kl_end"] != pytest.approx(status["lpo/kl_start"], abs=1e-4)  # the update moved P
