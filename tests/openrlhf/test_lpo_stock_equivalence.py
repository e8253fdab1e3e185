"""Without lpo the pipeline is stock OpenRLHF; MaxRL advantages; Prop. 1 (on-policy LPO-rev == GRPO)."""

import copy

import pytest
import torch

from lpo_fixtures import (CPUStrategy, cpu_cuda_queries, make_actor, make_experiences, make_rollout_samples,
                          make_trainer, max_abs, max_abs_diff, parse_args, run_lpo_step)
from openrlhf.models import PolicyLoss
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

from openrlhf_lpo.openrlhf.actor_trainer import LPOActorTrainer, LPOPolicyLoss
from openrlhf_lpo.openrlhf.experience_maker import LPOExperienceMaker

K, G = 4, 4
STOCK_ESTIMATORS = ["reinforce", "rloo", "reinforce_baseline", "group_norm", "dr_grpo", "flash_reinforce"]


def _fields(exp):
    return {
        "advantages": exp.advantages, "returns": exp.returns, "index": exp.index,
        "info": {k: v for k, v in exp.info.items()},
    }


@pytest.mark.parametrize("estimator", STOCK_ESTIMATORS)
def test_experience_maker_is_stock_for_other_estimators(tiny_model_dir, estimator):
    args = parse_args(tiny_model_dir, estimator=estimator, micro=2)
    actor = make_actor(tiny_model_dir)
    samples = make_rollout_samples(G, K, seed=3)
    ours = make_experiences(args, CPUStrategy(args), actor, samples, maker_cls=LPOExperienceMaker)
    stock = make_experiences(args, CPUStrategy(args), actor, samples, maker_cls=RemoteExperienceMaker)
    assert len(ours) == len(stock)
    for a, b in zip(ours, stock):
        fa, fb = _fields(a), _fields(b)
        assert torch.equal(fa["advantages"], fb["advantages"]) and torch.equal(fa["returns"], fb["returns"])
        assert fa["index"] == fb["index"] and fa["info"].keys() == fb["info"].keys()
        for k in fa["info"]:
            assert torch.equal(fa["info"][k], fb["info"][k]), k
    # and the advantages are not trivially zero
    assert max(float(e.advantages.abs().max()) for e in stock) > 0.1


@pytest.mark.parametrize("estimator,agg", [("group_norm", "token-mean"), ("dr_grpo", "seq-mean-token-mean"),
                                           ("rloo", "token-mean")])
def test_actor_trainer_is_stock_for_other_estimators(tiny_model_dir, gloo_world1, estimator, agg):
    """Same ppo_train (2 optimizer steps, shuffled micro-batches): same loss and same gradients."""
    args = parse_args(tiny_model_dir, estimator=estimator, micro=2, train_batch=8,
                      extra=["--actor.loss_agg_mode", agg])
    actor = make_actor(tiny_model_dir)
    state = copy.deepcopy(actor.model.state_dict())
    exps = make_experiences(args, CPUStrategy(args), actor, make_rollout_samples(G, K, seed=4), maker_cls=RemoteExperienceMaker)
    out = {}
    for cls in (ActorPPOTrainer, LPOActorTrainer):
        actor.model.load_state_dict(state)
        strategy = CPUStrategy(args)
        trainer = make_trainer(cls, args, strategy, actor, lr=0.1)
        assert type(trainer.actor_loss_fn) is PolicyLoss
        for e in exps:
            trainer.replay_buffer.append(copy.deepcopy(e))
        torch.manual_seed(123)  # the stock DataLoader shuffle
        with cpu_cuda_queries("cpu"):
            status = trainer.ppo_train(0.0)
        out[cls.__name__] = (strategy.step_grads, status)
    (g_stock, s_stock), (g_ours, s_ours) = out["ActorPPOTrainer"], out["LPOActorTrainer"]
    assert len(g_stock) == len(g_ours) == 2
    for a, b in zip(g_stock, g_ours):
        assert max_abs_diff(a, b) == 0.0
    assert max_abs(g_stock[0]) > 1e-4
    assert s_stock["policy_loss"] == s_ours["policy_loss"]


