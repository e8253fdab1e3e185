"""The two guards of the LPO trainers' ``train_step`` (ray_classes._LPOTrainerMixin), each with a test that
fails when the guard breaks:

* a rollout batch with fewer prompt groups than data-parallel ranks (an episode's last batch) is skipped
  with a warning: without the guard the experience maker raises and the run dies at the episode's end;
* a partial last batch with at least one group per rank is trained (its remainder dropped), not skipped.

Below the mixin sits the first stage of the stock ``BasePPOTrainer.train_step``: the real
``LPOExperienceMaker.split_rollout_samples`` (the rest of the stock step needs the Ray actor groups; the
partial batch trains end to end in tests/pipeline/test_e2e_hybrid.py and test_e2e_families.py).
"""

import pytest

from lpo_fixtures import CPUStrategy, make_rollout_samples, parse_args
from openrlhf.trainer import ppo_trainer as ppo_trainer_mod
from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

from openrlhf_lpo.openrlhf import experience_maker as em
from openrlhf_lpo.openrlhf.ray_classes import _LPOTrainerMixin

K = 4


class _Tok:
    pad_token_id = 0


class _StockFirstStage:
    """The stock train_step up to the group deal: the experience maker splits the batch for the ranks."""

    def __init__(self, args):
        self.args = args
        self.experience_maker = em.LPOExperienceMaker(None, None, None, None, FixedKLController(0.0),
                                                      CPUStrategy(args), _Tok())
        self.calls = []

    def train_step(self, rollout_samples, global_step):
        chunks = self.experience_maker.split_rollout_samples(rollout_samples)
        balanced = ppo_trainer_mod.balance_experiences(chunks, self.args) if self.args.train.dynamic_batch_enable \
            else chunks
        self.calls.append([int(c.sequences.shape[0]) for c in balanced])
        return {"trained_samples": float(sum(self.calls[-1]))}, global_step + 1


class _Trainer(_LPOTrainerMixin, _StockFirstStage):
    pass


def _trainer(tiny_model_dir, dp, dynamic=False):
    extra = ["--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "64", "--rollout.max_tokens_per_gpu",
             "64"] if dynamic else []
    return _Trainer(parse_args(tiny_model_dir, K=K, G=4, micro=2, dp=dp, train_batch=16, extra=extra))


@pytest.mark.parametrize("groups,dp", [(1, 2), (3, 4)])
def test_a_batch_with_fewer_groups_than_ranks_is_skipped(tiny_model_dir, groups, dp, caplog):
    trainer = _trainer(tiny_model_dir, dp)
    samples = make_rollout_samples(groups, K, seed=1)
    with pytest.raises(ValueError, match="cannot give each of the"):  # what the guard protects from
        trainer.experience_maker.split_rollout_samples(make_rollout_samples(groups, K, seed=1))
    status, step = trainer.train_step(samples, 7)
    assert status == {"lpo/skipped_groups": float(groups)} and step == 7  # no step counted
    assert trainer.calls == []  # the stock step never ran
    assert f"skipping a rollout batch of {groups} prompt groups" in caplog.text


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_partial_last_batch_is_trained(tiny_model_dir, dynamic):
    """3 groups for 2 ranks (the recipe's batch holds 4): 2 train, one per rank, the last is dropped."""
    trainer = _trainer(tiny_model_dir, 2, dynamic=dynamic)
    status, step = trainer.train_step(make_rollout_samples(3, K, seed=2), 7)
    assert step == 8 and status == {"trained_samples": float(2 * K)}
    per_rank = trainer.calls[0]
    if dynamic:  # the stock balance_experiences would scatter groups; each rank gets its own run
        assert per_rank == [K, K]
    assert sum(per_rank) == 2 * K
    full, _ = trainer.train_step(make_rollout_samples(4, K, seed=3), 8)
    assert full == {"trained_samples": float(4 * K)}
