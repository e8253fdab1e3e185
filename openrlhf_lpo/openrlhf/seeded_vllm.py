"""vLLM's rollout actor with one sampling setting per sample (the GPU side of openrlhf/request_seeds.py).

``lpo-train`` swaps :data:`RemoteSeededRolloutRayActor` in for ``openrlhf.trainer.ray.vllm_engine.RolloutRayActor``
(patches.py, patch point ``rollout-actor-class``), so ``create_vllm_engines`` starts engines whose
``generate_responses`` takes the K seeded settings of a prompt in one call, and whose weight sync takes one bucket
of tensors per call in sequence order (:mod:`openrlhf_lpo.engines.weight_updates`): the actor starts its vLLM
workers with the worker extension of :mod:`openrlhf_lpo.engines.vllm_worker` instead of OpenRLHF's ``WorkerWrap``
(a subclass: upstream's per-tensor methods stay). Imports vLLM.
"""

from __future__ import annotations

import ray
from openrlhf.trainer.ray import vllm_engine

from openrlhf_lpo.engines.responses import PerSampleResponses
from openrlhf_lpo.engines.weight_updates import BucketUpdates

UPSTREAM_WORKER_EXTENSION = "openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap"

_StockRolloutRayActor = getattr(vllm_engine.RolloutRayActor, "__ray_actor_class__", vllm_engine.RolloutRayActor)


class SeededRolloutRayActor(BucketUpdates, PerSampleResponses, _StockRolloutRayActor):
    """The stock vLLM actor; ``generate_responses`` runs one setting per sample (vLLM ``SamplingParams``); the
    bucketed, ordered weight sync goes to the workers' extension by ``collective_rpc``."""

    PLAIN_PARAMS = False

    async def __init__(self, *args, **kwargs):
        from openrlhf_lpo.engines.vllm_worker import WORKER_EXTENSION

        if kwargs.get("worker_extension_cls") == UPSTREAM_WORKER_EXTENSION:
            kwargs["worker_extension_cls"] = WORKER_EXTENSION
        await super().__init__(*args, **kwargs)

    async def _receive_bucket(self, metas, empty_cache):
        return await self.llm.collective_rpc("update_weight_bucket", args=(metas, empty_cache))

    async def _receive_bucket_ipc(self, metas, ipc_handles, empty_cache):
        return await self.llm.collective_rpc("update_weight_bucket_ipc", args=(metas, ipc_handles, empty_cache))

    async def _device_ids(self):
        return await self.llm.collective_rpc("weight_sync_device_id")


RemoteSeededRolloutRayActor = ray.remote(SeededRolloutRayActor)
