"""Target Policy Optimization (TPO, Kaddour 2026, arXiv 2604.06159) as configs/methods/tpo.sh gives it (the
listwise loss with ``--lpo.score sum --lpo.anchor old --lpo.temperature pop_std --lpo.divergence fwd``), against
the paper's formulas written out here in float64 numpy:

    l_i = sum_t log pi(y_it)                      (Eq. 1: the completion's sequence log-probability)
    p_i = softmax(l_theta)_i, p_old_i = softmax(l_old)_i over the group's K completions
    u_i = (R_i - mean R)/sigma, sigma the population std (App. A), u = 0 when sigma = 0
    q_i = p_old_i exp(u_i/eta) / sum_j p_old_j exp(u_j/eta), eta = 1   (Eq. 2)
    L = mean over groups of -sum_i q_i log p_i, q fixed                  (Eq. 3)
    dL/dl_theta = (p - q)/G                                              (Prop. 1)

Through both backends' losses (the DeepSpeed actor's LPOPolicyLoss, the Megatron actor's listwise loss, one pass and
the two-pass surrogate) and through one and two optimizer steps of the real LPOActorTrainer on a tiny Qwen3 with
targets from the real LPOExperienceMaker. Then where TPO and LPO-fwd coincide, and by how much they differ
elsewhere (docs/methods.md, "TPO and LPO-fwd").
"""

import copy

import numpy as np
import pytest
import torch

from lpo_fixtures import (CPUStrategy, equal_length_samples, make_actor, make_experiences, make_rollout_samples,
                          max_abs, max_abs_diff, parse_args, run_lpo_step)
from recipe_flags import method_flags

from openrlhf_lpo import listwise as lw
from openrlhf_lpo.openrlhf.actor_trainer import LPOMicroBatch, LPOPolicyLoss

K, G = 4, 4
TPO = method_flags("tpo")[2:]  # the method file's flags after --algo.advantage.estimator lpo


# ----------------------------------------------------------------------------- the paper, in numpy


def paper_tpo(lp_theta, lp_old, mask, rewards, eta=1.0):
    """(loss, dL/dl_theta [G,K], q [G,K], p [G,K]) from Eq. 1-3 and App. A, float64 numpy."""
    lp_theta, lp_old, mask, r = (np.asarray(x, dtype=np.float64) for x in (lp_theta, lp_old, mask, rewards))
    l_theta = (lp_theta * mask).sum(-1).reshape(r.shape)
    l_old = (lp_old * mask).sum(-1).reshape(r.shape)

    def softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    sigma = r.std(axis=1, ddof=0, keepdims=True)
    u = np.where(sigma > 0, (r - r.mean(1, keepdims=True)) / np.where(sigma > 0, sigma, 1.0), 0.0)
    p_old, p = softmax(l_old), softmax(l_theta)
    q = p_old * np.exp(u / eta)
    q = q / q.sum(-1, keepdims=True)
    loss = float(-(q * np.log(p)).sum(-1).mean())
    return loss, (p - q) / r.shape[0], q, p


def _batch(seed, lengths=None, spread=0.0):
    """Token log-probs [G*K, T] (leaves), old log-probs (= them, or moved by ``spread``), a mask with the given
    response lengths (default random 1..7), rewards with a degenerate group and a one-success group."""
    g = torch.Generator().manual_seed(seed)
    T = 7
    lp = -torch.rand(G * K, T, generator=g, dtype=torch.float64) * 2 - 0.05
    old = lp + spread * torch.randn(G * K, T, generator=g, dtype=torch.float64)
    n = torch.randint(1, T + 1, (G * K,), generator=g) if lengths is None else torch.as_tensor(lengths)
    mask = (torch.arange(T)[None, :] < n[:, None]).double()
    r = torch.rand(G, K, generator=g, dtype=torch.float64).round(decimals=1)
    r[0] = 0.5
    r[1] = torch.tensor([1.0, 0.0, 0.0, 0.0])
    return lp, old, mask, r


