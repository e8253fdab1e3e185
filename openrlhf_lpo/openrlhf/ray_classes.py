"""Ray-side classes swapped into OpenRLHF 0.11.2 by ``openrlhf_lpo.openrlhf.patches``.

Every ``lpo-train`` run, whatever its estimator, gets these classes: the one update loop (``LPOActorTrainer``,
core/update.py) and the runtime safety nets:

* reward errors (``reward_guard.RewardErrorGuard``): every rollout sample's reward error counted,
  ``reward/error_frac`` logged, the run stopped only when errors persist;
* per-request sampling seeds from the run seed and the prompt/sample position (``request_seeds.py``;
  upstream's vLLM requests carry no seed);
* HF exports rotated with ``--ckpt.max_num`` (``HFExportRotation``, openrlhf_lpo/runtime/hf_exports.py; upstream
  rotates only the DeepSpeed state under ``ckpt.path/_actor``).

Public names (stable):
    LPOPolicyActor      subclass of the class behind ``@ray.remote PolicyModelActor``; builds
                        ``LPOActorTrainer`` instead of ``ActorPPOTrainer``; saves a VLM's processor
                        files with its HF checkpoints
    LPOTrainer          subclass of the class behind ``@ray.remote PPOTrainer`` (sync training)
    LPOTrainingActor    subclass of the async trainer's ``TrainingActor``
    LPOTrainerAsync     subclass of ``PPOTrainerAsync``; starts ``LPOTrainingActor``
    RemoteLPOPolicyActor = ray.remote(num_gpus=1)(LPOPolicyActor)   (same options as stock)
    RemoteLPOTrainer, RemoteLPOTrainingActor, RemoteLPOTrainerAsync

The processes that build the prompt dataloader (the trainer; the async sample generator) seed torch
with ``--train.seed`` first, for every estimator (``SeededPromptOrder``): the stock dataloader shuffles
with the process's unseeded global RNG, so two runs with the same seed would see the prompts in
different orders. Both trainers use
``LPOExperienceMaker`` instead of ``RemoteExperienceMaker`` and, for lpo, a
``train_step`` that (1) skips a rollout batch with fewer prompt groups than data-parallel ranks
(the end of an episode), with a warning, and (2) under dynamic batching hands each rank its own
groups (``rank_experiences``) where the stock ``balance_experiences`` would scatter them. Their
``--eval.*`` rounds grade with the project's grader and log the unbiased pass@k
(``evaluation.training_eval``).
"""

from __future__ import annotations

import os
from unittest import mock

import ray

from openrlhf.trainer import ppo_trainer as _ppo_trainer_mod
from openrlhf.trainer import ppo_trainer_async as _async_mod
from openrlhf.trainer.ray import ppo_actor as _ppo_actor_mod
from openrlhf.utils.logging_utils import init_logger

from openrlhf_lpo.runtime.hf_exports import rotate_for_args
from openrlhf_lpo.openrlhf.actor_trainer import LPOActorTrainer
from openrlhf_lpo.openrlhf.cispo import bind_policy_loss, policy_loss_types
from openrlhf_lpo.core.config import dp_size
from openrlhf_lpo.openrlhf.experience_maker import LPOExperienceMaker, rank_experiences
from openrlhf_lpo.openrlhf.request_seeds import SeededGenerateSamples, SeededRollouts
from openrlhf_lpo.openrlhf.reward_guard import RewardErrorGuard
from openrlhf_lpo.openrlhf.research import TrainerExtensions, enabled as research_enabled
from openrlhf_lpo.openrlhf.vlm import save_processor_files
from openrlhf_lpo.upstream import ray_class

__all__ = ["LPOPolicyActor", "LPOTrainer", "LPOTrainingActor", "LPOGenerateSamplesActor", "LPOTrainerAsync",
           "RemoteLPOPolicyActor", "RemoteLPOTrainer", "RemoteLPOTrainingActor", "RemoteLPOTrainerAsync"]

logger = init_logger(__name__)


