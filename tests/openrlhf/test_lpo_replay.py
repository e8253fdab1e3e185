"""Listwise replay's parts on real OpenRLHF Experiences (the exactness of training on replayed groups is
in test_lpo_gradient_exactness.py, the end-to-end run in tests/pipeline/test_e2e_research.py):
the buffer's seeded draw (whole groups, without replacement, the ages), a save/load round trip that
draws the same, what the experience maker stores (the engine's behaviour log-probs, else the
start-of-update actor's, exactly), a replay step with an empty buffer equals a step without replay,
and the rollout metrics count fresh samples only."""

import copy

import pytest
import torch

from lpo_fixtures import (CPUStrategy, make_actor, make_experiences, make_replay_experiences,
                          make_rollout_samples, parse_args, sample_key)
from openrlhf_lpo.openrlhf.replay import ReplayBuffer, fingerprint

K, G = 4, 4


def _groups(seed, n=G, tag="p"):
    samples = make_rollout_samples(n, K, seed=seed)
    for i, s in enumerate(samples):
        s.prompts = [f"{tag}-{i // K}"]
        s.rollout_log_probs = torch.randn(s.action_mask.shape, generator=torch.Generator().manual_seed(i)) \
            * s.action_mask
    return [samples[g * K:(g + 1) * K] for g in range(n)]


def _keys(groups):
    return [tuple(sample_key(m) for m in g) for g in groups]


def test_draw_is_seeded_whole_groups_without_replacement(tmp_path):
    buf = ReplayBuffer(batches=2, seed=7)
    a, b, c = _groups(1, tag="a"), _groups(2, tag="b"), _groups(3, tag="c")
    buf.add(a, step=0)
    buf.add(b, step=1)
    buf.add(c, step=2)  # the buffer keeps the last 2 batches: a is gone
    assert buf.num_groups == 2 * G
    drawn = buf.draw(5, step=3)
    keys = _keys(drawn)
    assert len(keys) == len(set(keys)) == 5
    assert set(keys) <= set(_keys(b) + _keys(c)) and not set(keys) & set(_keys(a))
    for g in drawn:
        assert len(g) == K and len({m.prompts[0] for m in g}) == 1
        born = 1 if g[0].prompts[0].startswith("b") else 2
        assert all(float(m.info["lpo_replay_age"]) == 3 - born and float(m.info["lpo_replayed"]) == 1 for m in g)
    assert _keys(buf.draw(5, step=3)) == keys  # seeded by the step
    assert _keys(buf.draw(5, step=4)) != keys
    assert len(buf.draw(100, step=3)) == 2 * G  # at most what it holds
    # the draws are copies: changing one does not change the buffer
    drawn[0][0].rewards += 5.0
    assert float(buf.draw(5, step=3)[0][0].rewards) == float(drawn[0][0].rewards) - 5.0
    # save / load (weights_only) round trip: the same records, the same draws
    path = tmp_path / "replay.pt"
    buf.save(str(path))
    again = ReplayBuffer(batches=2, seed=7)
    again.load_file(str(path))
    assert again.num_groups == buf.num_groups
    for x, y in zip(sum(again.draw(8, 9), []), sum(buf.draw(8, 9), [])):
        for f in ("sequences", "attention_mask", "action_mask", "rollout_log_probs", "rewards", "total_length"):
            assert torch.equal(getattr(x, f), getattr(y, f)), f
        assert x.prompts == y.prompts and x.info.keys() == y.info.keys()
    with pytest.raises(ValueError, match="behaviour log-probs"):
        ReplayBuffer(1, 0).add([[make_rollout_samples(1, K)[0]]], step=0)


@pytest.fixture(scope="module")
def actor(tiny_model_dir):
    return make_actor(tiny_model_dir)