def _tpo_inputs(old, mask, r):
    """What the experience maker builds for TPO: w* = softmax(R/tau + l_old), tau = population std, and the
    start point s_t = l_old (group-centred), both flat [G*K]."""
    anchor = lw.group_anchor(lw.sequence_anchor(old, mask, "sum").view(G, K))
    target = lw.gibbs_target(r, lw.group_temperature(r, "pop_std"), anchor)
    return target.reshape(-1), anchor.reshape(-1)


def _entropy(q):
    q = np.asarray(q)
    return float(-(q * np.log(q)).sum(-1).mean())


# ----------------------------------------------------------------------------- the loss and its gradient


@pytest.mark.parametrize("spread", [0.0, 0.3])  # on-policy (first window), and a later epoch's parameters
def test_tpo_loss_and_gradient_on_both_backends_equal_the_papers_formulas(spread):
    from openrlhf_lpo.megatron.losses import LossSpec, get_policy_loss

    lp, old, mask, r = _batch(seed=11, spread=spread)
    want_loss, want_dl, q, p = paper_tpo(lp, old, mask, r)
    want_grad = np.asarray(want_dl).reshape(-1, 1) * mask.numpy()  # dL/dl_i reaches every token of response i
    target, anchor = _tpo_inputs(old, mask, r)
    np.testing.assert_allclose(target.view(G, K).numpy(), q, rtol=1e-12, atol=1e-15)  # Eq. 2 (group 0: q = p_old)

    # the DeepSpeed actor's loss: one pass on whole groups, then the two-pass surrogate with c from the same s
    x = lp.clone().requires_grad_(True)
    ctx = LPOMicroBatch(target=target, groups_norm=float(G), group_size=K, prev=anchor)
    loss_fn = LPOPolicyLoss(0.2, 0.2, score="sum")
    loss = loss_fn(x, old, None, mask, micro_batch=ctx)[0]
    loss.backward()
    # the loss is KL(q || p) = cross-entropy - H(q): the same gradient, a constant apart
    assert float(loss.detach()) + _entropy(q) == pytest.approx(want_loss, rel=1e-12)
    np.testing.assert_allclose(x.grad.numpy(), want_grad, rtol=1e-10, atol=1e-15)
    coef = lw.projection_coefficients(loss_fn.last.s.view(G, K), target.view(G, K)).reshape(-1)
    np.testing.assert_allclose(coef.view(G, K).numpy(), np.asarray(want_dl) * G, rtol=1e-10, atol=1e-15)  # p - q
    x2 = lp.clone().requires_grad_(True)
    sur = LPOMicroBatch(target=target, groups_norm=float(G), group_size=K, prev=anchor, coefficients=coef)
    LPOPolicyLoss(0.2, 0.2, score="sum")(x2, old, None, mask, micro_batch=sur)[0].backward()
    np.testing.assert_allclose(x2.grad.numpy(), want_grad, rtol=1e-10, atol=1e-15)

    # the Megatron actor's losses: K x sum_g D_g over the response count (megatron divides by it)
    mb = {"old_log_probs": old, "action_mask": mask, "target": target, "prev_log_ratio": anchor}
    for name in ("listwise", "listwise_surrogate"):
        x3 = lp.clone().requires_grad_(True)
        spec = LossSpec(name=name, group_size=K, divergence="fwd", score="sum", clip_eps=0.2)
        total, count, _ = get_policy_loss(name)(x3, dict(mb, coefficients=coef), spec)
        (total / count).backward()
        np.testing.assert_allclose(x3.grad.numpy(), want_grad, rtol=1e-10, atol=1e-15)
        if name == "listwise":
            assert float((total / count).detach()) + _entropy(q) == pytest.approx(want_loss, rel=1e-12)


