"""LPO trainer/experience-maker internals: DP layout, window plans, multi-step exactness, metrics."""

import copy
import math

import pytest
import torch

from lpo_harness import (CPUStrategy, full_batch_listwise_grads, make_actor, make_experiences,
                         make_rollout_samples, max_abs, max_abs_diff, parse_args, rank_chunk, run_lpo_step)
from openrlhf_lpo import listwise
from openrlhf_lpo.openrlhf.actor_trainer import lpo_group_stats, plan_windows
from openrlhf_lpo.openrlhf.experience_maker import group_dp_layout

K, G = 4, 4


@pytest.mark.parametrize("n_groups,dp,per_chunk", [(8, 2, 1), (8, 2, 3), (12, 3, 2), (6, 1, 4), (4, 4, 2)])
def test_group_dp_layout_gives_each_rank_its_own_groups(n_groups, dp, per_chunk):
    import math

    layout = group_dp_layout(n_groups, dp, per_chunk)
    assert len(layout) % dp == 0
    size = math.ceil(len(layout) / dp)  # OpenRLHF's async_run_method_batch chunk
    seen = []
    for r in range(dp):
        groups = [g for chunk in layout[r * size:(r + 1) * size] for g in chunk]
        assert groups == list(range(r * n_groups // dp, (r + 1) * n_groups // dp))
        seen += groups
    assert seen == list(range(n_groups))
    with pytest.raises(ValueError, match="data-parallel"):
        group_dp_layout(5, 2, 1)


def test_split_rollout_keeps_groups_on_one_rank(tiny_model_dir):
    args = parse_args(tiny_model_dir, G=8, micro=2, dp=2, train_batch=16,
                      extra=["--rollout.micro_batch_size", "6"])
    exps = make_experiences(args, CPUStrategy(args), make_actor(tiny_model_dir), make_rollout_samples(8, K), noise=0)
    ranks = [rank_chunk(exps, r, 2) for r in range(2)]
    gids = [sorted(int(g) for e in chunk for g in e.info["lpo_gid"]) for chunk in ranks]
    assert gids == [sorted(list(range(0, 4)) * K), sorted(list(range(4, 8)) * K)]
    for e in exps:  # targets sum to one per group and lpo_gid == index // K
        assert [int(g) for g in e.info["lpo_gid"]] == [i // K for i in e.index]


def test_plan_windows_shuffles_whole_groups():
    gids = [g for g in range(6) for _ in range(K)]
    plan = plan_windows(gids, K, micro=3, gas=4, generator=torch.Generator().manual_seed(0))
    assert len(plan) == 2 and all(len(w) == 4 and all(len(m) == 3 for m in w) for w in plan)
    for window in plan:
        flat = [i for m in window for i in m]
        groups = {gids[i] for i in flat}
        assert len(groups) == 3 and all(sum(gids[i] == g for i in flat) == K for g in groups)
    order = [gids[i] for w in plan for m in w for i in m]
    assert order != sorted(order)  # shuffled (seeded) at group level
    with pytest.raises(ValueError, match="whole groups"):
        plan_windows(gids, K, micro=3, gas=3)
    with pytest.raises(ValueError, match="members on this rank"):
        plan_windows(gids[:-1], K, micro=1, gas=1)


@pytest.mark.parametrize("micro,div", [(2, "rev"), (4, "js")])
def test_every_optimizer_window_is_exact(tiny_model_dir, gloo_world1, micro, div):
    """Two optimizer steps per rollout batch (lr = 0): each step's gradient equals the listwise
    loss over exactly the groups of its window."""
    args = parse_args(tiny_model_dir, micro=micro, train_batch=8, extra=["--lpo.divergence", div])
    actor = make_actor(tiny_model_dir)
    state = copy.deepcopy(actor.model.state_dict())
    exps = make_experiences(args, CPUStrategy(args), actor, make_rollout_samples(G, K, seed=8))
    grads, status, trainer = run_lpo_step(args, actor, exps)
    assert len(grads) == 2
    items = trainer.replay_buffer.items
    for step, window in enumerate(trainer.last_window_plan):
        gids = {int(items[i].info["lpo_gid"]) for mb in window for i in mb}
        assert len(gids) == 2
        sub = copy.deepcopy(exps)
        for e in sub:  # keep only this window's groups
            keep = [j for j, g in enumerate(e.info["lpo_gid"]) if int(g) in gids]
            from openrlhf.trainer.ppo_utils.experience import make_experience_batch, split_experience_batch
            parts = [p for j, p in enumerate(split_experience_batch(e)) if j in keep]
            e.__dict__.update(make_experience_batch(parts).__dict__ if parts else {"sequences": None})
        sub = [e for e in sub if e.sequences is not None]
        ref, _ = full_batch_listwise_grads(args, tiny_model_dir, state, sub, div)
        assert max_abs(ref) > 1e-3
        assert max_abs_diff(grads[step], ref) < 1e-12


def test_pointwise_projection_gradient(tiny_model_dir, gloo_world1):
    args = parse_args(tiny_model_dir, micro=2, extra=["--lpo.projection", "pointwise"])
    actor = make_actor(tiny_model_dir)
    state = copy.deepcopy(actor.model.state_dict())
    exps = make_experiences(args, CPUStrategy(args), actor, make_rollout_samples(G, K, seed=9))
    grads, status, _ = run_lpo_step(args, actor, exps)
    ref, _ = full_batch_listwise_grads(args, tiny_model_dir, state, exps, "fwd", projection="pointwise")
    assert status["lpo/two_pass"] == 0.0  # linear in s: no no-grad pass needed
    assert max_abs(ref) > 1e-3 and max_abs_diff(grads[0], ref) < 1e-12


def test_metrics_match_independent_computation(tiny_model_dir, gloo_world1):
    args = parse_args(tiny_model_dir, micro=2, extra=["--lpo.divergence", "fwd", "--lpo.end_kl"])
    actor = make_actor(tiny_model_dir)
    samples = make_rollout_samples(G, K, seed=10)
    exps = make_experiences(args, CPUStrategy(args), actor, samples, noise=0.1)
    # large step so the end differs from the start
    from lpo_harness import CPUStrategy as S, make_trainer, cpu_cuda_queries
    from openrlhf_lpo.openrlhf.actor_trainer import LPOActorTrainer

    strategy = S(args)
    trainer = make_trainer(LPOActorTrainer, args, strategy, actor, lr=50.0)
    for e in exps:
        trainer.replay_buffer.append(copy.deepcopy(e))
    with cpu_cuda_queries():
        status = trainer.ppo_train(0.0)

    rewards = torch.tensor([float(s.rewards) for s in samples], dtype=torch.float64).view(G, K)
    std = rewards.std(dim=1, keepdim=True)
    flat = (rewards.max(1).values == rewards.min(1).values).unsqueeze(1)
    logits = torch.where(flat, torch.zeros_like(rewards), (rewards - rewards.mean(1, keepdim=True)) / std)
    w = torch.softmax(logits, dim=1)
    uniform = torch.full_like(w, 1.0 / K)
    kl_start = (w * (w.log() - uniform.log())).sum(1).mean()
    h_w = -(w * w.log()).sum(1).mean()
    assert status["lpo/kl_start"] == pytest.approx(float(kl_start), abs=1e-12)
    assert status["lpo/entropy_target"] == pytest.approx(float(h_w), abs=1e-12)
    assert status["lpo/entropy_p_start"] == pytest.approx(math.log(K), abs=1e-12)
    assert status["lpo/degenerate_frac"] == pytest.approx(float(flat.double().mean()))
    assert status["lpo/tau_mean"] == pytest.approx(float(std[~flat.squeeze(1)].mean()), rel=1e-6)
    assert status["lpo/tau_max"] == pytest.approx(float(std[~flat.squeeze(1)].max()), rel=1e-6)
    assert status["lpo/tau_min"] == pytest.approx(float(std[~flat.squeeze(1)].min()), rel=1e-6)
    assert status["lpo/abs_coef_mean"] > 0 and status["lpo/two_pass"] == 1.0
    assert "lpo/kl_end" in status and abs(status["lpo/kl_end"] - status["lpo/kl_last"]) > 1e-6
    from lpo_harness import reference_listwise_stats

    ref = reference_listwise_stats(actor, exps, K, "std", args.actor.eps_clip_low_high)  # brute force, end of update
    assert status["lpo/kl_end"] == pytest.approx(ref["kl"], abs=1e-10)
    assert status["lpo/entropy_p_end"] == pytest.approx(ref["entropy_p"], abs=1e-10)
    for key in ("actor_grad_norm", "response_length", "response_entropy", "policy_loss", "ppo_clip_ratio"):
        assert key in status, key
    assert status["actor_grad_norm"] > 0 and status["response_entropy"] > 0
    # group stats helper against a direct formula
    s = torch.randn(3, K, dtype=torch.float64)
    st = lpo_group_stats(s, w[:3])
    p = torch.softmax(s, 1)
    assert torch.allclose(st["kl"], (w[:3] * (w[:3].log() - p.log())).sum(1))
    assert torch.allclose(st["entropy_p"], -(p * p.log()).sum(1))
