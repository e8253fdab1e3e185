"""The policy actor group of a Megatron run, built with its layout (patch point ``megatron-policy-group``).

Inside ``lpo-train``'s run, the stock ``train()`` builds every actor group through the module-level name
``RayActorGroup`` of ``openrlhf.cli.train_ppo_ray``; :func:`policy_group_builder` stands there
(megatron/flags.py ``use_megatron_policy``). It builds the policy group, the one whose actor class is (a subclass
of) OpenRLHF's ``PolicyModelActor``, as a :class:`MegatronPolicyGroup` of the Megatron Ray actor, and every other
group (reference, critic, reward) as upstream's. The group's layout comes in through the constructor:
``duplicate_actors = tp x pp`` (each model replica gets one chunk of experiences) and ``node_block = tp``, strict
(each tensor-parallel group on one node, or no actor starts: ``openrlhf/placement.py`` reads the two when it
places the ranks, before any actor starts).
"""

from __future__ import annotations

import inspect
from typing import Callable

from openrlhf.trainer.ray import ppo_actor

from openrlhf_lpo.megatron.ray_actor import MegatronActorGroup
from openrlhf_lpo.upstream import ray_class

__all__ = ["MegatronPolicyGroup", "is_policy_actor", "policy_group_builder"]


class MegatronPolicyGroup(MegatronActorGroup):
    """``MegatronActorGroup`` (one result per model replica) started with the run's model-parallel layout."""

    node_block_strict = True  # a TP group split over nodes stops the start (openrlhf/placement.py)

    def __init__(self, num_nodes, num_gpus_per_node, ray_actor_type, pg=None, num_gpus_per_actor=1,
                 resources=None, num_resources_per_node=None, *, tp: int, pp: int):
        self.node_block = tp  # read by upstream's _initiate_actors, through our placement swap, in __init__
        super().__init__(num_nodes, num_gpus_per_node, ray_actor_type, pg=pg, num_gpus_per_actor=num_gpus_per_actor,
                         duplicate_actors=tp * pp, resources=resources, num_resources_per_node=num_resources_per_node)


def is_policy_actor(cls) -> bool:
    """Whether the Ray actor class ``cls`` is OpenRLHF's policy actor (or a subclass: the LPO and runtime ones)."""
    plain = ray_class(cls)
    return isinstance(plain, type) and issubclass(plain, ray_class(ppo_actor.PolicyModelActor))


def policy_group_builder(stock_group: type, remote, tp: int, pp: int) -> Callable:
    """What stands for ``RayActorGroup`` in the stock CLI: the policy group as a :class:`MegatronPolicyGroup` of
    ``remote`` (the Megatron Ray actor class), any other as ``stock_group(...)``, with upstream's arguments."""
    signature = inspect.signature(stock_group.__init__)

    def build(num_nodes, num_gpus_per_node, ray_actor_type, *args, **kwargs):
        if not is_policy_actor(ray_actor_type):
            return stock_group(num_nodes, num_gpus_per_node, ray_actor_type, *args, **kwargs)
        given = signature.bind(None, num_nodes, num_gpus_per_node, ray_actor_type, *args, **kwargs).arguments
        given.pop("duplicate_actors", None)  # upstream's DeepSpeed factor; the group's is tp x pp
        for name in ("self", "num_nodes", "num_gpus_per_node", "ray_actor_type"):
            given.pop(name)
        return MegatronPolicyGroup(num_nodes, num_gpus_per_node, remote, tp=tp, pp=pp, **given)

    build.__wrapped__ = stock_group
    return build
