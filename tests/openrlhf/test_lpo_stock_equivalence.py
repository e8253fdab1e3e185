"""Without lpo the experience maker is stock OpenRLHF and the update is stock OpenRLHF's training_step and losses
(in core/update.py's windows); MaxRL advantages. Prop. 1 (on-policy LPO-rev == its baseline): test_matched_pairs.py."""

import copy

import pytest
import torch

from lpo_fixtures import (CPUStrategy, cpu_cuda_queries, make_actor, make_experiences, make_rollout_samples,
                          make_trainer, max_abs, max_abs_diff, parse_args)
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
def test_policy_gradient_update_is_stock_openrlhf(tiny_model_dir, gloo_world1, estimator, agg):
    """A policy-gradient update through core/update.py (this project's seeded windows, OpenRLHF's training_step and
    PolicyLoss) against stock ActorPPOTrainer.ppo_train: with one window per epoch (2 epochs, shuffled micro-batches)
    the window order cannot matter, so both take the same 2 steps (to float32 summation order)."""
    args = parse_args(tiny_model_dir, estimator=estimator, micro=2, train_batch=G * K,
                      extra=["--actor.loss_agg_mode", agg, "--train.max_epochs", "2"])
    actor = make_actor(tiny_model_dir)
    state = copy.deepcopy(actor.model.state_dict())
    exps = make_experiences(args, CPUStrategy(args), actor, make_rollout_samples(G, K, seed=4), maker_cls=RemoteExperienceMaker)
    out = {}
    for cls in (ActorPPOTrainer, LPOActorTrainer):
        actor.model.load_state_dict(state)
        strategy = CPUStrategy(args)
        trainer = make_trainer(cls, args, strategy, actor, lr=0.1)
        assert type(getattr(trainer.actor_loss_fn, "inner", trainer.actor_loss_fn)) is PolicyLoss
        for e in exps:
            trainer.replay_buffer.append(copy.deepcopy(e))
        torch.manual_seed(123)  # the stock DataLoader shuffle
        with cpu_cuda_queries("cpu"):
            status = trainer.ppo_train(0.0)
        out[cls.__name__] = (strategy.step_grads, status)
    (g_stock, _), (g_ours, s_ours) = out["ActorPPOTrainer"], out["LPOActorTrainer"]
    assert len(g_stock) == len(g_ours) == 2
    assert max_abs(g_stock[0]) > 1e-4
    for a, b in zip(g_stock, g_ours):
        assert max_abs_diff(a, b) < 1e-5 * max_abs(a)
    assert s_ours["optimizer_steps"] == 2.0


@pytest.mark.parametrize("estimator,agg", [("group_norm", "token-mean"), ("reinforce_baseline", "seq-mean-token-mean")])
def test_policy_gradient_policy_loss_is_the_window_objective(tiny_model_dir, gloo_world1, estimator, agg):
    """``policy_loss`` of a policy-gradient update (one on-policy window: ratio 1, no clipping) is its objective as
    the aggregation defines it, from the advantages: -sum A / tokens (token-mean), -mean over responses of the
    response's token mean of A (seq-mean-token-mean; GRPO's is 0 there, its advantages sum to 0 per group)."""
    args = parse_args(tiny_model_dir, estimator=estimator, micro=2, train_batch=G * K,
                      extra=["--actor.loss_agg_mode", agg])
    actor = make_actor(tiny_model_dir)
    exps = make_experiences(args, CPUStrategy(args), actor, make_rollout_samples(G, K, seed=4),
                            maker_cls=RemoteExperienceMaker)
    trainer = make_trainer(LPOActorTrainer, args, CPUStrategy(args), actor, lr=0.1)
    for e in exps:
        trainer.replay_buffer.append(copy.deepcopy(e))
    with cpu_cuda_queries("cpu"):
        status = trainer.ppo_train(0.0)
    adv = [(e.advantages.double() * e.action_mask).sum(-1) for e in exps]  # per response (widths differ)
    tokens = [e.action_mask.double().sum(-1) for e in exps]
    adv, tokens = torch.cat(adv), torch.cat(tokens)
    ref = -float(adv.sum() / tokens.sum()) if agg == "token-mean" else -float((adv / tokens).mean())
    assert abs(ref) > 1e-3
    assert status["policy_loss"] == pytest.approx(ref, rel=1e-5, abs=1e-7)


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
