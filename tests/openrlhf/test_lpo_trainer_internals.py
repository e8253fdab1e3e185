"""LPO trainer/experience-maker internals: group layout, forward chunks, partial batches, window
plans, the first-window shortcut, entropy without a graph, metrics."""

import copy
import math

import pytest
import torch

from lpo_fixtures import (CPUStrategy, cpu_cuda_queries, make_actor, make_experiences, make_rollout_samples,
                          make_trainer, max_abs, max_abs_diff, parse_args, plan_group_windows, rank_chunk,
                          run_lpo_step)
from lpo_references import reference_steps
from openrlhf_lpo.core import layout
from openrlhf_lpo.openrlhf.actor_trainer import LPOActorTrainer, detached_entropy, lpo_group_stats

K, G = 4, 4


# ----------------------------------------------------------------------------- layout (pure)


@pytest.mark.parametrize("n,dp,used", [(76, 8, 72), (5, 2, 4), (4, 4, 4), (2, 4, 0), (29, 1, 29)])
def test_ranked_groups_keeps_a_multiple_of_dp(n, dp, used):
    assert layout.ranked_groups(n, dp) == (used, n - used)


def test_assign_groups_equal_counts_and_balance():
    tokens = [100, 1, 1, 1, 100, 1, 1, 1]
    contiguous = layout.assign_groups(tokens, 2, balance=False)
    assert contiguous == [[0, 1, 2, 3], [4, 5, 6, 7]]
    balanced = layout.assign_groups([100, 90, 1, 1, 1, 1, 2, 3], 2, balance=True)
    assert sorted(g for r in balanced for g in r) == list(range(8)) and [len(r) for r in balanced] == [4, 4]
    sums = [sum([100, 90, 1, 1, 1, 1, 2, 3][g] for g in r) for r in balanced]
    assert max(sums) - min(sums) < 90  # contiguous would give 192 vs 7
    with pytest.raises(ValueError, match="evenly"):
        layout.assign_groups([1, 2, 3], 2, balance=False)


def test_forward_chunks_by_samples_and_by_tokens():
    ranks = [list(range(0, 12)), list(range(12, 24))]
    chunks = layout.forward_chunks(ranks, micro=5)
    assert [[len(c) for c in r] for r in chunks] == [[5, 5, 2], [5, 5, 2]]
    assert [i for r in chunks for c in r for i in c] == list(range(24))
    lengths = [10, 3, 7, 1, 9, 9, 2, 2] * 3
    chunks = layout.forward_chunks(ranks, lengths=lengths, budget=20)
    n = max(layout.first_fit_count([lengths[i] for i in r], 20) for r in ranks)
    assert all(len(r) == n for r in chunks)
    assert sorted(i for c in chunks[0] for i in c) == ranks[0] and sorted(i for c in chunks[1] for i in c) == ranks[1]


def test_window_groups_and_micro_batches():
    gids = [g for g in range(6) for _ in range(K)]
    members = layout.group_members(gids, K)
    windows = layout.window_groups(members, 4, torch.Generator().manual_seed(0))
    assert [len(w) for w in windows] == [4, 2]  # the last window holds the rest
    order = [gids[i] for w in windows for g in w for i in g]
    assert order != sorted(order) and sorted(order) == sorted(gids)  # shuffled as whole groups
    mbs = layout.fixed_micro_batches(windows[0], 3)
    assert [len(m) for m in mbs] == [3, 3, 3, 3, 3, 1]
    lengths = list(range(1, 25))
    whole, per_sample = layout.budget_micro_count(windows[0], lengths, budget=60)
    assert per_sample >= (whole or 0)
    batches = layout.budget_micro_batches(windows[0], lengths, 2, whole_groups=True)
    for mb in batches:  # whole groups, members contiguous
        for j in range(0, len(mb), K):
            assert len({gids[i] for i in mb[j:j + K]}) == 1
    with pytest.raises(ValueError, match="members on this rank"):
        layout.group_members(gids[:-1], K)


