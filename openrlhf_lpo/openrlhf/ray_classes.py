"""Ray-side LPO classes swapped into OpenRLHF 0.11.2 by ``openrlhf_lpo.openrlhf.patches``.

Public names (stable):
    LPOPolicyActor      subclass of the class behind ``@ray.remote PolicyModelActor``; builds
                        ``LPOActorTrainer`` instead of ``ActorPPOTrainer``; saves a VLM's processor
                        files with its HF checkpoints
    LPOTrainer          subclass of the class behind ``@ray.remote PPOTrainer``; uses
                        ``LPOExperienceMaker`` instead of ``RemoteExperienceMaker``
    RemoteLPOPolicyActor = ray.remote(num_gpus=1)(LPOPolicyActor)   (same options as stock)
    RemoteLPOTrainer     = ray.remote(LPOTrainer)
"""

from __future__ import annotations

import os
from unittest import mock

import ray

from openrlhf.trainer import ppo_trainer as _ppo_trainer_mod
from openrlhf.trainer.ray import ppo_actor as _ppo_actor_mod

from openrlhf_lpo.openrlhf.actor_trainer import LPOActorTrainer
from openrlhf_lpo.openrlhf.experience_maker import LPOExperienceMaker
from openrlhf_lpo.openrlhf.vlm import save_processor_files

__all__ = ["LPOPolicyActor", "LPOTrainer", "RemoteLPOPolicyActor", "RemoteLPOTrainer", "unwrap_ray_class"]


def unwrap_ray_class(cls):
    """The plain Python class behind a ``@ray.remote`` class (itself if it is plain)."""
    return getattr(cls, "__ray_actor_class__", cls)


_StockPolicyActor = unwrap_ray_class(_ppo_actor_mod.PolicyModelActor)
_StockPPOTrainer = unwrap_ray_class(_ppo_trainer_mod.PPOTrainer)


class LPOPolicyActor(_StockPolicyActor):
    def init_model_from_pretrained(self, *args, **kwargs):
        # ppo_actor.py looks ActorPPOTrainer up at call time: swap it for this call only.
        with mock.patch.object(_ppo_actor_mod, "ActorPPOTrainer", LPOActorTrainer):
            return super().init_model_from_pretrained(*args, **kwargs)

    # VLM checkpoints: the processor next to the weights (upstream saves only the text tokenizer)
    def _save_processor(self, output_dir: str) -> None:
        if getattr(self.actor, "is_vlm", False) and self.strategy.is_rank_0():
            save_processor_files(self.strategy.args.actor.model_name_or_path, output_dir)

    def save_model(self):
        super().save_model()
        self._save_processor(self.strategy.args.ckpt.output_dir)

    def save_checkpoint(self, tag, *args, **kwargs):
        result = super().save_checkpoint(tag, *args, **kwargs)
        if self.strategy.args.ckpt.save_hf:
            self._save_processor(os.path.join(self.strategy.args.ckpt.path, f"{tag}_hf"))
        return result


class LPOTrainer(_StockPPOTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
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


RemoteLPOPolicyActor = ray.remote(num_gpus=1)(LPOPolicyActor)
RemoteLPOTrainer = ray.remote(LPOTrainer)