def test_tpo_score_is_unclipped_and_summed():
    """TPO's score is l_theta - l_old (no clip, no 1/|y|): a token moved far outside PPO's band keeps its
    gradient, and a longer response weighs more; Eq. 4 clamps that token (zero gradient) and divides by |y|."""
    lp = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, 0.0]], dtype=torch.float64)
    old = torch.tensor([[-2.0, -1.0, -1.0], [-1.0, -1.0, 0.0]], dtype=torch.float64)  # token 0: log r = 1
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    for score, want_s, want_g in (("sum", [1.0, 0.0], [[1, 1, 1], [1, 1, 0]]),
                                  ("mean", [1 / 3, 0.0], [[1 / 3, 1 / 3, 1 / 3], [0.5, 0.5, 0]]),
                                  ("mean_clip", [np.log(1.2) / 3, 0.0], [[0, 1 / 3, 1 / 3], [0.5, 0.5, 0]])):
        x = lp.clone().requires_grad_(True)
        s = lw.sequence_score(x, old, mask, 0.2, score)
        s.sum().backward()
        np.testing.assert_allclose(s.detach().numpy(), want_s, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(x.grad.numpy(), want_g, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(lw.sequence_anchor(old, mask, "sum").numpy(), [-4.0, -2.0])
    np.testing.assert_allclose(lw.sequence_anchor(old, mask, "mean").numpy(), [-4 / 3, -1.0])


# ----------------------------------------------------------------------------- through the real trainer


def _paper_grads(actor, experiences, eta=1.0):
    """Autograd of the paper's L (q from the experiences' old log-probs and rewards) at the actor's parameters."""
    actor.model.zero_grad(set_to_none=True)
    rows = sorted(((int(g), e, i) for e in experiences for i, g in enumerate(e.info["lpo_gid"])), key=lambda t: t[0])
    lp = []
    for _, e, i in rows:
        lp.append(actor(e.sequences[i:i + 1], e.action_mask[i:i + 1], attention_mask=e.attention_mask[i:i + 1])[0]
                  .double() * e.action_mask[i])  # the Actor returns float32 log-probs: the paper's math in float64
    old = [e.action_log_probs[i].double() * e.action_mask[i] for _, e, i in rows]  # stored in float32
    rewards = np.array([float(e.info["lpo_reward"][i]) for _, e, i in rows]).reshape(-1, K)
    l_theta = torch.stack([x.sum() for x in lp]).view(-1, K)
    l_old = np.array([float(x.sum()) for x in old]).reshape(-1, K)
    _, _, q, _ = paper_tpo(l_old[..., None], l_old[..., None], np.ones_like(l_old[..., None]), rewards, eta)
    loss = -(torch.tensor(q) * torch.log_softmax(l_theta, -1)).sum(-1).mean()
    loss.backward()
    return [p.grad.detach().clone() for p in actor.parameters() if p.requires_grad]


@pytest.mark.parametrize("micro", [K, 2])  # one pass on whole groups; groups split (c from s_t, then a pre-pass)
def test_tpo_steps_of_the_lpo_trainer_equal_the_papers_gradient(tiny_model_dir, gloo_world1, micro):
    """Two epochs of one rollout batch (SGD, lr 0.5): epoch 1 at the rollout's parameters, epoch 2 after the step
    (q frozen, p recomputed, as the paper reuses rollouts). Targets and anchors from the real LPOExperienceMaker."""
    args = parse_args(tiny_model_dir, micro=micro, extra=[*TPO, "--train.max_epochs", "2"])
    assert (args.lpo.score, args.lpo.anchor, args.lpo.temperature) == ("sum", "old", "pop_std")
    actor = make_actor(tiny_model_dir)
    state = copy.deepcopy(actor.model.state_dict())
    exps = make_experiences(args, CPUStrategy(args), actor, make_rollout_samples(G, K, seed=5))
    grads, status, trainer = run_lpo_step(args, actor, exps, lr=0.5)
    assert len(grads) == 2
    modes = [p.mode.value for p in trainer.last_update.windows]
    assert modes == (["one_pass", "one_pass"] if micro == K else ["shortcut", "pre_pass"])
    actor.model.load_state_dict(state)
    ref1 = _paper_grads(actor, exps)
    assert max_abs(ref1) > 1e-3 and max_abs_diff(grads[0], ref1) < 1e-11 * max_abs(ref1)
    with torch.no_grad():  # epoch 2 at theta_1 = theta_0 - lr g_1
        for p, g in zip([p for p in actor.parameters() if p.requires_grad], grads[0]):
            p -= 0.5 * g
    ref2 = _paper_grads(actor, exps)
    assert max_abs_diff(grads[1], ref2) < 1e-10 * max_abs(ref2)
    assert max_abs_diff(ref2, ref1) > 1e-4 * max_abs(ref1)  # the second epoch saw other parameters
    assert status["lpo/kl_start"] > 0.0  # KL(q || p_old) of the informative groups


# ----------------------------------------------------------------------------- TPO and LPO-fwd


def _cosine(a, b):
    a = torch.cat([x.reshape(-1) for x in a]).double()
    b = torch.cat([x.reshape(-1) for x in b]).double()
    return float(a @ b / (a.norm() * b.norm())), float(a.norm() / b.norm())


def _token_grads(lp, old, mask, r, method):
    """d loss / d token log-probs of TPO or LPO-fwd (tau: pop_std or std) through the DeepSpeed actor's loss."""
    x = lp.clone().requires_grad_(True)
    if method == "tpo":
        target, prev = _tpo_inputs(old, mask, r)
        loss_fn = LPOPolicyLoss(0.2, 0.2, score="sum")
    else:
        target, prev = lw.gibbs_target(r, lw.group_temperature(r, method)).reshape(-1), None
        loss_fn = LPOPolicyLoss(0.2, 0.2)
    loss_fn(x, old, None, mask, micro_batch=LPOMicroBatch(target=target, groups_norm=float(G), group_size=K,
                                                          prev=prev))[0].backward()
    return [x.grad]


def test_tpo_and_lpo_fwd_coincide_exactly_when_the_papers_conditions_hold():
    """On-policy (s = 0, no token clipped), every response of the batch n tokens long, and each group's responses
    equally likely under pi_old (p_old uniform): c_TPO = p_old - q = 1/K - softmax(u) = c_LPO-fwd at tau = population
    std, and d s/d theta = (d l/d theta)/n, so the two gradients are parallel (norm ratio n). Each condition broken
    alone makes them differ; GRPO's temperature (unbiased std) differs too."""
    n = 5
    lp, _, mask, r = _batch(seed=21, lengths=[n] * (G * K))
    # equal sequence log-probs within each group: shift each response's tokens by a constant
    per = (lp * mask).sum(-1).view(G, K)
    lp = (lp.view(G, K, -1) - ((per - per.mean(1, keepdim=True)) / n)[..., None]).reshape(G * K, -1)
    assert float(((lp * mask).sum(-1).view(G, K).std(1)).max()) < 1e-12
    cos, ratio = _cosine(_token_grads(lp, lp, mask, r, "tpo"), _token_grads(lp, lp, mask, r, "pop_std"))
    assert cos == pytest.approx(1.0, abs=1e-12) and ratio == pytest.approx(n, rel=1e-12)

    lp_other, _, mask_other, _ = _batch(seed=22)  # unequal lengths and p_old not uniform
    cases = {
        "p_old not uniform": (lp + 0.3 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(3),
                                                     dtype=torch.float64) * mask, None, mask),
        "unequal lengths": (lp, None, (torch.arange(lp.shape[1])[None, :] < torch.tensor(
            [n - (i % 3) for i in range(G * K)])[:, None]).double()),
        "a later epoch (s != 0)": (lp, lp + 0.05 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(4),
                                                               dtype=torch.float64), mask),
    }
    measured = {}
    for name, (x, old, m) in cases.items():
        old = x if old is None else old
        if name == "unequal lengths":  # keep p_old uniform: equal sums over the new lengths
            per = (x * m).sum(-1).view(G, K)
            x = (x.view(G, K, -1) - ((per - per.mean(1, keepdim=True)) / m.sum(-1).view(G, K))[..., None]
                 * m.view(G, K, -1)).reshape(G * K, -1)
            old = x
        measured[name] = _cosine(_token_grads(x, old, m, r, "tpo"), _token_grads(x, old, m, r, "pop_std"))[0]
    measured["GRPO's tau (unbiased std)"] = _cosine(_token_grads(lp, lp, mask, r, "tpo"),
                                                    _token_grads(lp, lp, mask, r, "std"))[0]
    print("\n[tpo vs lpo-fwd] cosine of the token gradients: "
          + "; ".join(f"{k}: {v:.6f}" for k, v in measured.items()))
    for name, value in measured.items():
        assert 0.0 < value < 1.0 - 1e-6, (name, value)