_StockPolicyActor = ray_class(_ppo_actor_mod.PolicyModelActor)
_StockPPOTrainer = ray_class(_ppo_trainer_mod.PPOTrainer)
_StockTrainingActor = ray_class(_async_mod.TrainingActor)
_StockPPOTrainerAsync = ray_class(_async_mod.PPOTrainerAsync)
_StockGenerateSamplesActor = ray_class(_async_mod.GenerateSamplesActor)


def _seed_prompt_order(strategy) -> None:
    """Seed the global RNG the stock prompt dataloader shuffles with (same seed, same prompt order)."""
    import torch

    torch.manual_seed(int(strategy.args.train.seed))


class SeededPromptOrder:
    """Mixin of every class that builds the prompt dataloader (the sync trainer, the async sample generator),
    for every estimator: torch is seeded with ``--train.seed`` before the stock ``__init__`` shuffles, so the
    runs of one seed see the prompts in one order whatever the method (a paired study's baseline included)."""

    def __init__(self, pretrain, strategy, *args, **kwargs):
        _seed_prompt_order(strategy)
        super().__init__(pretrain, strategy, *args, **kwargs)


# ----------------------------------------------------------------------------- every estimator


class HFExportRotation:
    """Policy-actor mixin: after each checkpoint, rank 0 prunes the ``<tag>_hf`` exports (hf_exports.py)."""

    def save_checkpoint(self, tag, *args, **kwargs):
        result = super().save_checkpoint(tag, *args, **kwargs)
        ckpt = self.strategy.args.ckpt
        if ckpt.save_hf and self.strategy.is_rank_0():
            for path in rotate_for_args(ckpt, keep=[tag]):
                logger.info(f"Removed HF export {path} (--ckpt.max_num / --ckpt.hf_max_num)")
        return result


def _broadcast_to_vllm(self):
    # The stock method's zero-argument super() fails when Ray dispatches it on a subclass of the
    # remote class (measured: "super(type, obj): obj must be an instance or subtype of type");
    # called explicitly, the same stock code runs as written (lock, pause/resume, sync).
    return _StockTrainingActor.broadcast_to_vllm(self)


class _AsyncTrainer(_StockPPOTrainerAsync):
    """PPOTrainerAsync starting our two actor classes (its __init__ looks both up at call time: they are
    swapped for that call only)."""

    training_actor = sample_actor = None

    def __init__(self, *args, **kwargs):
        with mock.patch.object(_async_mod, "TrainingActor", self.training_actor), \
                mock.patch.object(_async_mod, "GenerateSamplesActor", self.sample_actor):
            super().__init__(*args, **kwargs)




# ----------------------------------------------------------------------------- lpo, maxrl, --lpo.end_kl


class LPOPolicyActor(HFExportRotation, _StockPolicyActor):
    def init_model_from_pretrained(self, *args, **kwargs):
        # ppo_actor.py looks ActorPPOTrainer up at call time: swap it for this call only.
        with mock.patch.object(_ppo_actor_mod, "ActorPPOTrainer", LPOActorTrainer), policy_loss_types():
            out = super().init_model_from_pretrained(*args, **kwargs)
        bind_policy_loss(self.trainer, self.strategy.args)  # a registered type under --lpo.end_kl / maxrl
        return out

    # VLM checkpoints: the processor next to the weights (upstream saves only the text tokenizer)
    def _save_processor(self, output_dir: str) -> None:
        if getattr(self.actor, "is_vlm", False) and self.strategy.is_rank_0():
            save_processor_files(self.strategy.args.actor.model_name_or_path, output_dir)

    def save_model(self):
        super().save_model()
        self._save_processor(self.strategy.args.ckpt.output_dir)

    def set_lpo_divergence(self, divergence: str) -> None:
        """--lpo.divergence_schedule: the divergence of the next updates (openrlhf/research.py)."""
        self.trainer.set_divergence(divergence)

    def save_checkpoint(self, tag, *args, **kwargs):
        result = super().save_checkpoint(tag, *args, **kwargs)
        if self.strategy.args.ckpt.save_hf:
            self._save_processor(os.path.join(self.strategy.args.ckpt.path, f"{tag}_hf"))
        return result


