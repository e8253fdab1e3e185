"""Matched pairs through the shipped method files: at the first, on-policy step the gradient of each baseline recipe
(configs/methods/<baseline>.sh, read as the launch scripts read it) and of its LPO-rev pair have cosine >= 0.999999
wherever the paper's Prop. 1 applies, on the real trainer (LPOActorTrainer, OpenRLHF's training_step and losses) and
a real experience maker; docs/methods.md "Matched pairs" states where it does not apply and by how much.

* GRPO, Dr.GRPO, MaxRL, RLOO: per-response aggregation on both sides (the recipes' seq-mean-token-mean): exact.
* GSPO: its sequence ratio is LPO's length-normalised s and its aggregation per response: exact.
* Clip-Cov detaches the gradient of at least one token per micro-batch (token-mean as well): never exact.
* DAPO, CISPO, KL-Cov (token-level losses by definition; KL-Cov's |log r| adds nothing at r = 1) and REINFORCE++-baseline (token-weighted whitening, whose batch mean
  shift no group softmax represents): exact when every response has the same length; with lengths that differ the
  token weighting n_k B / N (and the shift) make the pair differ (cosine below 1, measured here and in
  benchmarks/pairing_cosines.py).
"""

import copy

import pytest
import torch

from lpo_fixtures import (CPUStrategy, cpu_cuda_queries, equal_length_samples, make_actor, make_experiences,
                          make_rollout_samples, make_trainer, parse_args)
from recipe_flags import method_flags

from openrlhf_lpo.core.config import PAIRED_METHODS
from openrlhf_lpo.openrlhf.actor_trainer import LPOActorTrainer
from openrlhf_lpo.openrlhf.cispo import policy_loss_types

K, G = 4, 4
TOKEN_WEIGHTED = ("dapo", "cispo", "kl_cov", "reinforce_pp")  # exact only when lengths carry no weight
INEXACT = ("clip_cov",)  # detaches the gradient of at least one selected token per micro-batch, whatever the lengths


def _step(tiny_model_dir, actor, state, method, samples):
    """One on-policy optimizer step (one window of every sample) of the method file's flags; its gradient."""
    flags = method_flags(method, **{"rollout.max_new_tokens": 64})  # DAPO's overlong buffer: 12 of 64, never reached
    args = parse_args(tiny_model_dir, estimator=flags[1], micro=2, train_batch=G * K, extra=flags[2:])
    actor.model.load_state_dict(state)
    exps = make_experiences(args, CPUStrategy(args), actor, samples)
    strategy = CPUStrategy(args)
    with policy_loss_types():  # --actor.policy_loss_type cispo, as the policy actor builds its trainer
        trainer = make_trainer(LPOActorTrainer, args, strategy, actor)
    for e in exps:
        trainer.replay_buffer.append(copy.deepcopy(e))
    with cpu_cuda_queries("cpu"):
        trainer.ppo_train(0.0)
    assert len(strategy.step_grads) == 1
    return torch.cat([g.double().reshape(-1) for g in strategy.step_grads[0]])


def _cosine(a, b):
    return float(a @ b / (a.norm() * b.norm()))


@pytest.fixture(scope="module")
def batches():
    return {"lengths differ": make_rollout_samples(G, K, seed=2), "equal lengths": equal_length_samples(2, G, K, 5)}


CASES = [(b, lengths) for b in PAIRED_METHODS for lengths in ("lengths differ",)] + \
        [(b, "equal lengths") for b in TOKEN_WEIGHTED]


@pytest.mark.parametrize("baseline,lengths", CASES, ids=[f"{b}-{'equal' if e == 'equal lengths' else 'unequal'}"
                                                         for b, e in CASES])
def test_first_step_of_each_pair(tiny_model_dir, gloo_world1, batches, baseline, lengths):
    actor = make_actor(tiny_model_dir)
    state = copy.deepcopy(actor.model.state_dict())
    samples = batches[lengths]
    pg = _step(tiny_model_dir, actor, state, baseline, samples)
    lpo = _step(tiny_model_dir, actor, state, PAIRED_METHODS[baseline]["rev"], samples)
    assert float(pg.norm()) > 1e-3 and float(lpo.norm()) > 1e-3
    cos = _cosine(pg, lpo)
    print(f"\n[matched pairs] {baseline} vs {PAIRED_METHODS[baseline]['rev']} ({lengths}): cosine {cos:.9f}, "
          f"|g| ratio {float(lpo.norm() / pg.norm()):.6f}")
    if (lengths == "equal lengths" or baseline not in TOKEN_WEIGHTED) and baseline not in INEXACT:
        assert cos >= 0.999999, cos  # Prop. 1
        assert float((pg - lpo).norm() / pg.norm()) < 1e-5  # the same gradient, not only its direction
    else:
        assert cos < 0.9999, cos  # the token weighting is not a rounding error (docs/methods.md gives the size)