def _trainer_grads(model_dir, samples, flags, zero_head=False):
    args = parse_args(model_dir, micro=K, extra=flags)
    actor = make_actor(model_dir)
    if zero_head:  # logits 0: every token 1/V, so equal-length responses are equally likely (p_old uniform)
        with torch.no_grad():
            actor.model.model.norm.weight.zero_()
    exps = make_experiences(args, CPUStrategy(args), actor, samples)
    grads, _, _ = run_lpo_step(args, actor, exps)
    return grads[0]


def test_tpo_and_lpo_fwd_through_the_trainer_on_the_same_batches(tiny_model_dir, gloo_world1):
    """The real trainer on a tiny Qwen3, on-policy, one step, the same experiences: with the paper's conditions
    (equal lengths, uniform p_old: a model whose logits are 0) the steps are parallel to 1e-12; with the model's
    own (unequal) p_old and with unequal lengths they are not (the numbers docs/methods.md quotes)."""
    lpo_pop = ["--lpo.divergence", "fwd", "--lpo.temperature", "pop_std"]
    lpo_std = ["--lpo.divergence", "fwd", "--lpo.temperature", "std"]
    equal = equal_length_samples(seed=9, n_groups=G, group_size=K, length=6)
    tpo0, lpo0 = (_trainer_grads(tiny_model_dir, equal, f, zero_head=True) for f in (TPO, lpo_pop))
    cos, ratio = _cosine(tpo0, lpo0)
    assert max_abs(tpo0) > 1e-4
    # the norm ratio is n = 6 up to the float32 logits of the Actor (its backward rounds d loss / d log pi)
    assert cos == pytest.approx(1.0, abs=1e-12) and ratio == pytest.approx(6.0, rel=1e-6)
    rows = {}
    unequal = make_rollout_samples(G, K, seed=5)
    for name, samples in (("equal lengths", equal), ("unequal lengths", unequal)):
        tpo = _trainer_grads(tiny_model_dir, samples, TPO)
        rows[name] = (_cosine(tpo, _trainer_grads(tiny_model_dir, samples, lpo_pop))[0],
                      _cosine(tpo, _trainer_grads(tiny_model_dir, samples, lpo_std))[0])
    print("\n[tpo vs lpo-fwd, tiny Qwen3, one on-policy step] cosine (tau pop_std, tau std): "
          + "; ".join(f"{k}: {a:.4f}, {b:.4f}" for k, (a, b) in rows.items()))
    for a, b in rows.values():
        assert -1.0 < a < 1.0 - 1e-6 and -1.0 < b < 1.0 - 1e-6


