"""vLLM's rollout actor with one sampling setting per sample (the GPU side of openrlhf/request_seeds.py).

``lpo-train`` swaps :data:`RemoteSeededRolloutRayActor` in for ``openrlhf.trainer.ray.vllm_engine.RolloutRayActor``
(patches.py, patch point ``rollout-actor-class``), so ``create_vllm_engines`` starts engines whose
``generate_responses`` takes the K seeded settings of a prompt in one call. Imports vLLM.
"""

from __future__ import annotations

import ray
from openrlhf.trainer.ray import vllm_engine

from openrlhf_lpo.engines.responses import PerSampleResponses

_StockRolloutRayActor = getattr(vllm_engine.RolloutRayActor, "__ray_actor_class__", vllm_engine.RolloutRayActor)


class SeededRolloutRayActor(PerSampleResponses, _StockRolloutRayActor):
    """The stock vLLM actor; ``generate_responses`` runs one setting per sample (vLLM ``SamplingParams``)."""

    PLAIN_PARAMS = False


RemoteSeededRolloutRayActor = ray.remote(SeededRolloutRayActor)