def test_maxrl_advantages(tiny_model_dir):
    args = parse_args(tiny_model_dir, estimator="maxrl", micro=2)
    actor = make_actor(tiny_model_dir)
    samples = make_rollout_samples(G, K, seed=5)
    for k in range(K):  # an all-fail group: mean 0 -> advantages 0, never inf
        samples[K * 2 + k].rewards = torch.tensor([0.0])
    exps = make_experiences(args, CPUStrategy(args), actor, samples, maker_cls=LPOExperienceMaker)
    rewards = torch.tensor([float(s.rewards) for s in samples]).view(G, K).double()
    for e in exps:
        for row, i in enumerate(e.index):
            r = rewards[i // K]
            mean = float(r.mean())
            expected = 0.0 if mean == 0 or float(r.max() - r.min()) == 0 else (float(r[i % K]) - mean) / mean
            tokens = e.action_mask[row].bool()
            assert torch.allclose(e.advantages[row][tokens].double(), torch.full((int(tokens.sum()),), expected,
                                  dtype=torch.float64), atol=1e-6), (i, expected)


def test_prop1_on_policy_lpo_rev_equals_grpo(tiny_model_dir, gloo_world1):
    """One optimizer step, on-policy: LPO-rev (listwise loss averaged over prompts, tau = std) has
    the gradient of GRPO (group_norm, seq-mean-token-mean, averaged over responses): Prop. 1."""
    samples = make_rollout_samples(G, K, seed=6)
    lpo_args = parse_args(tiny_model_dir, micro=2, extra=["--lpo.divergence", "rev", "--lpo.temperature", "std"])
    grpo_args = parse_args(tiny_model_dir, estimator="group_norm", micro=2,
                           extra=["--actor.loss_agg_mode", "seq-mean-token-mean"])
    actor = make_actor(tiny_model_dir)
    state = copy.deepcopy(actor.model.state_dict())

    lpo_exps = make_experiences(lpo_args, CPUStrategy(lpo_args), actor, samples, noise=0.0)
    lpo_grads, status, _ = run_lpo_step(lpo_args, actor, lpo_exps)
    assert status["lpo/shortcut_windows"] == 1.0  # micro-batches split groups: c from s_t

    actor.model.load_state_dict(state)
    grpo_exps = make_experiences(grpo_args, CPUStrategy(grpo_args), actor, samples, noise=0.0,
                                 maker_cls=RemoteExperienceMaker)
    strategy = CPUStrategy(grpo_args)
    trainer = make_trainer(ActorPPOTrainer, grpo_args, strategy, actor)
    for e in grpo_exps:
        trainer.replay_buffer.append(copy.deepcopy(e))
    with cpu_cuda_queries("cpu"):
        trainer.ppo_train(0.0)
    assert len(lpo_grads) == len(strategy.step_grads) == 1
    scale = max_abs(strategy.step_grads[0])
    assert scale > 1e-3
    # GRPO divides by std + 1e-9, LPO by std: relative difference ~1e-9
    assert max_abs_diff(lpo_grads[0], strategy.step_grads[0]) < 1e-7 * scale

    # off-policy (s_t != 0 from the behaviour log-probs) the two differ: the check above is not vacuous
    off_args = parse_args(tiny_model_dir, micro=2, extra=["--lpo.divergence", "rev", "--lpo.temperature", "std",
                                                          "--algo.advantage.is_correction_level", "token",
                                                          "--algo.advantage.is_correction_mode", "clip"])
    actor.model.load_state_dict(state)
    off = make_experiences(off_args, CPUStrategy(off_args), actor, samples, behaviour_noise=0.3)
    actor.model.load_state_dict(state)
    off_grads, _, _ = run_lpo_step(off_args, actor, off)
    assert max_abs_diff(off_grads[0], strategy.step_grads[0]) > 1e-3 * scale


def test_lpo_policy_loss_mirrors_policy_loss_signature():
    """The stock parameters in the stock order, then the micro-batch as a keyword-only argument; no state."""
    import inspect

    params = inspect.signature(LPOPolicyLoss.forward).parameters
    assert list(params)[:-1] == list(inspect.signature(PolicyLoss.forward).parameters)
    assert list(params)[-1] == "micro_batch" and params["micro_batch"].kind is inspect.Parameter.KEYWORD_ONLY
    loss = LPOPolicyLoss(0.2, 0.2)
    assert not hasattr(loss, "context")
    with pytest.raises(RuntimeError, match="needs its micro_batch argument"):
        loss(torch.zeros(2, 3), torch.zeros(2, 3), None, torch.ones(2, 3, dtype=torch.bool))


def test_packing_path_is_really_packed(tiny_model_dir):
    """The packed Actor goes through OpenRLHF's unpad/pack path and gives the unpacked log-probs."""
    from unittest import mock

    import openrlhf.models.actor as actor_mod
    from openrlhf.trainer.ppo_utils.experience import make_experience_batch, split_experience_batch

    args = parse_args(tiny_model_dir, micro=8)
    plain, packed = make_actor(tiny_model_dir), make_actor(tiny_model_dir, packing=True)
    exps = make_experiences(args, CPUStrategy(args), plain, make_rollout_samples(G, K, seed=7))
    batch = make_experience_batch([it for e in exps for it in split_experience_batch(copy.deepcopy(e))])
    with torch.no_grad():
        a = plain(batch.sequences, batch.action_mask, attention_mask=batch.attention_mask)
        with mock.patch.object(actor_mod, "unpad_and_slice_tensor", wraps=actor_mod.unpad_and_slice_tensor) as spy:
            b = packed(batch.sequences, batch.action_mask, attention_mask=batch.attention_mask)
    assert spy.call_count == 1
    assert float((a - b).abs().max()) < 1e-6 and float(a.abs().max()) > 1.0
