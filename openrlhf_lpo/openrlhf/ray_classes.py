"""Ray-side LPO classes swapped into OpenRLHF 0.11.2 by ``openrlhf_lpo.openrlhf.patches``.

Public names (stable):
    LPOPolicyActor      subclass of the class behind ``@ray.remote PolicyModelActor``; builds
                        ``LPOActorTrainer`` instead of ``ActorPPOTrainer``
    LPOTrainer          subclass of the class behind ``@ray.remote PPOTrainer``; uses
                        ``LPOExperienceMaker`` instead of ``RemoteExperienceMaker``
    RemoteLPOPolicyActor = ray.remote(num_gpus=1)(LPOPolicyActor)   (same options as stock)
    RemoteLPOTrainer     = ray.remote(LPOTrainer)
"""

from __future__ import annotations

from unittest import mock

import ray

from openrlhf.trainer import ppo_trainer as _ppo_trainer_mod
from openrlhf.trainer.ray import ppo_actor as _ppo_actor_mod

from openrlhf_lpo.openrlhf.actor_trainer import LPOActorTrainer
from openrlhf_lpo.openrlhf.experience_maker import LPOExperienceMaker

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