# ----------------------------------------------------------------------------- flags


def test_tpo_flags_and_refusals(tiny_model_dir, capsys):
    from openrlhf_lpo.cli.plan import method_line

    args = parse_args(tiny_model_dir, extra=TPO)
    line = method_line(args)
    assert line.startswith("method: TPO (Target Policy Optimization, arXiv 2604.06159) as LPO listwise (divergence "
                           "fwd), temperature pop_std; s sums the token log-ratios (no clip, no length normalisation); "
                           "anchor l_old"), line
    cases = [
        ([*TPO, "--algo.advantage.is_correction_level", "token"],
         "--lpo.score sum and --lpo.anchor old with --algo.advantage.is_correction_level token"),
        (["--lpo.anchor", "old", "--lpo.replay_batches", "1"], "--lpo.anchor old with --lpo.replay_batches 1"),
    ]
    for extra, msg in cases:
        with pytest.raises(SystemExit) as e:
            parse_args(tiny_model_dir, extra=extra)
        assert e.value.code == 2 and msg in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        parse_args(tiny_model_dir, estimator="group_norm", extra=["--lpo.score", "sum"])
    assert e.value.code == 2 and "--lpo.score only apply with --algo.advantage.estimator lpo" in capsys.readouterr().err
    # without a clip the eps band is not read: any --actor.eps_clip_low_high passes
    assert parse_args(tiny_model_dir, extra=[*TPO, "--actor.eps_clip_low_high", "1.5", "2"]).lpo.score == "sum"