@pytest.mark.parametrize("engine_log_probs", [False, True])
def test_the_buffer_keeps_each_fresh_groups_behaviour_log_probs(tiny_model_dir, actor, gloo_world1, engine_log_probs):
    """After the forward the maker stores the fresh rollout with its behaviour log-probs: the engine's
    (rollout_log_probs) when the rollout has them, else the start-of-update actor's, bit for bit."""
    extra = ["--lpo.replay_batches", "2"]
    if engine_log_probs:
        extra += ["--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_mode", "clip",
                  "--algo.advantage.is_correction_threshold", "0.5", "1.5"]
    args = parse_args(tiny_model_dir, K=K, G=G, micro=2, extra=extra)
    fresh = make_rollout_samples(G, K, seed=5)
    exps, info = make_replay_experiences(args, CPUStrategy(args), actor, fresh, [], seed=1, step=0,
                                         behaviour_noise=0.3 if engine_log_probs else 0.0)
    assert info["status"]["lpo/replay_groups"] == 0 and info["status"]["lpo/replay_buffer_groups"] == G
    rows = {}  # the experiences' behaviour and pi_t rows, by sample
    for e in exps:
        for r in range(len(e.index)):
            key = tuple(e.sequences[r][e.attention_mask[r].bool()].tolist())
            width = int(e.attention_mask[r].sum()) - 1
            rows[key] = (e.rollout_log_probs[r, :width], e.action_log_probs[r, :width], e.action_mask[r, :width])
    buf = info["buffer"]
    stored = sum(buf.draw(G, step=1), [])
    assert len(stored) == G * K
    for m in stored:
        behaviour, pi_t, mask = rows[sample_key(m)]
        assert torch.equal(m.rollout_log_probs[0], behaviour.float())
        if not engine_log_probs:  # no engine log-probs: pi_t is the behaviour policy (sync mode)
            assert torch.equal(m.rollout_log_probs[0] * mask, (pi_t * mask).float())
        else:
            assert float(((m.rollout_log_probs[0] - pi_t.float()) * mask).abs().max()) > 1e-2  # the engine's
        assert "lpo_gid" not in m.info and m.action_log_probs is None


def test_an_empty_buffer_changes_nothing(tiny_model_dir, actor, gloo_world1):
    """Step 1 of a replay run (nothing to replay yet) makes the experiences of a run without replay."""
    fresh = make_rollout_samples(G, K, seed=6)
    plain_args = parse_args(tiny_model_dir, K=K, G=G, micro=2)
    plain = make_experiences(plain_args, CPUStrategy(plain_args), actor, fresh)
    args = parse_args(tiny_model_dir, K=K, G=G, micro=2, extra=["--lpo.replay_batches", "1"])
    with_replay, _ = make_replay_experiences(args, CPUStrategy(args), actor, fresh, [], step=0)
    assert len(plain) == len(with_replay)
    for a, b in zip(plain, with_replay):
        assert a.index == b.index and torch.equal(a.sequences, b.sequences)
        for key in ("lpo_target", "lpo_prev_log_ratio", "lpo_gid", "lpo_tau", "lpo_reward"):
            assert torch.equal(a.info[key], b.info[key]) or (key == "lpo_tau" and torch.equal(
                a.info[key].isnan(), b.info[key].isnan())), key
        assert float(b.info["lpo_prev_log_ratio"].abs().max()) == 0.0


def test_fresh_rollout_stats_leave_replayed_samples_out(tiny_model_dir, actor, gloo_world1):
    from openrlhf.trainer.ppo_trainer import BasePPOTrainer

    from openrlhf_lpo.openrlhf.research import TrainerExtensions

    args = parse_args(tiny_model_dir, K=K, G=G, micro=2, extra=["--lpo.replay_batches", "2"])
    old = _groups(11, n=G, tag="old")
    exps, info = make_replay_experiences(args, CPUStrategy(args), actor, make_rollout_samples(G, K, seed=6), old,
                                         step=1)
    assert info["status"]["lpo/replay_groups"] == G
    fresh_rewards = torch.cat([e.info["reward"][e.info["lpo_replayed"] == 0] for e in exps])
    assert fresh_rewards.numel() == G * K
    ext = TrainerExtensions.__new__(TrainerExtensions)
    ext.replay = info["buffer"]
    stats = ext.fresh_rollout_stats(exps, lambda e: BasePPOTrainer._compute_rollout_stats(None, e))
    assert stats["rollout/num_samples"] == G * K
    assert stats["rollout/reward_mean"] == pytest.approx(float(fresh_rewards.float().mean()))
    all_rewards = torch.cat([e.info["reward"] for e in exps]).float().mean()
    assert abs(float(all_rewards) - stats["rollout/reward_mean"]) > 1e-4  # the replayed ones would change it


def test_fingerprint_is_order_free_and_sees_tokens():
    groups = _groups(4)
    rows = [(m.sequences, m.attention_mask) for g in groups for m in g]
    assert fingerprint(rows) == fingerprint(rows[::-1])
    changed = copy.deepcopy(groups)
    changed[0][0].sequences[0, -1] += 1
    assert fingerprint((m.sequences, m.attention_mask) for g in changed for m in g) != fingerprint(rows)
