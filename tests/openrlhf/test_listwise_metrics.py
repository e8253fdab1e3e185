"""--lpo.end_kl for every group estimator: the logged KL(w*||P) against brute force, split groups
across gloo ranks, and stock training left untouched (bit-identical gradients)."""

import copy
import math

import pytest
import torch

from lpo_fixtures import (CPUStrategy, cpu_cuda_queries, make_actor, make_experiences, make_rollout_samples,
                          make_trainer, max_abs, max_abs_diff, parse_args)
from lpo_references import reference_listwise_stats

from openrlhf_lpo.listwise import listwise_group_sums, listwise_stats_from_sums
from openrlhf_lpo.openrlhf.actor_trainer import LPOActorTrainer, lpo_group_stats

K, G = 4, 4


def _train(cls, args, model_dir, state, exps, lr):
    actor = make_actor(model_dir)
    actor.model.load_state_dict(state)
    strategy = CPUStrategy(args)
    trainer = make_trainer(cls, args, strategy, actor, lr=lr)
    for e in exps:
        trainer.replay_buffer.append(copy.deepcopy(e))
    torch.manual_seed(7)  # the stock DataLoader shuffle
    with cpu_cuda_queries():
        status = trainer.ppo_train(0.0)
    return actor, strategy.step_grads, status


@pytest.mark.parametrize("estimator,temperature", [("group_norm", "std"), ("dr_grpo", "one"), ("maxrl", "mean"),
                                                   ("rloo", "loo")])
def test_pg_end_kl_matches_brute_force(tiny_model_dir, gloo_world1, estimator, temperature):
    args = parse_args(tiny_model_dir, estimator=estimator, micro=2, train_batch=8, extra=["--lpo.end_kl"])
    assert args.lpo.temperature == temperature  # the estimator's pairing
    state = copy.deepcopy(make_actor(tiny_model_dir).model.state_dict())
    exps = make_experiences(args, CPUStrategy(args), make_actor(tiny_model_dir), make_rollout_samples(G, K, seed=12),
                            noise=0.1)
    actor, grads, status = _train(LPOActorTrainer, args, tiny_model_dir, state, exps, lr=2.0)
    assert len(grads) == 2 and max_abs(grads[0]) > 1e-4
    ref = reference_listwise_stats(actor, exps, K, temperature, args.actor.eps_clip_low_high)
    assert status["lpo/kl_end"] == pytest.approx(ref["kl"], abs=1e-10)
    assert status["lpo/entropy_p_end"] == pytest.approx(ref["entropy_p"], abs=1e-10)
    assert status["lpo/entropy_target"] == pytest.approx(ref["entropy_target"], abs=1e-10)
    assert status["lpo/kl_start"] == pytest.approx(math.log(K) - ref["entropy_target"], abs=1e-10)  # P uniform
    assert abs(status["lpo/kl_end"] - status["lpo/kl_start"]) > 1e-4  # the update moved P
    assert status["lpo/groups"] == G
    assert not [k for k in status if k.startswith("lpo_")]  # per-sample targets are not logged as metrics


@pytest.mark.parametrize("estimator", ["group_norm", "dr_grpo"])
def test_pg_end_kl_leaves_training_unchanged(tiny_model_dir, gloo_world1, estimator):
    plain = parse_args(tiny_model_dir, estimator=estimator, micro=2, train_batch=8)
    with_kl = parse_args(tiny_model_dir, estimator=estimator, micro=2, train_batch=8, extra=["--lpo.end_kl"])
    state = copy.deepcopy(make_actor(tiny_model_dir).model.state_dict())
    actor0 = make_actor(tiny_model_dir)
    samples = make_rollout_samples(G, K, seed=13)
    exps_plain = make_experiences(plain, CPUStrategy(plain), actor0, samples, noise=0.1)
    exps_kl = make_experiences(with_kl, CPUStrategy(with_kl), actor0, samples, noise=0.1)
    for a, b in zip(exps_plain, exps_kl):
        assert torch.equal(a.advantages, b.advantages)
        assert "lpo_target" in b.info and "lpo_target" not in a.info
    _, g_plain, s_plain = _train(LPOActorTrainer, plain, tiny_model_dir, state, exps_plain, lr=0.5)
    _, g_ours, s_ours = _train(LPOActorTrainer, with_kl, tiny_model_dir, state, exps_kl, lr=0.5)
    assert len(g_plain) == len(g_ours) == 2
    for a, b in zip(g_plain, g_ours):
        assert max_abs_diff(a, b) == 0.0
    assert s_plain["policy_loss"] == s_ours["policy_loss"]
    assert "lpo/kl_end" in s_ours and "lpo/kl_end" not in s_plain


def test_group_sums_add_up_over_any_split():
    """Members of a group scattered over 3 'ranks': summed sums == per-group formulas (float64)."""
    g = torch.Generator().manual_seed(0)
    n_groups, k = 6, 5
    s = 0.2 * torch.randn(n_groups, k, generator=g, dtype=torch.float64)
    w = torch.softmax(torch.randn(n_groups, k, generator=g, dtype=torch.float64), 1)
    w[0] = torch.tensor([1.0, 0, 0, 0, 0], dtype=torch.float64)  # a one-hot target (0 log 0 = 0)
    gids = torch.arange(n_groups).repeat_interleave(k)
    owner = torch.randint(0, 3, (n_groups * k,), generator=g)
    total = sum(listwise_group_sums(gids[owner == r], s.reshape(-1)[owner == r], w.reshape(-1)[owner == r], n_groups)
                for r in range(3))
    got = listwise_stats_from_sums(total, k)
    ref = lpo_group_stats(s, w)
    assert got["kl"] == pytest.approx(float(ref["kl"].mean()), abs=1e-14)
    assert got["entropy_p"] == pytest.approx(float(ref["entropy_p"].mean()), abs=1e-14)
    assert got["entropy_target"] == pytest.approx(float(ref["entropy_target"].mean()), abs=1e-14)
    with pytest.raises(ValueError, match="missing members"):
        listwise_stats_from_sums(listwise_group_sums(gids[:-1], s.reshape(-1)[:-1], w.reshape(-1)[:-1], n_groups), k)


@pytest.mark.parametrize("estimator,extra,needle", [
    ("reinforce", ["--lpo.end_kl"], "--lpo.end_kl needs prompt groups"),
    ("group_norm", ["--lpo.temperature", "one"], "add --lpo.end_kl"),
    ("group_norm", ["--lpo.end_kl", "--lpo.divergence", "rev"], "--lpo.divergence"),
    ("group_norm", ["--lpo.end_kl", "--lpo.temperature", "-1"], "--lpo.temperature"),
])
def test_end_kl_flag_errors(tiny_model_dir, capsys, estimator, extra, needle):
    with pytest.raises(SystemExit):
        parse_args(tiny_model_dir, estimator=estimator, extra=extra)
    assert needle in capsys.readouterr().err


def test_end_kl_explicit_temperature(tiny_model_dir):
    args = parse_args(tiny_model_dir, estimator="group_norm", extra=["--lpo.end_kl", "--lpo.temperature", "0.5"])
    assert args.lpo.temperature == 0.5