# ----------------------------------------------------------------------------- experience maker


def test_split_keeps_groups_on_one_rank_and_forward_chunks_follow_rollout_micro_batch(tiny_model_dir):
    args = parse_args(tiny_model_dir, G=8, micro=2, dp=2, train_batch=16, extra=["--rollout.micro_batch_size", "3"])
    exps = make_experiences(args, CPUStrategy(args), make_actor(tiny_model_dir), make_rollout_samples(8, K))
    # the old-log-prob forward runs on --rollout.micro_batch_size samples, not on whole groups
    assert [len(e.sequences) for e in exps] == [3, 3, 3, 3, 3, 1] * 2
    ranks = [rank_chunk(exps, r, 2) for r in range(2)]
    gids = [sorted(int(g) for e in chunk for g in e.info["lpo_gid"]) for chunk in ranks]
    assert gids == [sorted(list(range(0, 4)) * K), sorted(list(range(4, 8)) * K)]
    for e in exps:
        assert [int(g) for g in e.info["lpo_gid"]] == [i // K for i in e.index]


def test_partial_batch_drops_only_what_does_not_divide(tiny_model_dir, caplog):
    args = parse_args(tiny_model_dir, G=4, micro=2, dp=2, train_batch=8)
    exps = make_experiences(args, CPUStrategy(args), make_actor(tiny_model_dir), make_rollout_samples(5, K))
    assert sum(len(e.sequences) for e in exps) == 4 * K  # 5 groups, 2 ranks: 4 train
    ranks = [rank_chunk(exps, r, 2) for r in range(2)]
    assert [sorted({int(g) for e in c for g in e.info["lpo_gid"]}) for c in ranks] == [[0, 1], [2, 3]]
    assert abs(sum(float(t) for e in exps for t in e.info["lpo_target"]) - 4.0) < 1e-12


def test_kl_in_reward_shapes_the_sequence_reward(tiny_model_dir):
    """--algo.kl.init_coef > 0 without use_loss: w* is built from clip(R) - beta * sum_t KL_t."""
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

    from lpo_fixtures import _Tok
    from lpo_references import independent_target
    from openrlhf_lpo.openrlhf.experience_maker import LPOExperienceMaker

    args = parse_args(tiny_model_dir, micro=4, extra=["--algo.kl.init_coef", "0.5"])
    maker = LPOExperienceMaker(None, None, None, None, FixedKLController(0.5), CPUStrategy(args), _Tok())
    samples = make_rollout_samples(G, K, seed=2)
    exps = maker.split_rollout_samples(copy.deepcopy(samples))
    g = torch.Generator().manual_seed(0)
    for e in exps:
        e.action_log_probs = torch.zeros(e.action_mask.shape)
        e.kl = torch.rand(e.action_mask.shape, generator=g) * e.action_mask
    kl_sums = {int(i): float(e.kl[j].double().sum()) for e in exps for j, i in enumerate(e.index)}
    exps = maker.compute_advantages_and_returns(exps)
    import numpy as np

    rewards = np.array([[float(samples[gi * K + k].rewards) - 0.5 * kl_sums[gi * K + k] for k in range(K)]
                        for gi in range(G)])
    want = independent_target(rewards, "std", np.zeros_like(rewards)).reshape(-1)
    got = {int(i): float(e.info["lpo_target"][j]) for e in exps for j, i in enumerate(e.index)}
    assert max(abs(got[i] - want[i]) for i in range(G * K)) < 1e-12


# ----------------------------------------------------------------------------- trainer


def test_partial_last_window_steps_once_and_is_exact(tiny_model_dir, gloo_world1):
    """A partial rollout batch of 3 groups (the recipe's batch is 4) with windows of 2: the optimizer
    steps after 2 groups and after the last 1, each step the gradient of the mean loss over its own
    groups (lr > 0: the second step sees the first's update)."""
    args = parse_args(tiny_model_dir, G=4, micro=2, train_batch=8)
    actor = make_actor(tiny_model_dir)
    state = copy.deepcopy(actor.model.state_dict())
    exps = make_experiences(args, CPUStrategy(args), actor, make_rollout_samples(3, K, seed=8))
    grads, status, trainer = run_lpo_step(args, actor, exps, lr=0.5)
    windows = plan_group_windows(trainer, trainer.replay_buffer.items)
    assert [len(w) for w in windows] == [2, 1] and len(grads) == 2
    refs = reference_steps(tiny_model_dir, state, exps, windows, K=K, lr=0.5)
    for a, b in zip(grads, refs):
        assert max_abs(b) > 1e-3 and max_abs_diff(a, b) < 1e-6 * max_abs(b)


def test_window_shuffle_follows_the_engines_step_count(tiny_model_dir, gloo_world1):
    """A resumed run shuffles its optimizer windows as the uninterrupted run did at the same step: the
    group order is keyed by the engine's optimizer-step count (DeepSpeed's ``global_steps``, restored by
    its load_checkpoint), not by how many updates this process has run (a resume starts that at 0)."""
    from lpo_fixtures import cpu_cuda_queries

    args = parse_args(tiny_model_dir, G=8, micro=4, train_batch=8)  # 8 groups in 4 windows of 2
    actor = make_actor(tiny_model_dir)
    exps = make_experiences(args, CPUStrategy(args), actor, make_rollout_samples(8, K, seed=5))

    def update(trainer, engine_steps):
        actor.model.global_steps = engine_steps  # what DeepSpeedEngine exposes (and restores on resume)
        trainer.replay_buffer.clear()
        for e in exps:
            trainer.replay_buffer.append(copy.deepcopy(e))
        with cpu_cuda_queries():
            trainer.ppo_train(0.0)
        return plan_group_windows(trainer, trainer.replay_buffer.items)

    uninterrupted = make_trainer(LPOActorTrainer, args, CPUStrategy(args), actor)
    runs = [update(uninterrupted, steps) for steps in (0, 4, 8)]  # this process's 1st, 2nd, 3rd update
    assert all(sorted(g for w in r for g in w) == list(range(8)) and len(r) == 4 for r in runs)
    assert runs[0] != runs[1] and runs[1] != runs[2]  # the order really changes from update to update
    resumed = make_trainer(LPOActorTrainer, args, CPUStrategy(args), actor)  # a fresh process after a resume
    assert update(resumed, 8) == runs[2]
    assert update(make_trainer(LPOActorTrainer, args, CPUStrategy(args), actor), 4) == runs[1]


def test_first_window_shortcut_equals_the_pre_pass(tiny_model_dir, gloo_world1):
    """c from s_t (no forward) and c from a no-grad pass at the same parameters give the same step."""
    args = parse_args(tiny_model_dir, micro=2, extra=["--lpo.divergence", "rev"])
    forced = parse_args(tiny_model_dir, micro=2, extra=["--lpo.divergence", "rev", "--lpo.force_two_pass"])
    actor = make_actor(tiny_model_dir)
    state = copy.deepcopy(actor.model.state_dict())
    exps = make_experiences(args, CPUStrategy(args), actor, make_rollout_samples(G, K, seed=12))
    g1, s1, _ = run_lpo_step(args, actor, exps)
    actor.model.load_state_dict(state)
    g2, s2, _ = run_lpo_step(forced, actor, exps)
    assert (s1["lpo/shortcut_windows"], s1["lpo/pre_pass_windows"]) == (1.0, 0.0)
    assert (s2["lpo/shortcut_windows"], s2["lpo/pre_pass_windows"]) == (0.0, 1.0)
    assert max_abs(g2[0]) > 1e-3 and max_abs_diff(g1[0], g2[0]) < 1e-12


def test_pointwise_projection_gradient(tiny_model_dir, gloo_world1):
    args = parse_args(tiny_model_dir, micro=2, extra=["--lpo.projection", "pointwise"])
    actor = make_actor(tiny_model_dir)
    state = copy.deepcopy(actor.model.state_dict())
    exps = make_experiences(args, CPUStrategy(args), actor, make_rollout_samples(G, K, seed=9))
    grads, status, trainer = run_lpo_step(args, actor, exps)
    windows = plan_group_windows(trainer, trainer.replay_buffer.items)
    ref = reference_steps(tiny_model_dir, state, exps, windows, K=K, projection="pointwise")
    assert status["lpo/two_pass"] == 0.0  # linear in s: no no-grad pass needed
    assert max_abs(ref[0]) > 1e-3 and max_abs_diff(grads[0], ref[0]) < 1e-12


def test_entropy_is_logged_without_a_graph(tiny_model_dir, gloo_world1):
    """--actor.entropy_coef 0 (LPO's default): the stock step gets the entropy from detached_entropy,
    equal to OpenRLHF's compute_entropy, with no grad_fn; the gradient is the same as without entropy."""
    from unittest import mock

    import openrlhf.models.actor as actor_mod
    from openrlhf.models.utils import compute_entropy

    seen = []

    def spy(logits):
        out = detached_entropy(logits)
        seen.append((out.requires_grad, float((out - compute_entropy(logits.detach())).abs().max()), logits.shape))
        return out

    args = parse_args(tiny_model_dir, micro=4)
    assert args.actor.entropy_coef == 0.0
    actor = make_actor(tiny_model_dir)
    state = copy.deepcopy(actor.model.state_dict())
    exps = make_experiences(args, CPUStrategy(args), actor, make_rollout_samples(G, K, seed=13))
    with mock.patch("openrlhf_lpo.openrlhf.actor_trainer.detached_entropy", spy):
        grads, status, _ = run_lpo_step(args, actor, exps)
    assert seen and all(not rg for rg, _, _ in seen) and max(d for _, d, _ in seen) < 1e-5
    assert actor_mod.compute_entropy is compute_entropy  # the swap is scoped to the step
    assert status["response_entropy"] > 0
    args.actor.entropy_coef = None  # no entropy at all: same gradient
    actor.model.load_state_dict(state)
    g2, _, _ = run_lpo_step(args, actor, exps)
    assert max_abs_diff(grads[0], g2[0]) == 0.0


def test_detached_entropy_chunks_long_sequences():
    from openrlhf.models.utils import compute_entropy

    logits = torch.randn(2, 300, 50, dtype=torch.float64)
    got = detached_entropy(logits, max_elements=7 * 2 * 50)  # chunks of 7 positions
    assert torch.allclose(got, compute_entropy(logits), atol=1e-12) and not got.requires_grad


def test_metrics_match_independent_computation(tiny_model_dir, gloo_world1):
    args = parse_args(tiny_model_dir, micro=2, extra=["--lpo.divergence", "fwd", "--lpo.end_kl"])
    actor = make_actor(tiny_model_dir)
    samples = make_rollout_samples(G, K, seed=10)
    exps = make_experiences(args, CPUStrategy(args), actor, samples)
    strategy = CPUStrategy(args)
    trainer = make_trainer(LPOActorTrainer, args, strategy, actor, lr=50.0)  # a large step: end != start
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
    assert status["lpo/abs_coef_mean"] > 0 and status["lpo/shortcut_windows"] == 1.0
    assert abs(status["lpo/kl_end"] - status["lpo/kl_start"]) > 1e-3
    from lpo_references import reference_listwise_stats

    ref = reference_listwise_stats(actor, exps, K, "std", args.actor.eps_clip_low_high)  # brute force, end of update
    assert status["lpo/kl_end"] == pytest.approx(ref["kl"], abs=1e-10)
    assert status["lpo/entropy_p_end"] == pytest.approx(ref["entropy_p"], abs=1e-10)
    for key in ("actor_grad_norm", "response_length", "response_entropy", "policy_loss", "clip_ratio"):
        assert key in status, key
    assert status["actor_grad_norm"] > 0 and status["response_entropy"] > 0
    # group stats helper against a direct formula
    s = torch.randn(3, K, dtype=torch.float64)
    st = lpo_group_stats(s, w[:3])
    p = torch.softmax(s, 1)
    assert torch.allclose(st["kl"], (w[:3] * (w[:3].log() - p.log())).sum(1))
    assert torch.allclose(st["entropy_p"], -(p * p.log()).sum(1))


def test_behaviour_statistics_are_logged(tiny_model_dir, gloo_world1):
    """Off-policy data: mean |s_t|, max |s_t| and the ESS of softmax(s_t) against a direct computation."""
    args = parse_args(tiny_model_dir, micro=4, extra=["--algo.advantage.is_correction_level", "token",
                                                      "--algo.advantage.is_correction_mode", "clip"])
    actor = make_actor(tiny_model_dir)
    exps = make_experiences(args, CPUStrategy(args), actor, make_rollout_samples(G, K, seed=14), behaviour_noise=0.3)
    _, status, trainer = run_lpo_step(args, actor, exps)
    items = sorted(trainer.replay_buffer.items, key=lambda it: int(it.info.get("lpo_gid", 0)))
    d = torch.tensor([float(e.info["lpo_prev_log_ratio"][j]) for e in exps for j in range(len(e.index))],
                     dtype=torch.float64)
    gids = torch.tensor([int(g) for e in exps for g in e.info["lpo_gid"]])
    d = d[torch.argsort(gids, stable=True)].view(G, K)
    p = torch.softmax(d, 1)
    assert items and status["lpo/behaviour_abs_mean"] == pytest.approx(float(d.abs().mean()), rel=1e-9)
    assert status["lpo/behaviour_abs_max"] == pytest.approx(float(d.abs().max()), rel=1e-9)
    assert status["lpo/behaviour_ess"] == pytest.approx(float((1 / (p * p).sum(1) / K).mean()), rel=1e-9)
    assert 0.0 < status["lpo/behaviour_ess"] < 1.0 and status["lpo/behaviour_abs_max"] > 0.01


def test_a_registered_projection_trains_its_own_gradient_in_every_path(tiny_model_dir, gloo_world1):
    """A new projection (squared error between P and w*): one pass (micro-batches of whole groups) and
    the detached surrogate with c from a pre-pass (micro-batches that split groups) give one gradient."""
    from openrlhf_lpo import listwise

    name = "l2_test_projection"
    if name not in listwise.PROJECTIONS:
        @listwise.register_projection(name)
        def _l2(log_ratio, target, divergence):
            return ((torch.softmax(log_ratio, -1) - target) ** 2).sum(-1)
    try:
        grads = {}
        for micro, extra in ((4, []), (2, ["--lpo.force_two_pass"])):
            args = parse_args(tiny_model_dir, micro=micro, extra=["--lpo.projection", name, *extra])
            actor = make_actor(tiny_model_dir)
            exps = make_experiences(args, CPUStrategy(args), actor, make_rollout_samples(G, K, seed=15))
            grads[micro], status, _ = run_lpo_step(args, actor, exps)
        assert max_abs(grads[4][0]) > 1e-4
        assert max_abs_diff(grads[4][0], grads[2][0]) < 1e-6 * max_abs(grads[4][0])
    finally:
        listwise.PROJECTIONS.pop(name, None)


# ----------------------------------------------------------------------------- no-grad passes under dynamic batching


def test_budget_partition_never_exceeds_the_budget():
    """Karmarkar-Karp (what the micro-batches used alone) can put more than the budget into one part even
    when first fit needs no more parts; the partition then falls back to first-fit bins split to the
    agreed count. Planted: 19 samples, budget 86 tokens, 7 micro-batches (first fit needs 7)."""
    weights = [28, 53, 12, 37, 47, 39, 36, 20, 22, 18, 24, 10, 52, 6, 42, 14, 32, 18, 58]
    assert layout.first_fit_count(weights, 86) == 7
    assert max(sum(weights[j] for j in p) for p in layout._partitions(weights, 7, False)) == 88  # KK alone: over
    assert max(sum(weights[j] for j in p) for p in layout.budget_partition(weights, 7, 86)) <= 86
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        n = int(torch.randint(1, 25, (1,), generator=g))
        weights = torch.randint(1, 60, (n,), generator=g).tolist()
        budget = int(torch.randint(40, 130, (1,), generator=g))
        need = layout.first_fit_count(weights, budget)
        for parts_n in range(need, min(need + 3, n) + 1):
            parts = layout.budget_partition(weights, parts_n, budget)
            assert len(parts) == parts_n and sorted(j for p in parts for j in p) == list(range(n))
            assert all(len(p) == 1 or sum(weights[j] for j in p) <= budget for p in parts), (weights, budget, parts)


def test_pre_pass_and_end_kl_follow_the_token_budget(tiny_model_dir, gloo_world1):
    """Under --train.dynamic_batch_enable the later windows' no-grad pre-pass runs the window's own
    token-budget micro-batches (the plan's), and the --lpo.end_kl pass budget micro-batches, never over
    --train.max_tokens_per_gpu, instead of one forward per sample at micro 1. Forwards are counted on the
    real actor; the gradient stays exact (the dynamic rows of test_lpo_gradient_exactness)."""
    budget = 40
    args = parse_args(tiny_model_dir, micro=1, train_batch=8, packing=True, extra=[
        "--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", str(budget), "--rollout.max_tokens_per_gpu",
        str(budget), "--train.max_epochs", "2", "--lpo.end_kl"])
    actor = make_actor(tiny_model_dir, packing=True)
    exps = make_experiences(args, CPUStrategy(args), actor, make_rollout_samples(G, K, seed=2))
    forwards = []
    real_forward = actor.forward

    def counting_forward(sequences, *a, **kw):  # the real forward, recorded
        forwards.append((torch.is_grad_enabled(), int(kw["attention_mask"].bool().sum())))
        return real_forward(sequences, *a, **kw)

    actor.forward = counting_forward
    grads, status, trainer = run_lpo_step(args, actor, exps, lr=0.5)
    items = trainer.replay_buffer.items
    tokens = [int(it.total_length.reshape(-1)[0]) for it in items]
    plans = trainer.last_update.windows
    assert [p.mode for p in plans] == ["shortcut", "pre_pass", "pre_pass", "pre_pass"]
    assert len(grads) == 4 and status["lpo/kl_end"] >= 0.0
    no_grad = [t for grad, t in forwards if not grad]
    # per pre-pass window: the plan's micro-batches, in order; then the end-of-update pass
    expected = [sum(tokens[i] for i in mb) for p in plans if p.mode == "pre_pass" for mb in p.micro_batches]
    end = trainer.pass_shapes[-1]
    assert no_grad == expected + end
    assert trainer.pass_shapes[:-1] == [[sum(tokens[i] for i in mb) for mb in p.micro_batches]
                                        for p in plans if p.mode == "pre_pass"]
    assert len(end) == layout.first_fit_count(tokens, budget) < len(items)
    assert max(no_grad) <= budget and max(t for grad, t in forwards if grad) <= budget
    n_pre_pass_samples = sum(len(mb) for p in plans if p.mode == "pre_pass" for mb in p.micro_batches)
    assert len(no_grad) < n_pre_pass_samples + len(items)  # one forward per sample before
    print(f"\n[F12] no-grad forwards {len(no_grad)} for {n_pre_pass_samples + len(items)} samples, "
          f"tokens {no_grad} (budget {budget})")