class _LPOTrainerMixin:
    """What both trainers (sync and async) change: the experience maker and, for lpo, train_step."""

    def _use_lpo_experience_maker(self):
        stock = self.experience_maker
        self.experience_maker = LPOExperienceMaker(
            stock.actor_model_group,
            stock.critic_model_group,
            stock.reward_model_group,
            stock.initial_model_group,
            stock.kl_ctl,
            stock.strategy,
            stock.tokenizer,
        )

    def train_step(self, rollout_samples, global_step):
        args = self.args
        if args.algo.advantage.estimator != "lpo":
            return super().train_step(rollout_samples, global_step)
        K, dp = args.rollout.n_samples_per_prompt, dp_size(args)
        n_groups = len(rollout_samples) // K
        if n_groups < dp:
            logger.warning(f"LPO: skipping a rollout batch of {n_groups} prompt groups: fewer than the {dp} "
                           "data-parallel ranks (each rank needs whole groups)")
            return {"lpo/skipped_groups": float(n_groups)}, global_step
        ext = self._lpo_extensions()
        if ext is not None:
            ext.before_step(global_step)
        with mock.patch.object(_ppo_trainer_mod, "balance_experiences", lambda exps, _args: rank_experiences(exps, dp)):
            status, step = super().train_step(rollout_samples, global_step)
        return (ext.after_step(global_step, status) if ext is not None else status), step

    # --lpo.divergence_schedule / --lpo.replay_batches: driver-side state (openrlhf/research.py)
    def _lpo_extensions(self):
        if not hasattr(self, "_lpo_ext"):
            self._lpo_ext = TrainerExtensions(self) if research_enabled(self.args) else None
        return self._lpo_ext

    def save_logs_and_checkpoints(self, global_step, logs_dict=None, client_states=None):
        ext = self._lpo_extensions() if self.args.algo.advantage.estimator == "lpo" else None
        if ext is not None:
            client_states = ext.checkpoint(global_step, client_states)
        return super().save_logs_and_checkpoints(global_step, logs_dict, client_states)

    def _compute_rollout_stats(self, experiences):
        ext = self._lpo_extensions() if self.args.algo.advantage.estimator == "lpo" else None
        stock = super()._compute_rollout_stats
        return stock(experiences) if ext is None else ext.fresh_rollout_stats(experiences, stock)


class LPOTrainer(SeededPromptOrder, RewardErrorGuard, SeededRollouts, _LPOTrainerMixin, _StockPPOTrainer):
    def __init__(self, pretrain, strategy, *args, **kwargs):
        super().__init__(pretrain, strategy, *args, **kwargs)
        self._use_lpo_experience_maker()

    def evaluate(self, global_step, **generate_kwargs):
        """``--eval.*`` with the project's grader and the unbiased pass@k (evaluation/training_eval.py)."""
        from evaluation.training_eval import evaluate

        return evaluate(self, global_step, **generate_kwargs)


class LPOTrainingActor(RewardErrorGuard, _LPOTrainerMixin, _StockTrainingActor):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._use_lpo_experience_maker()

    broadcast_to_vllm = _broadcast_to_vllm


RemoteLPOTrainingActor = ray.remote(LPOTrainingActor)


class LPOGenerateSamplesActor(SeededPromptOrder, SeededGenerateSamples, _StockGenerateSamplesActor):
    def _run_eval(self):
        """The async trainer's ``--eval.*`` round with the project's grader (evaluation/training_eval.py)."""
        from functools import partial

        from evaluation.training_eval import compute_eval_metrics

        ours = partial(compute_eval_metrics, tokenizer=self.samples_generator.tokenizer)
        with mock.patch.object(_async_mod, "compute_eval_metrics", ours):
            return super()._run_eval()


RemoteLPOGenerateSamplesActor = ray.remote(LPOGenerateSamplesActor)


class LPOTrainerAsync(_AsyncTrainer):
    training_actor, sample_actor = RemoteLPOTrainingActor, RemoteLPOGenerateSamplesActor


RemoteLPOPolicyActor = ray.remote(num_gpus=1)(LPOPolicyActor)
RemoteLPOTrainer = ray.remote(LPOTrainer)
RemoteLPOTrainerAsync = ray.remote(LPOTrainerAsync)