def test_the_new_methods_are_in_the_pairing_tables_and_in_lpo_explain(capsys):
    """docs/lpo_flags.md's pairing table and docs/methods.md name each new method file with its paired temperature,
    the files exist, and ``lpo-explain --method`` knows every baseline of the table; TPO's printed target and
    coefficients equal the paper's q and p - q (on-policy: p = p_old)."""
    import re
    from pathlib import Path

    from openrlhf_lpo.cli.explain import METHODS, main

    repo = Path(__file__).resolve().parents[2]
    text = (repo / "docs" / "lpo_flags.md").read_text()
    section = text[text.index("## Baselines and their LPO pairs"):]
    rows = {line.split("|")[1].strip(): line for line in section.splitlines() if line.startswith("| ")}
    for name, temp, files in (("Clip-Cov", "std", ["clip_cov.sh"]), ("KL-Cov", "std", ["kl_cov.sh"]),
                              ("TPO", "pop_std", ["tpo.sh", "lpo_fwd_tpo.sh", "lpo_rev_tpo.sh"])):
        assert f"`--lpo.temperature {temp}`" in rows[name] and all(f"`{f}`" in rows[name] for f in files), name
        assert all((repo / "configs" / "methods" / f).exists() for f in files)
    methods_md = (repo / "docs" / "methods.md").read_text()
    assert all(f"`{f}.sh`" in methods_md for f in ("clip_cov", "kl_cov", "tpo", "lpo_fwd_tpo"))
    assert {"grpo", "dr_grpo", "maxrl", "rloo", "reinforce_pp", "dapo", "gspo", "cispo", "clip_cov", "kl_cov",
            "tpo"} == set(METHODS)
    rewards, old = [1.0, 0.0, 0.0, 1.0], [-12.0, -9.0, -15.0, -10.0]
    main(["--method", "tpo", "--rewards", *map(str, rewards), "--old-logp", *map(str, old)])
    out = capsys.readouterr().out
    table = np.array([[float(v) for v in line.split()] for line in out.splitlines() if re.match(r"^\s+\d+\s", line)])
    _, _, q, p = paper_tpo(np.array(old)[:, None], np.array(old)[:, None], np.ones((4, 1)), np.array([rewards]))
    np.testing.assert_allclose(table[:, 2], p[0], atol=0.501e-4)
    np.testing.assert_allclose(table[:, 3], q[0], atol=0.501e-4)
    np.testing.assert_allclose(table[:, 4], p[0] - q[0], atol=0.501e-5)
    with pytest.raises(SystemExit) as e:
        main(["--rewards", "1", "0", "--old-logp", "-1", "-2"])
    assert e.value.code == 2 and "--old-logp is TPO's p_old: it needs --method tpo" in capsys.readouterr().err
